"""The gradient-accumulation-fusion lever: its FP64 reference against an exactly rounded sum, its
shapes from the recipes, what Megatron's two branches leave in main_grad (the unfused one BF16
values added by DDP's hook, the fused one the FP32 products), its CPU tier end to end, and its
refusals."""

import math
import sys
import time
from dataclasses import replace

import pytest
import torch

from correctness import tiers
from correctness.errors import ImplementationUnavailable
from correctness.grad_accumulation import inputs as accumulation_inputs
from correctness.grad_accumulation import lever as accumulation
from correctness.grad_accumulation.inputs import AccumulationShape, make_inputs, tensor_name
from correctness.grad_accumulation.megatron_wgrad import DROPPED, TRUNCATED, MegatronWgrad
from correctness.grad_accumulation.te_wgrad import TeWgrad
from correctness.grad_accumulation.wrong import WRONG_IMPLEMENTATIONS
from correctness.harness import run_candidates, run_case
from correctness.lever import LeverOptions, NotApplicable
from correctness.models import facts_for
from correctness.recipes import lever_recipe
from correctness.results import FORMAT_LIMITED
from references.weight_gradient import accumulated_weight_gradient

GEMMA = "gemma-4-31b/h100/attune-tp2-pp4-split13"
NEMOTRON = "nemotron-3-super-120b-a12b/h200/attune-tp4-pp2-ep8-mt16k"



def tiny_shape(**changes) -> AccumulationShape:
    shape = AccumulationShape(model="tiny", scale="test", tensor="decoder.layers.0.mlp.linear_fc1.weight",
                              layer_kind="dense", tp=1, tp_rank=0, rows=24, cols=16, seq_len=8, batch=2,
                              microbatches=5, recipe_microbatches=5, global_batch=10, dp=1, dtype="bf16",
                              recipe_fuses=True, dynamic_batching=True, shared=0.3)
    return replace(shape, **changes)


def with_flags(recipe, flags: str):
    run = recipe.data["run"].replace("train.py", f"train.py {flags}", 1)
    return replace(recipe, data={**recipe.data, "run": run})


def test_reference_is_the_exactly_rounded_sum():
    generator = torch.Generator().manual_seed(0)
    def draw(*size):
        return torch.randn(*size, generator=generator).bfloat16()

    pairs = [(draw(7, 2, 5), draw(7, 2, 3)) for _ in range(4)]
    sums = accumulated_weight_gradient(pairs, after=(1, 4))
    assert set(sums) == {1, 4} and sums[4].dtype == torch.float64 and sums[4].shape == (3, 5)
    for i in range(3):
        for j in range(5):
            terms = [float(dy.reshape(-1, 3)[t, i]) * float(x.reshape(-1, 5)[t, j])
                     for x, dy in pairs for t in range(14)]
            assert math.isclose(float(sums[4][i, j]), math.fsum(terms), rel_tol=1e-14, abs_tol=1e-14)
    first = pairs[0][1].reshape(-1, 3).double().t() @ pairs[0][0].reshape(-1, 5).double()
    assert torch.equal(sums[1], first)


def test_reference_refuses_what_it_cannot_sum():
    x, dy = torch.zeros(4, 5), torch.zeros(4, 3)
    with pytest.raises(ValueError, match=r"after \[3\] microbatches, given 2"):
        accumulated_weight_gradient([(x, dy), (x, dy)], after=(3,))
    with pytest.raises(ValueError, match="4 input tokens and 2 gradient tokens"):
        accumulated_weight_gradient([(x, torch.zeros(2, 3))], after=(1,))
    with pytest.raises(ValueError, match="must be positive"):
        accumulated_weight_gradient([(x, dy)], after=(0,))


@pytest.mark.parametrize("recipe_id", [GEMMA, NEMOTRON])
def test_shapes_come_from_the_recipe_and_the_model(recipe_id):
    recipe = lever_recipe(recipe_id)
    model = facts_for(recipe, None)
    smoke = accumulation.cpu_tier(recipe_id, LeverOptions())[0].cases[0].shape
    at_scale = accumulation.megatron_gpu_tier(recipe_id, LeverOptions())[0].cases[0].shape
    weight = accumulation_inputs.first_column_parallel(recipe, model, "recipe")
    assert (at_scale.rows, at_scale.cols) == weight.shape and at_scale.cols == int(model.field("hidden_size"))
    assert (smoke.rows, smoke.cols) == accumulation_inputs.first_column_parallel(recipe, model, "smoke").shape
    rows_per_step = recipe.rows_per_microbatch * recipe.positive_int("layout.dp")
    per_step = recipe.positive_int("workload.global_batch") // rows_per_step
    assert at_scale.microbatches == at_scale.recipe_microbatches == per_step
    assert smoke.microbatches == min(per_step, accumulation_inputs.SMOKE_MICROBATCHES)
    assert at_scale.tokens == recipe.row_tokens * recipe.rows_per_microbatch
    assert smoke.tokens == accumulation_inputs.SMOKE_TOKENS and smoke.batch == recipe.rows_per_microbatch
    dynamic = recipe.argument("--use-dynamic-batch-size") is not None
    assert smoke.counts == ((*(1 << p for p in range(smoke.microbatches.bit_length()) if 1 << p < smoke.microbatches),
                             smoke.microbatches) if dynamic else (smoke.microbatches,))
    shared = [case.shape.shared for case in accumulation.cpu_tier(recipe_id, LeverOptions())[0].cases]
    assert shared == [correlation for correlation, _ in accumulation_inputs.CORRELATIONS]
    assert smoke.recipe_fuses == (recipe.argument("--no-gradient-accumulation-fusion") is None)


