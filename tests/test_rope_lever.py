"""The rope-fusion lever (correctness/rope/): the FP64 reference against a complex rotation and
autograd, Megatron's frequencies against the formula, the fused kernel's stand-in against the
reference, the CPU tier end to end on a packed (THD) recipe, where the lever does not apply, and
(on a GPU with TE) the stand-in against TE's kernel."""

import warnings

import pytest
import torch

from correctness.errors import PathUnavailable
from correctness.harness import run_case
from correctness.lever import LeverOptions, NotApplicable
from correctness.models import load_model
from correctness.recipes import lever_recipe
from correctness.rope import lever as rope
from correctness.rope.paths import FusedRopeArithmetic, MegatronRope, RopeInputs, make_inputs, megatron_freqs
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
    with pytest.raises(PathUnavailable, match="CUDA"):
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
