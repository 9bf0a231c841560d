"""The deterministic-mode lever: the switches it sets and restores, the refusal of a kernel without a
deterministic implementation, its controls' power on a tiny attention case, and the reduction
control's order of addition on gloo ranks."""

import os
from dataclasses import replace

import pytest
import torch

from correctness.attention import backend_lever as attention
from correctness.attention.sdpa import Sdpa
from correctness.composites.determinism import lever as determinism
from correctness.composites.determinism.mode import NVTE_SWITCH, InMode
from correctness.distributed import run_ranks
from correctness.errors import ImplementationUnavailable
from correctness.harness import run_case
from correctness.lever import LeverOptions, ImplementationOutput
from correctness.grad_reduction.megatron_sync import summed_in_varying_order
from tests.attention_shapes import tiny_shape

GEMMA = "gemma-4-31b/h100/attune-tp2-pp4-split13"


class Recorder:
    name = "recorder"

    def __init__(self, error=None):
        self.error = error
        self.seen = []

    def run(self, inputs):
        self.seen.append((torch.are_deterministic_algorithms_enabled(), os.environ.get(NVTE_SWITCH)))
        if self.error:
            raise self.error
        return ImplementationOutput(tensors={"x": torch.zeros(1)}, backend="recorder")


def test_in_mode_sets_the_switches_around_the_call_and_restores_them():
    before = (torch.are_deterministic_algorithms_enabled(), os.environ.get(NVTE_SWITCH))
    base = Recorder()
    on = InMode(base, deterministic=True).run(None)
    InMode(base, deterministic=False).run(None)
    assert base.seen == [(True, "0"), (False, "1")]
    assert (torch.are_deterministic_algorithms_enabled(), os.environ.get(NVTE_SWITCH)) == before
    assert on.details["deterministic_mode"]["torch_deterministic_algorithms"] is True
    assert on.details["deterministic_mode"][NVTE_SWITCH] == "0"
    assert InMode(base, deterministic=True).name == "recorder (deterministic mode)"


def test_a_kernel_without_a_deterministic_implementation_refuses_only_in_deterministic_mode():
    error = RuntimeError("index_add_cuda_ does not have a deterministic implementation, but you set ...")
    refused = "under deterministic mode torch refuses it: index_add_cuda_ does not"
    with pytest.raises(ImplementationUnavailable, match=refused):
        InMode(Recorder(error), deterministic=True).run(None)
    with pytest.raises(RuntimeError, match="does not have a deterministic"):
        InMode(Recorder(error), deterministic=False).run(None)
    with pytest.raises(RuntimeError, match="out of memory"):
        InMode(Recorder(RuntimeError("CUDA out of memory")), deterministic=True).run(None)
    assert not torch.are_deterministic_algorithms_enabled()


@pytest.fixture(scope="module")
def tiny_lever():
    """The CPU attention lever of the Gemma recipe on one tiny BF16 case."""
    lever = determinism.cpu_tier(GEMMA, LeverOptions())[0]
    case = attention.synthetic_case(tiny_shape(dtype="bf16", seq_len=64, head_dim=32), 0, "model-like")
    return replace(lever, cases=(case,))


def test_the_deterministic_candidate_passes_and_each_control_fails_its_half_of_the_rule(tiny_lever):
    result = run_case(tiny_lever, tiny_lever.cases[0])
    assert result.status == "pass", result.failures
    assert result.runs == 3 and result.deterministic and result.candidate_spread == () and result.default_spread == ()
    order, scale = result.controls
    assert order.name == "accumulation order varies between runs"
    assert order.fails_repeatability and not order.fails_bound
    assert sorted(s.tensor for s in order.spread) == ["dk", "dq", "dv"]
    assert all(s.differing_elements == 2 and s.runs == 3 for s in order.spread)  # its first run moved one, each repeat another
    assert scale.name == "wrong softmax scale" and scale.fails_bound and not scale.fails_repeatability


def test_a_candidate_whose_last_bit_moves_between_runs_fails_the_lever(tiny_lever):
    flaky = determinism.LastBitMovesEachRun(InMode(Sdpa("flash"), deterministic=True), tensors=("dv",))
    result = run_case(replace(tiny_lever, candidate=flaky), tiny_lever.cases[0])
    assert result.status == "fail"
    assert [f.split(":")[0] for f in result.failures] == ["candidate dv"]
    assert "not bitwise repeatable over 3 runs: 2 of" in result.failures[0]


def _varying_sums(rank, world_size):
    import torch.distributed as dist

    buffer = torch.randn(4096, generator=torch.Generator().manual_seed(rank))
    group = dist.new_group(list(range(world_size)))
    return [summed_in_varying_order(buffer, group, run) for run in range(3)]


@pytest.mark.parametrize("ranks", [2, 4])
def test_the_reduction_control_changes_its_bits_between_runs_only_with_more_than_two_ranks(ranks):
    sums = run_ranks(_varying_sums, ranks)[0]
    same = [torch.equal(sums[0].view(torch.int32), s.view(torch.int32)) for s in sums[1:]]
    assert same == ([True, True] if ranks == 2 else [False, False])
    expected = sum(torch.randn(4096, generator=torch.Generator().manual_seed(r)).double() for r in range(ranks))
    assert float((sums[1].double() - expected).abs().max()) < 1e-5


def test_the_lever_declares_the_repeatability_rule_with_its_reason():
    levers = determinism.cpu_tier(GEMMA, LeverOptions())
    assert {lever.rule for lever in levers} == {determinism.RULE}
    assert all(lever.rule.runs == 3 and lever.rule.bitwise_repeatable and lever.rule_reason for lever in levers)
    reduction = levers[1]
    assert [c.name for c in reduction.controls] == ["ranks summed in another order each run", "one rank dropped"]
