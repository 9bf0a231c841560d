"""The rope-fusion lever (correctness/rope/): the FP64 reference against a complex rotation and
autograd, Megatron's frequencies against the formula, the fused kernel's stand-in against the
reference, the CPU tier end to end on a packed (THD) recipe, where the lever does not apply, the
stand-in against TE 2.17's own unfused RoPE Python on the CPU (correctness.te_on_cpu), and (on a GPU
with TE) the stand-in against TE's kernel."""

import types
import warnings
from dataclasses import replace

import pytest
import torch

from correctness import te_on_cpu
from correctness.errors import ImplementationUnavailable
from correctness.harness import run_case
from correctness.lever import LeverOptions, NotApplicable
from correctness.models import load_model
from correctness.recipes import lever_recipe
from correctness.rope import lever as rope
from correctness.rope.paths import (
    FusedRopeArithmetic, MegatronRope, RopeInputs, TeUnfusedRope, make_inputs, megatron_freqs, outputs,
)
from correctness.rope.shapes import rope_shape
from references.rope import rope_angles, rope_backward, rope_forward

GEMMA = "gemma-4-31b/h100/attune-tp2-pp4-split13"
NEMOTRON = "nemotron-3-super-120b-a12b/h200/attune-tp4-pp2-ep8-mt16k"
PACKED = "qwen3-30b-a3b/h100/example-tp2-ep4-offload07"  # THD, two rows per microbatch
MLA = "moonlight-16b-a3b/h100/example-tp2-ep4-offload07"


def gemma_shape(kind: str, scale: str = "smoke"):
    recipe = lever_recipe(GEMMA)
    return rope_shape(recipe, load_model(recipe.model), kind, scale)


@pytest.mark.parametrize("interleaved", [False, True])
def test_reference_is_a_complex_rotation_and_its_backward_the_transpose(interleaved):
    generator = torch.Generator().manual_seed(0)
    positions, heads, dims, rotary = 7, 3, 12, 8
    x = torch.randn(positions, heads, dims, generator=generator, dtype=torch.float64, requires_grad=True)
    angles = rope_angles(torch.arange(positions) + 5, rotary, 10000.0)
    y = rope_forward(x, angles, interleaved)
    pairs = x[..., :rotary].detach()
    a, b = (pairs[..., 0::2], pairs[..., 1::2]) if interleaved else (pairs[..., :4], pairs[..., 4:])
    turned = torch.complex(a, b) * torch.polar(torch.ones_like(angles), angles).unsqueeze(1)
    want = torch.stack((turned.real, turned.imag), -1).flatten(-2) if interleaved else torch.cat((turned.real, turned.imag), -1)
    torch.testing.assert_close(y[..., :rotary], want, rtol=0, atol=1e-14)
    assert torch.equal(y[..., rotary:], x[..., rotary:].detach())
    grad = torch.randn(y.shape, generator=generator, dtype=torch.float64)
    y.backward(grad)
    torch.testing.assert_close(rope_backward(grad, angles, interleaved), x.grad, rtol=0, atol=1e-14)


def test_reference_rejects_a_shape_that_does_not_fit():
    with pytest.raises(ValueError, match="must be"):
        rope_forward(torch.zeros(4, 2, 6), torch.zeros(4, 4), False)
    with pytest.raises(ValueError, match="even"):
        rope_angles(torch.arange(3), 5, 10000.0)


@pytest.mark.parametrize("kind", ["sliding", "global"])
def test_megatron_frequencies_are_the_formulas_in_fp32(kind):
    shape = gemma_shape(kind)
    model = load_model("Gemma-4-31B").field(f"attention.kinds.{kind}")
    assert shape.rotary_dims == int(shape.head_dim * model["partial_rotary_factor"])
    assert shape.rotary_base == model["rope_theta"]
    freqs = megatron_freqs(shape, torch.device("cpu"))
    assert freqs.dtype == torch.float32 and freqs.shape == (shape.positions, 1, 1, shape.rotary_dims)
    half = shape.rotary_dims // 2
    assert torch.equal(freqs[..., :half], freqs[..., half:])  # the halves' layout
    angles = rope_angles(torch.arange(shape.positions) + shape.first_position, shape.rotary_dims, shape.rotary_base)
    error = (freqs[:, 0, 0, :half].double() - angles).abs() / angles.abs().clamp(min=1e-30)
    assert float(error.max()) < 4 * 2.0**-24  # FP32's inv_freq and product roundings


def _smoke_inputs(kind: str, **changes) -> RopeInputs:
    shape = gemma_shape(kind).with_changes(**changes)
    return make_inputs(shape, 0, torch.device("cpu"))


