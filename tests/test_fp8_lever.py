"""The FP8 lever: the FP64 linear reference against autograd, the quantisation against TE 2.17's rules
(scales from amax, power-of-two and E8M0 rounding, saturation, partial blocks), the GEMM stand-in
against torch._scaled_mm on the CPU, what the recipe selects, the format floor (the reference on
the recipe's FP8 operands), and the CPU tier end to end on a recipe that trains in FP8: the honest
candidate (Hopper's GEMMs by mmaemu on a per-tensor recipe, the stand-in on MXFP8) is format-limited,
every control fails the format bound, and the wrong implementations in the same format
(correctness.fp8.wrong) fail. The Hopper GEMMs themselves: tests/test_fp8_hopper.py."""

import sys
import types
from dataclasses import replace

import pytest
import torch

from correctness import LeverOptions
from correctness.errors import ImplementationUnavailable, RecipeError
from correctness.fixtures import recipe_path
from correctness.fp8 import lever as fp8
from correctness.fp8.hopper import PROFILE_NOTE
from correctness.fp8.inputs import draw_tensors
from correctness.fp8.paths import (
    BLOCK_SCALE_TOWARD_SATURATION,
    MISTAKES,
    TRUNCATED_CAST,
    Fp64OnFp8Operands,
    quantize_operands,
    recipe_operands,
)
from correctness.fp8.scaling import E4M3, E5M2, Fp8Config, Quantized, e8m0_scale_inv, fp8_gemm, quantize, scale_from_amax
from correctness.fp8.te_linear import TeLinear, te_recipe
from correctness.fp8.wrong import WRONG_IMPLEMENTATIONS
from correctness.harness import run_candidates, run_case
from correctness.lever import NotApplicable
from correctness.recipes import load_recipe
from correctness.results import FAIL, FORMAT_LIMITED
from references.linear import linear_forward_backward

GEMMA = "gemma-4-31b/h100/attune-tp2-pp4-split13"
NEMOTRON = "nemotron-3-super-120b-a12b/h200/attune-tp4-pp2-ep8-mt16k"


def with_flags(recipe_id: str, flags: str):
    recipe = load_recipe(recipe_path(recipe_id))
    run = recipe.data["run"].replace("train.py", f"train.py {flags}", 1)
    return replace(recipe, data={**recipe.data, "run": run})


def test_reference_matches_autograd_in_fp64():
    generator = torch.Generator().manual_seed(0)
    x, weight, grad = (torch.randn(*size, generator=generator, dtype=torch.float64) for size in ((5, 7), (3, 7), (5, 3)))
    x.requires_grad_(), weight.requires_grad_()
    torch.nn.functional.linear(x, weight).backward(grad)
    y, dgrad, wgrad = linear_forward_backward(x.detach(), weight.detach(), grad)
    assert torch.equal(y, x.detach() @ weight.detach().t())
    torch.testing.assert_close(dgrad, x.grad, rtol=1e-14, atol=0)
    torch.testing.assert_close(wgrad, weight.grad, rtol=1e-14, atol=0)
    with pytest.raises(ValueError, match="grad_output"):
        linear_forward_backward(x.detach(), weight.detach(), grad.t())


def test_the_reference_reads_each_gemms_operands_through_its_hook():
    generator = torch.Generator().manual_seed(0)
    x, weight, grad = (torch.randn(*size, generator=generator, dtype=torch.float64) for size in ((5, 7), (3, 7), (5, 3)))
    read = []

    def halve_wgrad_x(gemm, name, t):
        read.append((gemm, name))
        return t / 2 if (gemm, name) == ("wgrad", "x") else t

    y, dgrad, wgrad = linear_forward_backward(x, weight, grad, halve_wgrad_x)
    assert torch.equal(y, x @ weight.t()) and torch.equal(dgrad, grad @ weight) and torch.equal(wgrad, grad.t() @ (x / 2))
    assert sorted(read) == sorted([("y", "x"), ("y", "weight"), ("dgrad", "grad_output"), ("dgrad", "weight"),
                                   ("wgrad", "grad_output"), ("wgrad", "x")])
    with pytest.raises(ValueError, match="the dgrad GEMM's weight"):
        linear_forward_backward(x, weight, grad, lambda gemm, name, t: t.t() if gemm == "dgrad" and name == "weight" else t)


