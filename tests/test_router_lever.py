"""The moe-router-dtype lever: its FP64 reference against a token-by-token loop, its BF16 format
floor (the reference from the rounded logits), the recipe's router settings and their sources,
Megatron's TopKRouter on the CPU against the reference, and the lever end to end at a small shape:
BF16 logits with softmax scoring are format-limited and every control fails the format bound;
Megatron's sigmoid routing, which rounds its scores to BF16 again, fails as biased beyond the floor;
the wrong BF16 implementations (truncated logits, a split-K reduction in BF16) fail where the honest
router is format-limited; an FP64 router passes against FP32."""

from dataclasses import replace
from functools import partial

import pytest
import torch

from correctness import LeverOptions
from correctness.harness import run_candidates, run_case
from correctness.lever import Case, NotApplicable
from correctness.models import facts_for
from correctness.recipes import lever_recipe
from correctness.router import lever as router
from correctness.router.floor import Fp64Routing
from correctness.router.inputs import make_inputs
from correctness.router.megatron_router import LOGITS_SPLIT_K, LOGITS_TRUNCATED, MegatronRouter
from correctness.router.settings import router_settings
from correctness.router.wrong import WRONG_IMPLEMENTATIONS
from references.router import route

NEMOTRON = "nemotron-3-super-120b-a12b/h200/attune-tp4-pp2-ep8-mt16k"
QWEN3_MOE = "qwen3-30b-a3b/h100/example-tp2-ep4-offload07"
MOONLIGHT = "moonlight-16b-a3b/h100/example-tp2-ep4-offload07"
GEMMA = "gemma-4-31b/h100/attune-tp2-pp4-split13"


def settings_of(recipe_id):
    recipe = lever_recipe(recipe_id)
    return router_settings(recipe, facts_for(recipe, None))


def looped_routing(logits, top_k, score_function, scaling, bias):
    """Token by token, in Python: the formula the reference implements (no groups)."""
    weights = torch.zeros_like(logits)
    for t, row in enumerate(logits):
        if score_function == "sigmoid":
            scores = torch.sigmoid(row)
            ranked = scores + (bias if bias is not None else 0)
            chosen = sorted(range(len(row)), key=lambda e: -float(ranked[e]))[:top_k]
            total = sum(float(scores[e]) for e in chosen)
            for e in chosen:
                weights[t, e] = float(scores[e]) / total * (scaling or 1.0)
        else:
            chosen = sorted(range(len(row)), key=lambda e: -float(row[e]))[:top_k]
            exps = [torch.exp(row[e] - max(row[c] for c in chosen)) for e in chosen]
            for e, x in zip(chosen, exps):
                weights[t, e] = float(x / sum(exps)) * (scaling or 1.0)
    return weights


@pytest.mark.parametrize("score_function,scaling,with_bias", [("sigmoid", 2.5, True), ("softmax", None, False)])
def test_reference_matches_a_loop_over_tokens(score_function, scaling, with_bias):
    g = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(12, 16, generator=g, dtype=torch.float64), torch.randn(10, 16, generator=g, dtype=torch.float64)
    bias = 0.1 * torch.randn(10, generator=g, dtype=torch.float64) if with_bias else None
    result = route(hidden, weight, top_k=3, score_function=score_function, scaling_factor=scaling, expert_bias=bias)
    expected = looped_routing(hidden @ weight.t(), 3, score_function, scaling, bias)
    torch.testing.assert_close(result["weights"], expected, rtol=1e-12, atol=1e-12)
    assert (result["chosen"].sum(dim=-1) == 3).all() and (result["boundary_gap"] > 0).all()


def test_reference_group_limited_choice_keeps_to_the_best_groups():
    g = torch.Generator().manual_seed(4)
    hidden, weight = torch.randn(20, 8, generator=g), torch.randn(16, 8, generator=g)
    result = route(hidden, weight, top_k=4, score_function="sigmoid", num_groups=4, group_topk=2)
    groups = result["chosen"].reshape(20, 4, 4).any(dim=-1).sum(dim=-1)
    assert (groups <= 2).all()
    one_group = route(hidden, weight, top_k=4, score_function="sigmoid", num_groups=1, group_topk=1)
    plain = route(hidden, weight, top_k=4, score_function="sigmoid")
    assert torch.equal(one_group["weights"], plain["weights"])


