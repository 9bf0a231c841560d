"""The MoE permute-fusion levers: the FP64 permutation, Megatron's torch permutation against it bit
for bit, the exact rule, and the CPU tier on a small shape (a stand-in with one wrong row fails)."""

from dataclasses import replace

import pytest
import torch

from correctness.harness import run_case
from correctness.lever import Case, LeverOptions, NotApplicable
from correctness.models import facts_for
from correctness.moe import permutation, permute_lever
from correctness.recipes import lever_recipe
from references import moe_experts

QWEN3_MOE = "qwen3-30b-a3b/h100/example-tp2-ep4-offload07"
GEMMA = "gemma-4-31b/h100/attune-tp2-pp4-split13"


def test_reference_permutation_groups_by_expert_and_combines_back():
    routing_map = torch.tensor([[True, False, True], [True, True, False]])
    probs = torch.tensor([[0.25, 0.0, 0.75], [0.5, 0.5, 0.0]])
    tokens = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    rows, row_probs = moe_experts.permute(tokens, routing_map, probs)
    assert rows.tolist() == [[1, 2], [3, 4], [3, 4], [1, 2]]  # expert 0: tokens 0, 1; expert 1: 1; expert 2: 0
    assert row_probs.tolist() == [0.25, 0.5, 0.5, 0.75]
    assert moe_experts.unpermute(rows, routing_map, probs).tolist() == tokens.tolist()  # weights sum to 1
    assert moe_experts.unpermute(rows, routing_map).tolist() == (2 * tokens).tolist()


def _small_levers(candidate=None):
    levers = permute_lever.cpu_tier(QWEN3_MOE, LeverOptions())
    model = facts_for(lever_recipe(QWEN3_MOE), None)
    shape = replace(levers[0].cases[0].shape, tokens=16, expert_input=32)
    case = Case(id="small", shape=shape, seed=5, source="synthetic", variant="routed-top-k",
                make_inputs=lambda device: permutation.make_permute_inputs(shape, model, 5, device))
    return [replace(lever, cases=(case,), candidate=candidate or lever.candidate) for lever in levers]


def test_the_gathers_are_judged_bit_for_bit_and_the_sums_by_the_rule():
    exact, sums = _small_levers()
    assert (exact.name, sums.name) == (permute_lever.EXACT_NAME, permute_lever.SUMS_NAME)
    assert exact.rule.bound(0.0) == 0.0 and exact.rule_reason
    assert sums.rule.bound(0.0) > 0.0
    for lever in (exact, sums):
        result = run_case(lever, lever.cases[0])
        assert result.status == "pass", result.failures
        assert all(control.fails_bound for control in result.controls)
    result = run_case(exact, exact.cases[0])
    assert all(tensor.error == 0.0 and tensor.default_error == 0.0 for tensor in result.candidate.tensors)


class OneRowOff:
    """The stand-in with its last permuted row taken from the row before: one wrong row."""

    name = "one-row-off"

    def run(self, inputs):
        output = permutation.IndexPermutation().run(inputs)
        tensors = dict(output.tensors)
        rows = tensors["permuted_tokens"].clone()
        rows[-1] = rows[-2]
        tensors["permuted_tokens"] = rows
        return replace(output, tensors=tensors)


def test_one_wrong_row_fails_the_exact_lever():
    exact, _ = _small_levers(permutation.Judged(OneRowOff(), permutation.EXACT_TENSORS))
    assert run_case(exact, exact.cases[0]).status == "fail"


def test_a_dense_model_is_not_applicable():
    with pytest.raises(NotApplicable, match="dense"):
        permute_lever.cpu_tier(GEMMA, LeverOptions())