def test_the_seed_recipes_differ_in_the_fusion():
    assert not accumulation.cpu_tier(GEMMA, LeverOptions())[0].cases[0].shape.recipe_fuses
    assert accumulation.cpu_tier(NEMOTRON, LeverOptions())[0].cases[0].shape.recipe_fuses


def test_a_recipe_with_a_bf16_buffer_or_fp32_training_is_not_applicable():
    recipe = lever_recipe(NEMOTRON)
    with pytest.raises(NotApplicable, match="--grad-reduce-in-bf16"):
        accumulation.cpu_tier(NEMOTRON, LeverOptions(recipe=with_flags(recipe, "--grad-reduce-in-bf16")))
    fp32 = replace(recipe, data={**recipe.data, "workload": {**recipe.data["workload"], "precision": "fp32"}})
    with pytest.raises(NotApplicable, match="trains in fp32"):
        accumulation.cpu_tier(NEMOTRON, LeverOptions(recipe=fp32))


def test_inputs_repeat_and_microbatches_are_correlated():
    shape = tiny_shape(rows=64, cols=48, seq_len=64, batch=1, microbatches=6)
    first, again = make_inputs(shape, 3, "cpu"), make_inputs(shape, 3, "cpu")
    for m in range(shape.microbatches):
        assert all(torch.equal(a, b) for a, b in zip(first.microbatch(m), again.microbatch(m)))
    grads = [(dy.reshape(-1, 64).double().t() @ x.reshape(-1, 48).double()) / factor
             for (x, dy), factor in ((first.microbatch(m), first.factors()[m]) for m in range(shape.microbatches))]
    correlations = [float(torch.corrcoef(torch.stack([grads[m].flatten(), grads[n].flatten()]))[0, 1])
                    for m in range(6) for n in range(m + 1, 6)]
    assert abs(sum(correlations) / len(correlations) - shape.shared) < 0.1
    uncorrelated = make_inputs(replace(shape, shared=0.0), 3, "cpu")
    grads = [(dy.reshape(-1, 64).double().t() @ x.reshape(-1, 48).double()).flatten()
             for x, dy in (uncorrelated.microbatch(m) for m in range(shape.microbatches))]
    assert abs(float(torch.corrcoef(torch.stack(grads[:2]))[0, 1])) < 0.1
    assert first.smallest_microbatch == min(range(6), key=first.factors().__getitem__)


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.megatron
def test_megatron_branches_leave_what_they_should_in_main_grad(one_thread):
    """Unfused: each microbatch's gradient a BF16 value (the GEMM's FP32 sum rounded once), added
    by DDP's hook; fused: the FP32 products accumulated, never rounded to BF16."""
    shape = tiny_shape()
    inputs = make_inputs(shape, 0, "cpu")
    unfused = MegatronWgrad(fused=False).run(inputs)
    fused = MegatronWgrad(fused=True).run(inputs)
    assert set(unfused.tensors) == {tensor_name(count) for count in (1, 2, 4, 5)}
    once, exact = unfused.tensors[tensor_name(1)], fused.tensors[tensor_name(1)]
    assert torch.equal(once, once.bfloat16().float())
    assert not torch.equal(exact, exact.bfloat16().float())
    assert torch.equal(once, exact.bfloat16().float())
    expected = torch.zeros(shape.rows, shape.cols)
    for m in range(shape.microbatches):
        x, dy = inputs.microbatch(m)
        expected += torch.mm(dy.reshape(-1, shape.rows).float().t(), x.reshape(-1, shape.cols).float())
    assert torch.equal(fused.tensors[tensor_name(shape.microbatches)], expected)
    assert "DDP's backward post-hook" in unfused.details["wgrad"]
    assert not unfused.details["gradient_accumulation_fusion"] and fused.details["gradient_accumulation_fusion"]
    dropped = MegatronWgrad(fused=False, mutation=DROPPED).run(inputs)
    assert dropped.details["dropped_microbatch"] == inputs.smallest_microbatch
    assert dropped.backend.endswith(f"(mutated: {DROPPED})")