def test_settings_come_from_the_recipe_the_provider_and_the_facts():
    nemotron = settings_of(NEMOTRON)
    assert (nemotron.experts, nemotron.top_k, nemotron.score_function, nemotron.scaling_factor) == (512, 22, "sigmoid", 5.0)
    assert nemotron.router_dtype == "fp32" and nemotron.expert_bias and not nemotron.router_bias
    assert nemotron.sources["router_dtype"].startswith("Megatron-Bridge") and nemotron.sources["top_k"] == "model facts"
    qwen = settings_of(QWEN3_MOE)
    assert (qwen.score_function, qwen.router_dtype, qwen.expert_bias) == ("softmax", "fp32", False)
    assert qwen.sources["router_dtype"] == "recipe --moe-router-dtype"
    moonlight = settings_of(MOONLIGHT)
    assert moonlight.expert_bias and moonlight.scaling_factor == pytest.approx(2.446)


def test_a_dense_model_is_not_applicable():
    with pytest.raises(NotApplicable, match="no experts"):
        router.cpu_tier(GEMMA, LeverOptions())


def small(lever, seq_len=48, hidden=256):
    """The lever at fewer tokens and a smaller hidden size (experts, top-k and scoring kept)."""
    shape = replace(lever.cases[0].shape, seq_len=seq_len, hidden=hidden)
    case = Case(id=f"{shape.id}-seed0", shape=shape, seed=0, source="synthetic", variant="model-like",
                make_inputs=partial(make_inputs, shape, 0))
    return replace(lever, cases=(case,))