@pytest.mark.parametrize("interleaved", [False, True])
def test_fused_arithmetic_rounds_the_fp64_rotation_once(interleaved):
    inputs = _smoke_inputs("global", interleaved=interleaved)
    fp32 = RopeInputs(**{**inputs.__dict__, **{name: getattr(inputs, name).float() for name in ("q", "k", "grad_q", "grad_k")}})
    reference = rope.Fp64Rope().run(fp32).tensors
    in_fp32 = FusedRopeArithmetic().run(fp32).tensors
    for name, tensor in reference.items():
        torch.testing.assert_close(in_fp32[name].double(), tensor, rtol=0, atol=2e-6, msg=name)
    in_bf16 = FusedRopeArithmetic().run(inputs).tensors
    for name, tensor in rope.Fp64Rope().run(inputs).tensors.items():
        same = (in_bf16[name] == tensor.to(torch.bfloat16)).double().mean()
        assert same > 0.999, (name, float(same))  # one rounding: the FP64 value's, but for FP32 ties


def test_fused_path_on_the_cpu_is_unavailable_not_an_error():
    with pytest.raises(ImplementationUnavailable, match="CUDA"):
        MegatronRope(fused=True).run(_smoke_inputs("sliding"))


def test_cpu_tier_on_packed_rows_passes_and_every_control_fails():
    lever = rope.cpu_tier(PACKED, LeverOptions())[0]
    (case,) = lever.cases
    assert case.shape.qkv_format == "thd" and case.shape.cu_seqlens == (0, 512, 1024)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = run_case(lever, case)
    assert result.status == "pass", result.failures
    applied = {control.name: control for control in result.controls if control.inapplicable_reason is None}
    assert set(applied) == {"positions off by one", "other pairing", "angles in BF16", "positions run across packed rows"}
    assert all(control.fails and control.power > 10 for control in applied.values())
    assert result.candidate.worst.error_over_bound < 1


@pytest.mark.parametrize("recipe, reason", [(NEMOTRON, "no position embedding"), (MLA, "multi-latent attention")])
def test_lever_does_not_apply_without_standard_rope(recipe, reason):
    with pytest.raises(NotApplicable, match=reason):
        rope.cpu_tier(recipe, LeverOptions())


def test_gemma_cases_cover_both_kinds_with_the_global_fraction():
    lever = rope.cpu_tier(GEMMA, LeverOptions())[0]
    shapes = {case.shape.layer_kind: case.shape for case in lever.cases}
    assert shapes["global"].rotary_dims * 4 == shapes["global"].head_dim
    assert shapes["sliding"].rotary_dims == shapes["sliding"].head_dim
    assert all(shape.first_position + shape.positions == lever_recipe(GEMMA).row_tokens for shape in shapes.values())


def _te_available() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 - absent or unusable: the test skips
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(not _te_available(), reason="needs a CUDA GPU with Transformer Engine")
@pytest.mark.parametrize("kind", ["sliding", "global"])
def test_fused_arithmetic_stands_in_for_tes_kernel(kind):
    """The CPU tier's default against TE's FusedRoPEFunc on the same CUDA inputs, recipe scale."""
    shape = gemma_shape(kind, "recipe")
    inputs = make_inputs(shape, 0, torch.device("cuda"))
    kernel = MegatronRope(fused=True).run(inputs).tensors
    stand_in = FusedRopeArithmetic().run(inputs).tensors
    for name, tensor in kernel.items():
        same = (stand_in[name] == tensor).double().mean()
        assert same > 0.999, (name, float(same))


# --- the stand-in against TE 2.17's own unfused RoPE Python, on the CPU -------------------------------

# The plugin skips these with te_on_cpu.unusable_reason() where TE's CPU copy cannot run (not
# installed; a machine with a Transformer Engine of its own, where the GPU test runs instead).
needs_te_on_cpu = pytest.mark.te_cpu
ROTATED = ("q", "k", "dq", "dk")
# Gemma-4-31B's two layer kinds at the smoke scale as the lever makes them (BSHD, rotate-half; the
# global kind rotates a quarter of its head); the lever's THD layout (packed recipes) on the global
# kind's geometry in uneven rows; and --rotary-interleaved, which no seed recipe gives, on both.
TE_CASES = {
    "gemma-sliding": ("sliding", {}),
    "gemma-global-partial": ("global", {}),
    "gemma-global-partial-thd": ("global", {"qkv_format": "thd", "first_position": 0, "rows": 3,
                                            "boundaries": (0, 200, 512, 700)}),
    "gemma-sliding-interleaved": ("sliding", {"interleaved": True}),
    "gemma-global-partial-interleaved": ("global", {"interleaved": True}),
}


def _te_case_inputs(case: str) -> RopeInputs:
    kind, changes = TE_CASES[case]
    return _smoke_inputs(kind, **changes)


def _disagreement(got: dict, want: dict) -> dict[str, float]:
    """The fraction of elements that differ, per tensor that is not equal (empty: all equal)."""
    assert got.keys() == want.keys()
    fractions = {name: float((got[name] != want[name]).double().mean()) for name in want}
    return {name: fraction for name, fraction in fractions.items() if fraction > 0}


def _in_fp32(inputs: RopeInputs) -> RopeInputs:
    return replace(inputs, **{name: getattr(inputs, name).float() for name in ("q", "k", "grad_q", "grad_k")})


