"""The torch SDPA GPU combinations that can give evidence (correctness.attention.combinations): each
dispatch rule of torch's sdp_utils at these shapes, the backends each GPU tier keeps at the seed
recipes' shapes, and a re-shaped flash that runs packed rows one at a time. Built on the CPU; no
GPU kernel runs here."""

import pytest
import torch

from correctness.attention import backend_lever as attention
from correctness.attention import thd_packing_lever as packing
from correctness.attention.combinations import dispatch_refusal, gpu_sdpa_levers, sdpa_combination
from correctness.attention.inputs import synthetic_inputs
from correctness.composites.determinism import lever as determinism
from correctness.lever import LeverOptions, NotApplicable
from correctness.recipe_sets import GEMMA, NEMOTRON
from tests.attention_shapes import tiny_shape

PLAIN = tiny_shape(window=None, dtype="bf16", head_dim=128)  # plain causal BSHD: is_causal, no mask


@pytest.mark.parametrize(("backend", "shape", "deterministic", "rule"), [
    ("flash", tiny_shape(dtype="bf16", head_dim=256), False, "takes no attention mask"),
    ("flash", PLAIN.with_changes(qkv_format="thd"), False, "packed THD rows need one"),
    ("flash", PLAIN.with_changes(head_dim=512), False, "one head dim of at most 256"),
    ("cudnn", PLAIN.with_changes(head_dim=512), False, "head dims of at most 256"),
    ("cudnn", PLAIN, True, "whenever deterministic algorithms are on"),
    ("cudnn", tiny_shape(window=None, dtype="bf16", head_dim=160), False, "backward takes head dims of at most 128"),
    ("efficient", tiny_shape(window=None, dtype="bf16", head_dim=12), False, "divisible by 8 at bf16"),
])
def test_each_dispatch_rule_refuses_what_torch_refuses(backend, shape, deterministic, rule):
    reason = dispatch_refusal(backend, shape, deterministic=deterministic)
    assert reason is not None and rule in reason and "sdp_utils.cpp" in reason


@pytest.mark.parametrize("backend", ["flash", "efficient", "cudnn"])
def test_no_backend_runs_what_the_sdpa_path_cannot_express(backend):
    assert "no logit softcap argument" in dispatch_refusal(backend, PLAIN.with_changes(softcap=50.0))
    assert "no attention sinks" in dispatch_refusal(backend, PLAIN.with_changes(sinks=True))


@pytest.mark.parametrize(("backend", "shape"), [
    ("flash", PLAIN), ("flash", PLAIN.with_changes(head_dim=256)), ("cudnn", PLAIN.with_changes(head_dim=256)),
    ("cudnn", tiny_shape(dtype="bf16", head_dim=128)), ("efficient", tiny_shape(dtype="bf16", head_dim=512)),
    ("efficient", PLAIN.with_changes(qkv_format="thd", head_dim=512)), ("efficient", tiny_shape(head_dim=12)),
])
def test_what_the_rules_allow_is_left_to_run(backend, shape):
    assert dispatch_refusal(backend, shape) is None


def test_efficient_is_left_to_run_where_the_path_pads_v_and_q_to_one_head_dim():
    # q and k of 12, V of 128: the path's zero-padded attempt gives efficient attention 128 throughout
    shape = PLAIN.with_changes(head_dim=12)
    assert shape.v_head_dim == 128 and dispatch_refusal("efficient", shape) is None


def backends(levers):
    return [lever.candidate.name for lever in levers]


def test_the_attention_gpu_tier_keeps_efficient_and_cudnn_at_gemmas_shapes():
    levers = attention.gpu_sdpa_tier(GEMMA, LeverOptions())
    assert backends(levers) == ["sdpa-efficient", "sdpa-cudnn"]  # flash: masked sliding layers, d512 global ones
    efficient, cudnn = levers
    assert all(case.skip_reason is None for case in efficient.cases if case.source == "synthetic")
    refused = {case.id: case for case in cudnn.cases if case.shape.head_dim == 512}
    assert refused and all(not case.required and "head dims of at most 256" in case.skip_reason
                           for case in refused.values())
    assert all(case.skip_reason is None and case.required
               for case in cudnn.cases if case.shape.head_dim == 256 and case.source == "synthetic")


def test_the_deterministic_gpu_tier_keeps_only_what_runs_under_deterministic_algorithms():
    gemma = determinism.gpu_tier(GEMMA, LeverOptions())
    assert backends(gemma[:-1]) == ["sdpa-efficient (deterministic mode)"]
    nemotron = determinism.gpu_tier(NEMOTRON, LeverOptions())
    assert backends(nemotron[:-1]) == ["sdpa-flash-per-row (deterministic mode)", "sdpa-efficient (deterministic mode)"]
    assert all(case.skip_reason is None for lever in nemotron[:-1] for case in lever.cases)
    assert nemotron[-1].name == determinism.NAME and "nccl" in nemotron[-1].candidate.name  # the reduction stays


def test_the_packing_gpu_tier_keeps_the_packed_call():
    levers = packing.gpu_sdpa_tier(NEMOTRON, LeverOptions())
    assert backends(levers) == ["sdpa-efficient", "sdpa-cudnn"]
    assert all(case.skip_reason is None for lever in levers for case in lever.cases)


def test_a_backend_refused_on_every_case_is_dropped_with_the_rules():
    case = attention.synthetic_case(tiny_shape(dtype="bf16", head_dim=512), 0, "model-like")
    combination = sdpa_combination("flash", (case,))
    assert combination.dropped.startswith("sdpa-flash: torch SDPA flash takes no attention mask")
    with pytest.raises(NotApplicable, match="no torch SDPA backend can run these cases on a CUDA GPU: sdpa-flash"):
        gpu_sdpa_levers(("flash",), (case,), lambda path, cases: pytest.fail("nothing may be built"))


def test_flash_runs_packed_rows_one_at_a_time_only_where_asked():
    case = packing.packing_case(tiny_shape(window=None, dtype="bf16", qkv_format="thd"), 0)
    assert sdpa_combination("flash", (case,)).dropped is not None
    apart = sdpa_combination("flash", (case,), rows_apart=True)
    assert apart.dropped is None and apart.path.name == "sdpa-flash-per-row"
    inputs = synthetic_inputs(case.shape, 0, torch.device("cpu"), "model-like")
    output = apart.path.run(inputs)  # torch's flash CPU kernel, each row with is_causal
    assert output.backend == "sdpa-flash (cpu kernel), 2 rows one at a time"
    assert output.tensors["out"].shape == inputs.grad_out.shape