def test_megatron_fp32_router_matches_the_reference():
    lever = small(router.cpu_tier(NEMOTRON, LeverOptions())[0])
    inputs = lever.cases[0].make_inputs(torch.device("cpu"))
    output = MegatronRouter("fp32").run(inputs)
    reference = inputs.reference
    assert torch.equal(output.tensors["combination_weights"] != 0, reference["chosen"])
    torch.testing.assert_close(output.tensors["combination_weights"].double(), reference["weights"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(output.tensors["logits"].double(), reference["logits"], rtol=1e-5, atol=1e-5)
    assert output.details["routing"]["expert_set_changed"] == 0


def test_the_floor_is_the_reference_routing_of_the_rounded_logits():
    lever = small(router.cpu_tier(QWEN3_MOE, LeverOptions())[0])
    inputs = lever.cases[0].make_inputs(torch.device("cpu"))
    floor = lever.format_floor.implementation.run(inputs).tensors
    rounded = inputs.reference["logits"].to(torch.bfloat16).double()
    shape = inputs.shape
    from_rounded = route(rounded, torch.eye(shape.experts, dtype=torch.float64), top_k=shape.top_k,
                         score_function=shape.score_function, pre_softmax=shape.pre_softmax)
    assert torch.equal(floor["logits"].double(), rounded)
    assert torch.equal(floor["combination_weights"].double(), from_rounded["weights"].to(torch.bfloat16).double())
    assert all(tensor.dtype == torch.float32 for tensor in floor.values())
    assert router.cpu_tier(QWEN3_MOE, LeverOptions(), candidate_dtype="fp64")[0].format_floor is None


@pytest.fixture(scope="module")
def softmax_results():
    """The honest BF16 router and the wrong BF16 implementations at a small Qwen3 case (softmax)."""
    lever = small(router.cpu_tier(QWEN3_MOE, LeverOptions())[0])
    paths = [lever.candidate, *(wrong.build(lever.candidate) for wrong in WRONG_IMPLEMENTATIONS)]
    return dict(zip(["honest", *(wrong.name for wrong in WRONG_IMPLEMENTATIONS)],
                    run_candidates(lever, lever.cases[0], paths, repeat=False)))


def test_bf16_logits_with_softmax_scoring_are_format_limited(softmax_results):
    result = softmax_results["honest"]
    assert result.status == "format-limited", result.failures + list(result.format.findings)
    assert result.format.outside_rule and "logits" in result.format.floor_fails_rule
    assert len(result.format.controls) == 3 and all(control.fails for control in result.format.controls)


def test_wrong_bf16_logits_fail_where_the_honest_router_is_format_limited(softmax_results):
    truncated = softmax_results[LOGITS_TRUNCATED]
    assert truncated.status == "fail"
    assert any(line.startswith("candidate logits: systematic error") and "biased beyond the BF16 floor" in line
               for line in truncated.format.findings), truncated.format.findings
    split_k = softmax_results[LOGITS_SPLIT_K]
    assert split_k.status == "fail"
    assert any(line.startswith("candidate against the BF16 floor logits: error") and "worse than BF16 allows" in line
               for line in split_k.format.findings), split_k.format.findings


def test_megatron_sigmoid_routing_is_the_floors_routing_token_by_token():
    """Megatron's unfused sigmoid routing casts its FP32 sigmoid scores back to the logits' BF16
    (moe_utils.topk_routing_with_score_function), as the floor's BF16 score tensor is: its choice is
    the floor's, token by token, where the logits' rounding alone would change fewer expert sets."""
    lever = small(router.cpu_tier(NEMOTRON, LeverOptions())[0])
    inputs = lever.cases[0].make_inputs(torch.device("cpu"))
    chosen = MegatronRouter(None).run(inputs).tensors["combination_weights"] != 0
    floor = lever.format_floor.implementation.run(inputs).tensors["combination_weights"] != 0
    assert torch.equal(chosen, floor)
    logits_only = inputs.routed(round_logits=lambda logits: logits.to(torch.bfloat16))["chosen"]
    changed = {name: int((routing != inputs.reference["chosen"]).any(dim=-1).sum()) for name, routing in
               (("candidate", chosen), ("logits only", logits_only))}
    assert changed["candidate"] > changed["logits only"] > 0, changed


def test_bf16_sigmoid_routing_is_format_limited_and_every_control_fails_the_format_bound():
    lever = small(router.cpu_tier(NEMOTRON, LeverOptions())[0])
    result = run_case(lever, lever.cases[0])
    assert result.status == "format-limited", result.failures + list(result.format.findings)
    applied = [c for c in result.controls if c.judgement is not None]
    assert [c.name for c in applied] == [c.name for c in result.format.controls]
    assert "top-k one less" not in [c.name for c in applied]  # top-22: within BF16 routing's own error
    assert all(control.fails for control in result.format.controls)
    figures = result.summary["expert_set_vs_fp64"]
    assert figures["default"]["expert_set_changed"] == 0
    assert figures["candidate"]["expert_set_changed"] > 0


def test_an_fp64_router_passes_against_fp32():
    lever = small(router.cpu_tier(QWEN3_MOE, LeverOptions(), candidate_dtype="fp64")[0])
    result = run_case(lever, lever.cases[0])
    assert result.status == "pass", result.failures
    assert result.format is None
    assert lever.description.startswith("Megatron's MoE router with its logits in FP64 against FP32")


def test_the_record_names_the_te_gemm_shim_only_where_it_bound_the_name(monkeypatch):
    """Beside TE 2.17 megatron-core 0.16.1 binds moe_utils.te_general_gemm to None itself (its import
    of TE's get_workspace, removed in TE 2.11, fails), and the router's GEMM is torch.mm with no shim;
    without TE the name is undefined and the shim binds it."""
    from megatron.core.transformer.moe import moe_utils

    inputs = small(router.cpu_tier(NEMOTRON, LeverOptions())[0]).cases[0].make_inputs(torch.device("cpu"))
    monkeypatch.setattr(moe_utils, "te_general_gemm", None, raising=False)
    bound_by_megatron = MegatronRouter(None).run(inputs).details
    monkeypatch.delattr(moe_utils, "te_general_gemm")
    bound_by_the_shim = MegatronRouter(None).run(inputs).details
    assert "te_general_gemm undefined -> None" not in bound_by_megatron["shims"]
    assert "te_general_gemm undefined -> None" in bound_by_the_shim["shims"]
    assert bound_by_megatron["gemm"].startswith("torch.mm") and bound_by_the_shim["gemm"].startswith("torch.mm")