@needs_te_on_cpu
@pytest.mark.parametrize("case", list(TE_CASES))
def test_fused_arithmetic_is_tes_unfused_rope_in_fp32_bitwise(case):
    """TE's unfused `_apply_rotary_pos_emb_base` computes `t * cos + _rotate_half(t) * sin` in t's
    dtype with cos and sin cast to it: on FP32 inputs that is the stand-in's FP32 arithmetic, the
    same torch operations in the same order (the backward by autograd is the transposed rotation
    the stand-in writes out from fused_rope.cu). Held: equal in FP32, q, k, dq and dk and the
    passed dims, on the lever's inputs upcast; and TE's FP32 results rounded once to BF16 equal to
    the stand-in on the lever's BF16 inputs. Measured: bitwise on every case (0 elements differ)."""
    inputs = _te_case_inputs(case)
    fp32 = _in_fp32(inputs)
    assert _disagreement(FusedRopeArithmetic().run(fp32).tensors, TeUnfusedRope().run(fp32).tensors) == {}
    te = TeUnfusedRope(compute=torch.float32).run(inputs).tensors
    assert te["q"].dtype == torch.bfloat16
    assert _disagreement(FusedRopeArithmetic().run(inputs).tensors, te) == {}


def _pair_scale(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Per rotary element, the larger magnitude of it and the element it is paired with."""
    if interleaved:
        partner = torch.stack((x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    else:
        half = x.shape[-1] // 2
        partner = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.maximum(x.abs(), partner.abs()).float()


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.floor(torch.log2(x.clamp(min=2.0**-126))) - 7)


@needs_te_on_cpu
@pytest.mark.parametrize("case", list(TE_CASES))
def test_tes_unfused_rope_in_bf16_is_megatrons_and_within_two_ulps_of_the_fused_arithmetic(case):
    """At the recipe's precision TE's unfused arithmetic is not the kernel's: cos and sin are
    rounded to BF16 before the products (rope.py: "cos/sin first then dtype conversion"), and each
    product and the sum is rounded to BF16; the kernel rounds once from FP32. Held: TE's unfused
    RoPE in BF16 equal to Megatron's unfused function (`--no-rope-fusion`, the lever's candidate:
    the same torch code with mscale 1) on every tensor, forward and backward. Measured against
    the stand-in: 22-39% of the rotated elements differ (more where the whole head rotates), each
    by at most 2.0 BF16 ulps of the larger of the element and its pair partner (the products'
    scale; a first-order bound from TE's four roundings is about 5)."""
    inputs = _te_case_inputs(case)
    te = TeUnfusedRope().run(inputs).tensors
    assert _disagreement(MegatronRope(fused=False).run(inputs).tensors, te) == {}
    stand_in = FusedRopeArithmetic().run(inputs).tensors
    differ = _disagreement(stand_in, te)
    assert set(differ) == set(ROTATED) and min(differ.values()) > 0.2, differ
    scales = outputs(inputs.shape, inputs.q, inputs.k, inputs.grad_q, inputs.grad_k)
    for name in ROTATED:
        ulps = (stand_in[name].float() - te[name].float()).abs() / _bf16_ulp(_pair_scale(scales[name],
                                                                                          inputs.shape.interleaved))
        assert float(ulps.max()) <= 2.0, (name, float(ulps.max()))


@needs_te_on_cpu
@pytest.mark.parametrize("case", ["gemma-global-partial", "gemma-global-partial-thd", "gemma-sliding-interleaved"])
def test_the_comparison_with_tes_unfused_rope_rejects_each_wrong_variant(case):
    """The lever's own negative controls, each a wrong variant of the stand-in (rotate-half where
    TE interleaves, and the reverse; the whole head rotated where the model rotates a quarter;
    positions off by one; angles in BF16; packed rows run together), against TE's FP32 results:
    each differs on q, k, dq and dk. Measured: 27% of the elements (angles in BF16, THD) to 99.9%."""
    inputs = _te_case_inputs(case)
    te = TeUnfusedRope(compute=torch.float32).run(inputs).tensors
    applied = [control for control in rope.controls(FusedRopeArithmetic())
               if control.why_inapplicable(types.SimpleNamespace(shape=inputs.shape)) is None]
    assert len(applied) >= 3
    for control in applied:
        differ = _disagreement(control.implementation.run(inputs).tensors, te)
        assert set(ROTATED) <= set(differ) and min(differ[name] for name in ROTATED) > 0.2, (control.name, differ)


@needs_te_on_cpu
@pytest.mark.parametrize("kind", ["sliding", "global"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_tes_rotary_embedding_makes_megatrons_frequencies(kind, interleaved):
    """The frequencies every path takes (Megatron's RotaryEmbedding) equal TE's own
    RotaryPositionEmbedding's for the kind's fraction and base, at the smoke rows' offset, in both
    pairings' layouts (halves concatenated, or each angle repeated): bitwise."""
    shape = gemma_shape(kind).with_changes(interleaved=interleaved)
    with te_on_cpu.te_on_cpu() as te:
        embedding = te.attention.rope.RotaryPositionEmbedding(
            shape.head_dim, rotary_percent=shape.rotary_percent, rotary_base=shape.rotary_base, interleaved=interleaved)
        freqs = embedding(shape.max_row, offset=shape.first_position)
    assert torch.equal(freqs, megatron_freqs(shape, torch.device("cpu")))
