"""The MoE grouped-GEMM lever: its FP64 reference, its shapes from the recipes, torch's CPU grouped
matmul, and its CPU tier on a small shape (a correct candidate passes, a wrong one fails)."""

from dataclasses import replace

import pytest
import torch

from correctness.harness import run_case
from correctness.lever import Case, LeverOptions, Mutated, NotApplicable
from correctness.models import facts_for
from correctness.moe import experts, grouped_gemm_lever
from correctness.moe.shapes import moe_shape
from correctness.recipes import lever_recipe
from references.moe_experts import experts_mlp, experts_mlp_with_grads

NEMOTRON = "nemotron-3-super-120b-a12b/h200/attune-tp4-pp2-ep8-mt16k"
GEMMA = "gemma-4-31b/h100/attune-tp2-pp4-split13"


def test_reference_is_each_expert_mlp_row_by_row():
    generator = torch.Generator().manual_seed(0)
    counts = [2, 0, 3]
    rows, probs = torch.randn(5, 4, generator=generator), torch.rand(5, generator=generator)
    w1, w2 = torch.randn(3, 6, 4, generator=generator), torch.randn(3, 4, 3, generator=generator)
    out = experts_mlp(rows.double(), counts, w1.double(), w2.double(), probs.double(), "swiglu")
    expert_of_row = [0, 0, 2, 2, 2]
    for row, expert in enumerate(expert_of_row):
        h = w1[expert].double() @ rows[row].double()
        hidden = torch.nn.functional.silu(h[:3]) * h[3:] * probs[row].double()
        torch.testing.assert_close(out[row], w2[expert].double() @ hidden, rtol=1e-12, atol=1e-12)
    w2_ungated = torch.randn(3, 4, 6, generator=generator)
    grads = experts_mlp_with_grads(rows, counts, w1, w2_ungated, probs, torch.ones(5, 4), "squared_relu")
    assert not grads["grad_fc1_weight1"].any() and not grads["grad_fc2_weight1"].any()  # the expert with no row


def test_shapes_come_from_the_recipe_and_the_model():
    recipe = lever_recipe(NEMOTRON)
    model = facts_for(recipe, None)
    at_scale = moe_shape(recipe, model, "recipe", "experts")
    assert at_scale.local_experts == 512 // recipe.positive_int("layout.ep")
    assert (at_scale.expert_input, at_scale.ffn, at_scale.top_k) == (1024, 2688, 22)  # the latent size
    assert at_scale.activation == "squared_relu" and not at_scale.gated
    assert at_scale.tokens == recipe.row_tokens * recipe.rows_per_microbatch // recipe.tp * recipe.positive_int("layout.ep")
    (lever,) = grouped_gemm_lever.cpu_tier(NEMOTRON, LeverOptions())
    counts = lever.cases[0].make_inputs(torch.device("cpu")).counts
    assert counts[experts.EMPTY_LOCAL_EXPERT] == 0 and len(set(counts)) > 2  # uneven, one expert empty


def test_a_dense_model_is_not_applicable():
    with pytest.raises(NotApplicable, match="dense"):
        grouped_gemm_lever.cpu_tier(GEMMA, LeverOptions())


def test_torch_grouped_mm_runs_on_the_cpu_and_refuses_fp64():
    """What torch 2.13 offers on the CPU: grouped_mm in BF16 and FP32 (forward and backward), not FP64."""
    rows = torch.randn(5, 16, dtype=torch.bfloat16, requires_grad=True)  # rows of 16-byte multiples, as it needs
    weights = torch.randn(2, 8, 16, dtype=torch.bfloat16, requires_grad=True)
    offsets = torch.tensor([2, 5], dtype=torch.int32)
    out = torch.nn.functional.grouped_mm(rows, weights.transpose(1, 2), offs=offsets)
    out.backward(torch.ones_like(out))  # contiguous: its backward refuses an expanded (stride 0) gradient
    assert out.shape == (5, 8) and weights.grad.shape == weights.shape
    with pytest.raises(RuntimeError, match="Double"):
        torch.nn.functional.grouped_mm(rows.detach().double(), weights.detach().double().transpose(1, 2), offs=offsets)


def _small_lever(candidate):
    (lever,) = grouped_gemm_lever.cpu_tier(NEMOTRON, LeverOptions())
    model = facts_for(lever_recipe(NEMOTRON), None)
    shape = replace(lever.cases[0].shape, expert_input=64, ffn=96, experts=32, top_k=4, tokens=96)
    case = Case(id="small", shape=shape, seed=3, source="synthetic", variant="routed-uneven",
                make_inputs=lambda device: experts.make_experts_inputs(shape, model, 3, device))
    return replace(lever, cases=(case,), candidate=candidate)


def test_cpu_tier_passes_torch_grouped_mm_and_fails_a_wrong_one():
    lever = _small_lever(experts.TorchGroupedMM())
    result = run_case(lever, lever.cases[0])
    assert result.status == "pass", result.failures
    assert all(control.fails_bound for control in result.controls)
    wrong = Mutated(base=experts.TorchGroupedMM(), mutation="weights swapped", mutate=experts.weights_swapped)
    assert run_case(_small_lever(wrong), lever.cases[0]).status == "fail"