def test_scales_follow_te_compute_scale_from_amax():
    amax = torch.tensor([3.0, 0.0, float("inf"), 1e-38])
    scale = scale_from_amax(amax, E4M3.max, power_of_two=False)
    assert scale[0] == torch.tensor(448.0) / 3.0 and scale[1] == 1 and scale[2] == 1
    assert scale[3] == torch.finfo(torch.float32).max  # the quotient overflows FP32
    pow2 = scale_from_amax(torch.tensor([3.0, 448.0, 0.1]), E4M3.max, power_of_two=True)
    assert pow2.tolist() == [128.0, 1.0, 4096.0]  # 149.3, 1 and 4480 with their mantissas cleared


def test_mxfp8_scales_round_up_to_a_power_of_two():
    scale_inv = e8m0_scale_inv(torch.tensor([448.0, 448.5, 1.0, 0.0]), E4M3.max)
    assert scale_inv.dtype == torch.float8_e8m0fnu
    assert scale_inv.float().tolist() == [1.0, 2.0, 2.0 ** -8, 2.0 ** -127]
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(1)) * 1000
    q = quantize(x, Fp8Config(recipe="mxfp8", format="e4m3"), "input", E4M3)
    assert q.scale_inv.shape == (4, 3) and q.saturated == 0
    assert q.values().abs().amax() <= E4M3.max and q.values().abs().amax() > E4M3.max / 2


def test_a_scale_from_elsewhere_saturates_instead_of_overflowing():
    x = torch.tensor([[1.0, -100.0, 2.0, 0.5]])
    q = quantize(x, Fp8Config(recipe="delayed", format="hybrid"), "grad", E5M2, amax_override=torch.tensor(1.0))
    assert q.values().tolist() == [[E5M2.max, -E5M2.max, E5M2.max, E5M2.max / 2]]  # torch's own cast gives Inf
    assert q.saturated == 2
    assert torch.isfinite(q.dequantize()).all()


def test_blocks_are_128_along_the_contraction_and_128x128_for_weights_with_partial_edges():
    config = Fp8Config(recipe="blockwise", format="e4m3")
    generator = torch.Generator().manual_seed(2)
    w = torch.randn(200, 300, generator=generator) * torch.exp(2 * torch.randn(200, 1, generator=generator))
    q = quantize(w, config, "weight", E4M3)
    assert q.block == (128, 128) and q.scale_inv.shape == (2, 3)
    assert torch.equal(quantize(w.t(), config, "weight", E4M3).dequantize(), q.dequantize().t())  # square blocks
    x = quantize(w, config, "input", E4M3)
    assert x.block == (1, 128) and x.scale_inv.shape == (200, 3)
    scale = torch.log2(x.scale_inv)
    assert torch.equal(scale, scale.round())  # powers of two
    assert not torch.equal(quantize(w.t(), config, "input", E4M3).dequantize(), x.dequantize().t())


def test_operands_use_the_format_of_each_pass():
    current, _ = draw_tensors(64, 128, 96, seed=0)
    inputs = fp8.make_inputs(replace(_shape(), tokens=64, in_features=128, out_features=96), 0, torch.device("cpu"))
    assert torch.equal(inputs.x, current.x)
    operands = quantize_operands(inputs)
    assert operands.x_fprop.data.dtype == operands.w_dgrad.data.dtype == torch.float8_e4m3fn
    assert operands.dy_dgrad.data.dtype == operands.dy_wgrad.data.dtype == torch.float8_e5m2  # hybrid


def test_truncation_rounds_toward_zero_within_one_step():
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(4))
    config = Fp8Config(recipe="tensorwise", format="hybrid")
    for fmt in (E4M3, E5M2):
        nearest, truncated = quantize(x, config, "grad", fmt), quantize(x, config, "grad", fmt, truncate=True)
        scaled = x * scale_from_amax(x.abs().amax(), fmt.max, power_of_two=False)
        assert (truncated.values().abs() <= scaled.abs()).all() and (truncated.values() * scaled >= 0).all()
        moved = truncated.values() != nearest.values()
        assert (nearest.values()[moved].abs() > scaled[moved].abs()).all()  # only where nearest rounded away from zero
        assert 0.3 < float(moved.float().mean()) < 0.7
        steps = nearest.data.view(torch.uint8).int() - truncated.data.view(torch.uint8).int()
        assert set(steps.unique().tolist()) == {0, 1}


def test_a_block_scale_rounded_toward_saturation_clamps_the_largest_elements():
    assert e8m0_scale_inv(torch.tensor([448.0, 500.0, 1.0]), E4M3.max, round_up=False).float().tolist() == [1.0, 1.0, 2.0 ** -9]
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(5)) * 1000
    for recipe in ("blockwise", "mxfp8"):
        config = Fp8Config(recipe=recipe, format="e4m3")
        honest, wrong = quantize(x, config, "input", E4M3), quantize(x, config, "input", E4M3, scale_toward_saturation=True)
        assert honest.saturated == 0 and wrong.saturated > 0, recipe
        assert torch.equal(wrong.scale_inv.float(), honest.scale_inv.float() / 2)
        assert (wrong.values().abs().amax(dim=1) == E4M3.max).all()