def test_the_floor_is_the_reference_with_each_microbatch_gradient_rounded_once():
    inputs = make_inputs(tiny_shape(), 0, "cpu")
    floor = accumulation.wgrad_floor("bf16")
    assert floor.format == "BF16" and len(floor.roundings) == 1
    tensors = floor.implementation.run(inputs).tensors
    terms = [(dy.reshape(-1, 24).double().t() @ x.reshape(-1, 16).double()).bfloat16().double()
             for x, dy in (inputs.microbatch(m) for m in range(5))]
    assert tensors[tensor_name(1)].dtype == torch.float32
    assert torch.equal(tensors[tensor_name(1)], terms[0].float())  # torch's cast agrees here: no tie after FP32
    assert torch.allclose(tensors[tensor_name(5)].double(), sum(terms), rtol=1e-7, atol=0)


@pytest.mark.megatron
def test_cpu_tier_end_to_end():
    """Noise-dominated: the candidate fails the rule on every count, as its BF16 floor does, and is
    within 2 x the floor's error + 1e-3, unbiased against it; every control fails the rule and the
    format bound; the default's repeat passes; both paths are deterministic: format-limited."""
    lever = accumulation.cpu_tier(NEMOTRON, LeverOptions())[0]
    assert lever.tier == tiers.MEGATRON_CPU and lever.format_floor.format == "BF16"
    case = lever.cases[0]
    assert case.variant == "noise-dominated"
    started = time.perf_counter()
    result = run_case(lever, case)
    assert time.perf_counter() - started < 60
    assert result.status == FORMAT_LIMITED, result.failures
    assert result.failures == () and result.format.findings == () and result.format.systematic == ()
    assert result.systematic == ()  # the floor, a secondary reference, has BF16's own slope
    assert {t.tensor for t in result.candidate.tensors} == {tensor_name(count) for count in case.shape.counts}
    assert all(not t.passes and t.default_error < 1e-5 for t in result.candidate.tensors)
    assert set(result.format.floor_fails_rule) == {t.tensor for t in result.candidate.tensors}
    assert all(t.error_over_bound < 0.5 for t in result.format.candidate.tensors)
    assert result.candidate.run.backend == "megatron-wgrad-unfused-fp32-main-grad"
    assert result.default.backend == "megatron-wgrad-fused-fp32-main-grad"
    assert result.default_repeat.passes and result.deterministic
    assert len(result.controls) == 3 and all(control.fails_bound and control.power > 1 for control in result.controls)
    assert all(control.fails for control in result.format.controls)
    summary = result.summary
    assert set(summary["per_count"]) == {t.tensor for t in result.candidate.tensors}
    assert all(figures["error_over_format_bound"] < 0.5 for figures in summary["per_count"].values())
    assert all(figures["format_power"] > 1 for figures in summary["controls"].values())


@pytest.mark.megatron
def test_wrong_bf16_accumulations_fail_where_the_honest_one_is_format_limited():
    """Truncating each microbatch's gradient is biased beyond the floor's rounding; a dropped
    microbatch is worse than BF16 allows (the smallest case: Nemotron's 32 noise-dominated microbatches)."""
    lever = accumulation.cpu_tier(NEMOTRON, LeverOptions())[0]
    case = lever.cases[0]
    wrong = {w.name: w.build(lever.candidate) for w in WRONG_IMPLEMENTATIONS}
    assert set(wrong) == {TRUNCATED, DROPPED} and all(w.changes(case) and w.caught_on(case) for w in WRONG_IMPLEMENTATIONS)
    honest, truncated, dropped = run_candidates(lever, case, [lever.candidate, *wrong.values()], repeat=False)
    assert honest.status == FORMAT_LIMITED, honest.failures
    assert truncated.status == "fail" and dropped.status == "fail"
    assert set(truncated.format.systematic) == {tensor_name(count) for count in case.shape.counts}
    assert all("biased beyond the BF16 floor's rounding" in finding for finding in truncated.format.findings)
    assert all(t.error_over_bound < 1 for t in truncated.format.candidate.tensors)  # the bias, not the size, catches it
    assert any("worse than BF16 allows" in finding for finding in dropped.format.findings)
    assert dropped.candidate.run.details["dropped_microbatch"] == case.make_inputs("cpu").smallest_microbatch


def test_megatron_missing_is_a_refusal_and_te_needs_a_gpu(monkeypatch):
    inputs = make_inputs(tiny_shape(), 0, "cpu")
    monkeypatch.setitem(sys.modules, "megatron.core.tensor_parallel.layers", None)
    with pytest.raises(ImplementationUnavailable, match="megatron-core is not usable"):
        MegatronWgrad(fused=False).run(inputs)
    with pytest.raises(ImplementationUnavailable, match="CUDA GPU only"):
        TeWgrad(fused=True).run(inputs)


def test_gpu_tier_declares_its_default_and_markers():
    (lever,) = accumulation.megatron_gpu_tier(NEMOTRON, LeverOptions())
    assert lever.tier == tiers.MEGATRON_GPU and lever.cases[0].shape.scale == "recipe"
    assert lever.default.name in ("megatron-wgrad-fused-fp32-main-grad", "te-linear-wgrad-fused-fp32-main-grad")
    assert lever.candidate.name == "megatron-wgrad-unfused-fp32-main-grad"