def test_the_stand_in_is_torch_scaled_mm_where_the_cpu_takes_the_layout():
    generator = torch.Generator().manual_seed(3)
    config = Fp8Config(recipe="tensorwise", format="e4m3")
    a, b = (quantize(torch.randn(*size, generator=generator), config, "input", E4M3) for size in ((16, 128), (32, 128)))
    ours = fp8_gemm(a, b, torch.float32)
    try:
        theirs = torch._scaled_mm(a.data, b.data.t(), scale_a=a.scale_inv, scale_b=b.scale_inv, out_dtype=torch.float32)
    except RuntimeError as error:  # oneDNN's FP8 matmul needs AVX-512 or AMX; the probe records the refusal
        pytest.skip(f"torch._scaled_mm does not run on this CPU: {str(error).splitlines()[0]}")
    # the same products and sums in another order: within FP32's accumulation bound K eps sum |a b|
    magnitude = (a.values().abs() @ b.values().abs().t()) * a.scale_inv * b.scale_inv
    assert ((ours - theirs).abs() <= a.data.shape[1] * torch.finfo(torch.float32).eps * magnitude).all()


def test_torch_scaled_mm_refuses_block_scales_on_the_cpu():
    block = Fp8Config(recipe="blockwise", format="e4m3")
    a, b = quantize(torch.randn(16, 256), block, "input", E4M3), quantize(torch.randn(128, 256), block, "weight", E4M3)
    with pytest.raises((RuntimeError, ValueError), match="Invalid scaling configuration"):
        torch._scaled_mm(a.data, b.data.t(), scale_a=a.scale_inv, scale_b=b.scale_inv.t(), out_dtype=torch.float32)


def test_scales_not_applied_or_applied_twice_are_the_controls_mistakes():
    q = Quantized(data=torch.tensor([[2.0]]).to(torch.float8_e4m3fn), scale_inv=torch.tensor(0.25), block=None)
    assert fp8_gemm(q, q, torch.float32).item() == 0.25
    assert fp8_gemm(q, q, torch.float32, times_scaled=0).item() == 4.0
    assert fp8_gemm(q, q, torch.float32, times_scaled=2).item() == 4.0 / 256
    blocked = quantize(torch.tensor([[3.0] * 32]), Fp8Config(recipe="mxfp8", format="e4m3"), "input", E4M3)
    assert torch.equal(blocked.dequantize(times_scaled=2), blocked.dequantize() * blocked.scale_inv.float())


def _shape(**fields):
    recipe = load_recipe(recipe_path(NEMOTRON))
    shape = fp8.fp8_shapes(recipe, fp8.facts_for(recipe), "smoke")[1]
    return replace(shape, **fields)


def test_shapes_and_configurations_come_from_the_recipe():
    gemma = fp8.fp8_shapes(load_recipe(recipe_path(GEMMA)), fp8.facts_for(load_recipe(recipe_path(GEMMA))), "recipe")
    assert {(s.linear, s.out_features, s.in_features, s.tokens) for s in gemma} == {
        ("attn-proj", 5376, 4096, 8192), ("mlp-fc1", 21504, 5376, 8192)}
    assert {s.wgrad_dtype for s in gemma} == {"bf16"}  # --no-gradient-accumulation-fusion
    assert {(s.fp8_recipe, s.fp8_format) for s in gemma} == {(r, f) for r in fp8.RECIPES for f in fp8.FORMATS}
    assert not any(s.recipe_trains_in_fp8 for s in gemma)
    nemotron = fp8.fp8_shapes(load_recipe(recipe_path(NEMOTRON)), fp8.facts_for(load_recipe(recipe_path(NEMOTRON))), "recipe")
    assert {(s.parameter.split(".", 3)[-1], s.out_features, s.in_features, s.tokens, s.wgrad_dtype) for s in nemotron} == {
        ("self_attention.linear_proj.weight", 4096, 1024, 16384, "fp32"),
        ("mlp.shared_experts.linear_fc1.weight", 1344, 4096, 16384, "fp32")}
    own = fp8.fp8_configs(with_flags(NEMOTRON, "--fp8-format e4m3 --fp8-recipe delayed --fp8-amax-history-len 4"
                                              " --fp8-amax-compute-algo max --fp8-margin 1"))
    assert own == ((Fp8Config(recipe="delayed", format="e4m3", margin=1, amax_history_len=4, amax_compute_algo="max"),), True)
    assert fp8.fp8_configs(with_flags(GEMMA, "--fp8-format hybrid"))[0][0].recipe == "delayed"  # Megatron's default


@pytest.mark.parametrize("flags, error, words", [
    ("--fp8-format e5m2", RecipeError, "--fp8-format 'e5m2'"),
    ("--fp8-format hybrid --fp8-amax-history-len many", RecipeError, "--fp8-amax-history-len 'many'"),
    ("--fp8-format hybrid --fp8-amax-history-len 0", RecipeError, "history length"),
    ("--fp8-format hybrid --fp8-recipe custom", NotApplicable, "custom"),
])
def test_bad_or_unmodelled_fp8_arguments_are_one_line(flags, error, words):
    with pytest.raises(error, match=words) as raised:
        fp8.fp8_configs(with_flags(GEMMA, flags))
    assert "\n" not in str(raised.value)


def test_te_path_skips_without_transformer_engine(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformer_engine", None)
    inputs = fp8.make_inputs(_shape(), 0, torch.device("cpu"))
    with pytest.raises(ImplementationUnavailable, match="Transformer Engine is not installed"):
        TeLinear("te-linear-fp8", fp8=True).run(inputs)


def test_te_recipes_are_built_as_megatron_builds_them(monkeypatch):
    made = {}

    def kind(name):
        return lambda **kwargs: made.setdefault(name, kwargs) and (name, kwargs)

    recipe = types.SimpleNamespace(Format=types.SimpleNamespace(E4M3="E4M3", HYBRID="HYBRID"), DelayedScaling=kind("delayed"),
                                   Float8CurrentScaling=kind("current"), Float8BlockScaling=kind("block"),
                                   MXFP8BlockScaling=kind("mxfp8"))
    common = types.SimpleNamespace(recipe=recipe)
    monkeypatch.setitem(sys.modules, "transformer_engine", types.SimpleNamespace(common=common))
    monkeypatch.setitem(sys.modules, "transformer_engine.common", common)
    for name in fp8.RECIPES:
        te_recipe(Fp8Config(recipe=name, format="hybrid", margin=2, amax_history_len=8, amax_compute_algo="max"))
    assert made == {
        "delayed": {"margin": 2, "fp8_format": "HYBRID", "amax_compute_algo": "max", "amax_history_len": 8},
        "current": {"fp8_format": "HYBRID"}, "block": {"fp8_format": "HYBRID"}, "mxfp8": {"fp8_format": "HYBRID"},
    }


def test_the_floor_is_the_reference_on_the_recipes_fp8_operands_rounded_to_the_candidates_dtypes():
    """Delayed scaling's floor takes its scales from the amax history, as the recipe does for these
    inputs; the floor is the secondary reference (FP64 on the same operands) rounded once."""
    inputs = fp8.make_inputs(replace(_shape(), fp8_recipe="delayed", tokens=64, in_features=128, out_features=96), 0,
                             torch.device("cpu"))
    operands = recipe_operands(inputs)
    assert operands.x_fprop.details["scale_amax"] == float(inputs.history_amax("input"))
    assert operands.x_fprop.details["scale_amax"] != operands.x_fprop.details["amax"]
    exact = Fp64OnFp8Operands().run(inputs).tensors
    floor = fp8.FLOOR.implementation.run(inputs).tensors
    assert {name: t.dtype for name, t in floor.items()} == {"y": torch.bfloat16, "dgrad": torch.bfloat16,
                                                            "wgrad": torch.float32}
    for name, t in floor.items():
        assert torch.equal(t, exact[name].to(t.dtype)), name
    assert torch.equal(exact["y"], operands.x_fprop.dequantize(dtype=torch.float64)
                       @ operands.w_fprop.dequantize(dtype=torch.float64).t())


def _fp8_lever(flags: str):
    (lever,) = fp8.cpu_tier(NEMOTRON, LeverOptions(recipe=with_flags(NEMOTRON, flags)))
    assert [case.shape.linear for case in lever.cases] == ["attn-proj", "mlp-fc1"]
    return lever


def test_cpu_tier_is_format_limited_and_every_control_fails_the_format_bound_on_a_recipe_that_trains_in_fp8():
    lever = _fp8_lever("--fp8-format hybrid --fp8-recipe tensorwise")
    case = lever.cases[1]
    assert case.shape.recipe_trains_in_fp8 and case.shape.config.id == "tensorwise-hybrid"
    assert lever.format_floor is fp8.FLOOR
    result = run_case(lever, case)
    assert result.status == FORMAT_LIMITED, result.failures
    assert result.failures == () and result.deterministic and result.default_repeat.passes
    assert {t.tensor for t in result.candidate.tensors if not t.passes} == {"y", "dgrad", "wgrad"}
    assert result.format.floor_fails_rule == ("y", "dgrad", "wgrad") and result.format.systematic == ()
    assert {line.split(":")[0] for line in result.format.outside_rule} == {
        f"candidate{run} {name}" for run in ("", " (repeat)") for name in ("y", "dgrad", "wgrad")}
    summary = result.summary
    assert summary["gemm"] == "mmaemu hopper-te" and summary["profile_note"] == PROFILE_NOTE
    assert PROFILE_NOTE in result.candidate.run.backend
    for name, figures in summary["tensors"].items():
        assert figures["error_against_fp8_operands"] < 2e-3, name
        assert figures["error_over_format_bound"] < 1 < figures["error_over_bound"], name
    assert {control.name for control in result.format.controls} == set(summary["controls"]) == set(MISTAKES)
    for name, control in summary["controls"].items():
        assert control["power"] > summary["worst_error_over_bound"], name
        assert control["format_power"] > 2, name
    probe = summary["scaled_mm_probe"]
    if "refused" in probe:  # oneDNN's FP8 matmul needs AVX-512 or AMX
        assert probe["refused"].startswith("torch._scaled_mm does not run on this CPU: ")
    else:
        assert probe["y"]["max_relative_difference"] < 1e-5


def test_wrong_implementations_in_the_same_format_fail_where_the_honest_one_is_format_limited():
    lever = _fp8_lever("--fp8-format e4m3 --fp8-recipe mxfp8")
    case = lever.cases[0]  # the smallest: 512 x 256 x 128
    assert all(entry.changes(case) and entry.caught_on(case) for entry in WRONG_IMPLEMENTATIONS)
    honest, truncated, saturating = run_candidates(
        lever, case, [lever.candidate, *(entry.build(lever.candidate) for entry in WRONG_IMPLEMENTATIONS)], repeat=False)
    assert honest.status == FORMAT_LIMITED, honest.failures
    assert [truncated.status, saturating.status] == [FAIL, FAIL]
    assert "GEMM stand-in, not Hopper's arithmetic" in honest.candidate.run.backend  # mmaemu: per-tensor scales only
    assert TRUNCATED_CAST in truncated.candidate.run.backend
    assert truncated.format.systematic == ("y", "dgrad", "wgrad")
    assert any(finding.startswith("candidate y: systematic error") and "biased beyond the FP8 floor's rounding" in finding
               for finding in truncated.format.findings)
    assert BLOCK_SCALE_TOWARD_SATURATION in saturating.candidate.run.backend
    assert {t.tensor for t in saturating.format.candidate.tensors if not t.passes} == {"y", "dgrad", "wgrad"}
    assert any(finding.startswith("candidate against the FP8 floor y") and "(worse than FP8 allows)" in finding
               for finding in saturating.format.findings)


def test_the_block_scale_mistake_leaves_per_tensor_recipes_unchanged():
    lever = _fp8_lever("--fp8-format e4m3 --fp8-recipe tensorwise")
    entry = next(entry for entry in WRONG_IMPLEMENTATIONS if entry.name == BLOCK_SCALE_TOWARD_SATURATION)
    assert not entry.changes(lever.cases[0])
    inputs = fp8.make_inputs(lever.cases[0].shape, 0, torch.device("cpu"))
    wrong, honest = quantize_operands(inputs, BLOCK_SCALE_TOWARD_SATURATION), quantize_operands(inputs)
    for name, (a, b) in wrong.gemms().items():
        assert all(torch.equal(w.dequantize(), h.dequantize()) for w, h in zip((a, b), honest.gemms()[name])), name


def test_the_hopper_gpu_tier_leaves_out_mxfp8_unless_the_recipe_asks_for_it():
    recipe = load_recipe(recipe_path(GEMMA))
    model = fp8.facts_for(recipe)
    assert "mxfp8" not in {s.fp8_recipe for s in fp8.fp8_shapes(recipe, model, "recipe", gpu="H100")}
    asks = with_flags(GEMMA, "--fp8-format e4m3 --fp8-recipe mxfp8")
    assert {s.fp8_recipe for s in fp8.fp8_shapes(asks, model, "recipe", gpu="H100")} == {"mxfp8"}
    (lever,) = fp8.recipe_gpu_tier(GEMMA, LeverOptions())
    assert lever.tier.markers == ("h100", "te") and len(lever.cases) == 2 * 3 * 2
