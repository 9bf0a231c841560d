"""The FP8 lever's recipe-GPU tier on the emulated GPU: TE 2.17's quantizers and FP8 GEMMs through the stand-ins of
correctness/emulated_gpu/stand_ins/te_fp8.py (and te_gemm.py's FP8 operands), held against the lever's own CPU
emulation of the same recipes (correctness.fp8.scaling, paths): TE's casts are the lever's casts bit for bit, TE's
Linear in FP8 is the lever's emulated linear (per-tensor recipes bit for bit, block-scaled ones within FP32
accumulation of the FP64 product on the same operands), with mmaemu's Hopper arithmetic TE's GEMMs are the CPU
tier's Hopper candidate bit for bit, and what a GPU refuses, or the emulation does not model, is refused."""

from dataclasses import replace

import pytest
import torch

from correctness import LeverOptions
from correctness.emulated_gpu.gpus import parse_emulated
from correctness.emulated_gpu.kernels import NotOnGpu, snapshot, stand_ins_called
from correctness.emulated_gpu.runtime import NotEmulated
from correctness.emulated_gpu.session import emulated_gpu
from correctness.errors import ImplementationUnavailable
from correctness.fp8 import lever as fp8
from correctness.fp8.paths import EmulatedFp8Linear, recipe_operands
from correctness.fp8.scaling import E4M3, E5M2, Fp8Config, quantize
from correctness.fp8.te_linear import TeLinear

pytestmark = [pytest.mark.te_cpu]

NEMOTRON = "nemotron-3-super-120b-a12b/h200/attune-tp4-pp2-ep8-mt16k"
EMULATED = parse_emulated("H100x1")
TE_FP8 = {E4M3.name: 7, E5M2.name: 8}  # TE's DType kFloat8E4M3, kFloat8E5M2
TE_FLOAT32 = 4  # TE's DType kFloat32


@pytest.fixture
def gpu():
    """The emulated H100, with TE's global FP8 state fresh before and after: it keeps the amax buffers of every
    delayed-scaling module a process made, GPU tensors that a later emulation no longer knows as such."""
    with emulated_gpu(EMULATED) as emulation:
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager

        FP8GlobalStateManager.reset()
        try:
            yield emulation
        finally:
            FP8GlobalStateManager.reset()


def _activations(rows=200, columns=320, seed=0):
    """Outlier channels (lognormal per-column RMS); partial 128-blocks in both dimensions."""
    generator = torch.Generator().manual_seed(seed)
    rms = torch.exp(torch.randn(columns, generator=generator))
    return (torch.randn(rows, columns, generator=generator) * rms).to(torch.bfloat16)


def _fp8(data, fmt):
    return data.view(fmt.dtype).cpu()


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_per_tensor_casts_are_the_levers(gpu, fmt):
    """Delayed scaling (a scale from an amax below the tensor's own, so that elements saturate) and current
    scaling: TE's data, its transpose and scale-inverse are correctness.fp8.scaling.quantize's, bit for bit; the
    delayed quantizer's amax slot receives the tensor's amax; tex.dequantize is exact. (TE's Python dequantizes on
    the CPU itself where its data reports `is_cpu`, which an emulated GPU tensor still does.)"""
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer, Float8Quantizer

    x = _activations()
    history_amax = 0.8 * x.float().abs().amax()
    delayed = Fp8Config(recipe="delayed", format="hybrid")
    expected_delayed = quantize(x, delayed, "input", fmt, amax_override=history_amax)
    expected_current = quantize(x, Fp8Config(recipe="tensorwise", format="hybrid"), "input", fmt)
    assert expected_delayed.saturated > 0
    scale = torch.reciprocal(expected_delayed.scale_inv).reshape(1).cuda()
    amax = torch.zeros(1, device="cuda")
    quantizers = {"delayed": Float8Quantizer(scale=scale, amax=amax, fp8_dtype=TE_FP8[fmt.name]),
                  "current": Float8CurrentScalingQuantizer(fp8_dtype=TE_FP8[fmt.name], device=torch.device("cuda"))}
    for name, expected in (("delayed", expected_delayed), ("current", expected_current)):
        te = quantizers[name](x.cuda())
        assert torch.equal(_fp8(te._data, fmt), expected.data), name
        assert torch.equal(_fp8(te._transpose, fmt), expected.data.t()), name
        assert torch.equal(te._scale_inv.cpu().reshape(()), expected.scale_inv.reshape(())), name
        assert torch.equal(tex.dequantize(te, TE_FLOAT32).cpu(), expected.dequantize()), name
    assert torch.equal(amax.cpu(), x.float().abs().amax().reshape(1))


def test_a_cast_into_an_existing_tensor_follows_the_quantizers_usages(gpu):
    """update_quantized (tex.quantize with an output): the buffers the quantizer's usages need are made, the
    others dropped, and the values are a fresh cast's; per tensor and in blocks."""
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer
    from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer

    x, y = _activations(seed=1).cuda(), _activations(seed=2).cuda()
    current = Float8CurrentScalingQuantizer(fp8_dtype=TE_FP8["e4m3"], device=torch.device("cuda"), columnwise=False)
    target = current(x)
    current.set_usage(rowwise=True, columnwise=True)
    current.update_quantized(y, target)
    fresh = current(y)
    for buffer in ("_data", "_transpose"):
        assert torch.equal(getattr(target, buffer).cpu(), getattr(fresh, buffer).cpu()), buffer
    block = Float8BlockQuantizer(fp8_dtype=TE_FP8["e4m3"], rowwise=True, columnwise=True, block_scaling_dim=1)
    target = block(x)
    block.set_usage(rowwise=True, columnwise=False)
    block.update_quantized(y, target)
    assert target._columnwise_data is None and target._columnwise_scale_inv is None
    assert torch.equal(target.dequantize(dtype=torch.float32).cpu(), block(y).dequantize(dtype=torch.float32).cpu())


def test_current_scaling_reduces_its_amax_over_its_group(gpu):
    """with_amax_reduction: the amax MAX-reduced over the quantizer's group (gloo for NCCL here) before the scale;
    with one rank the cast is the unreduced one."""
    from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer

    store = torch.distributed.HashStore()
    torch.distributed.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        x = _activations().cuda()
        reduced = Float8CurrentScalingQuantizer(fp8_dtype=TE_FP8["e4m3"], device=torch.device("cuda"),
                                                with_amax_reduction=True,
                                                amax_reduction_group=torch.distributed.group.WORLD)(x)
        alone = Float8CurrentScalingQuantizer(fp8_dtype=TE_FP8["e4m3"], device=torch.device("cuda"))(x)
        assert torch.equal(reduced._data.cpu(), alone._data.cpu())
        assert torch.equal(reduced._scale_inv.cpu(), alone._scale_inv.cpu())
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("block_scaling_dim", [1, 2])
def test_block_casts_are_the_levers(gpu, block_scaling_dim):
    """Float8BlockQuantizer: the row-wise data quantised in blocks along the last dimension and the column-wise
    data (stored transposed) along the first, each with its blocks' scale-inverses in TE's GEMM-ready layout, are
    the lever's blockwise quantisation of the tensor and of its transpose bit for bit (1x128: the input's blocks,
    128x128: the weight's); TE's own Python dequantization of either copy gives the same values."""
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer

    x = _activations()
    config, role = Fp8Config(recipe="blockwise", format="e4m3"), "input" if block_scaling_dim == 1 else "weight"
    rowwise, columnwise = quantize(x, config, role, E4M3), quantize(x.t(), config, role, E4M3)
    quantizer = Float8BlockQuantizer(fp8_dtype=TE_FP8["e4m3"], rowwise=True, columnwise=True,
                                     block_scaling_dim=block_scaling_dim)
    te = quantizer(x.cuda())
    assert torch.equal(_fp8(te._rowwise_data, E4M3), rowwise.data)
    assert torch.equal(_fp8(te._columnwise_data, E4M3), columnwise.data)
    if block_scaling_dim == 1:  # [blocks along K, rows padded to 4]
        grids = te._rowwise_scale_inv[:, : x.shape[0]].t(), te._columnwise_scale_inv[:, : x.shape[1]].t()
    else:  # [row blocks, column blocks padded to 4]
        grids = (te._rowwise_scale_inv[:, : rowwise.scale_inv.shape[1]],
                 te._columnwise_scale_inv[:, : columnwise.scale_inv.shape[1]])
    assert torch.equal(grids[0].cpu(), rowwise.scale_inv) and torch.equal(grids[1].cpu(), columnwise.scale_inv)
    assert torch.equal(te.dequantize(dtype=torch.float32).cpu(), rowwise.dequantize())
    te.update_usage(rowwise_usage=False, columnwise_usage=True)
    assert torch.equal(te.dequantize(dtype=torch.float32).cpu(), columnwise.dequantize().t())


def _cases(*configs, linear="attn-proj"):
    (lever,) = fp8.recipe_gpu_tier(NEMOTRON, LeverOptions(emulated=EMULATED))
    return [case for case in lever.cases if case.shape.linear == linear and case.shape.config.id in configs]


@pytest.mark.parametrize("case", _cases("delayed-e4m3-h1", "delayed-hybrid-h1", "tensorwise-e4m3", "tensorwise-hybrid"),
                         ids=lambda case: case.shape.config.id)
def test_tes_linear_with_per_tensor_scales_is_the_levers_emulated_linear(gpu, case):
    """TE's Linear under te.autocast (delayed scaling after its earlier iteration, current scaling), forward
    and backward with its wgrad accumulated into an FP32 main_grad, is the lever's emulated FP8 linear with the
    FP32 GEMM stand-in, bit for bit: the same scales from the same amaxes, the same operands and GEMMs."""
    before = snapshot()
    te = TeLinear("te-linear-fp8", fp8=True).run(case.make_inputs(torch.device("cuda")))
    called = stand_ins_called(before)
    ours = EmulatedFp8Linear().run(case.make_inputs(torch.device("cpu"))).tensors
    for name, tensor in te.tensors.items():
        assert tensor.is_cuda and torch.equal(tensor.cpu(), ours[name]), name
    iterations = 2 if case.shape.config.recipe == "delayed" else 1
    assert called["transformer_engine_torch.generic_gemm"]["calls"] == 3 * iterations
    assert called["transformer_engine_torch.quantize"]["calls"] == 3 * iterations  # x, W, dy
    updates = called.get("transformer_engine_torch.fused_amax_and_scale_update_after_reduction", {"calls": 0})
    assert updates["calls"] == (2 * iterations if iterations == 2 else 0)  # forward and backward, delayed only


def _within_fp32_accumulation(result, exact, magnitude, contraction):
    """|result - exact| within K FP32 additions' worth of the products' magnitudes plus one rounding to the
    result's dtype, elementwise (exact and magnitude in FP64)."""
    bound = (contraction + 2) * 2.0 ** -24 * magnitude + torch.finfo(result.dtype).eps * result.double().abs()
    return bool(((result.double() - exact).abs() <= bound).all())


@pytest.mark.parametrize("case", _cases("blockwise-e4m3", "blockwise-hybrid"), ids=lambda case: case.shape.config.id)
def test_tes_linear_with_block_scales_is_the_fp64_product_of_the_levers_operands(gpu, case):
    """Float8BlockScaling (1x128 input and gradient, 128x128 weight, each GEMM's operands quantised along its own
    contraction): every output of TE's Linear is the FP64 product of the lever's quantised operands within FP32
    accumulation and one rounding; an FP8 step (2^-4 relative) would be far outside that."""
    te = TeLinear("te-linear-fp8", fp8=True).run(case.make_inputs(torch.device("cuda"))).tensors
    operands = recipe_operands(case.make_inputs(torch.device("cpu")))
    for name, (a, b) in operands.gemms().items():
        a64, b64 = a.dequantize(dtype=torch.float64), b.dequantize(dtype=torch.float64)
        exact, magnitude = a64 @ b64.t(), a64.abs() @ b64.abs().t()
        assert _within_fp32_accumulation(te[name].cpu(), exact, magnitude, a64.shape[1]), name


def test_tes_gemms_with_hoppers_arithmetic_are_the_cpu_tiers_hopper_candidate(gpu):
    """One case with mmaemu's hopper-te arithmetic in the GEMM stand-in (correctness.fp8.hopper; off in the tier:
    0.15-2.8 s a GEMM): TE's Linear asks for fast accumulation in fprop and the split accumulator in dgrad and wgrad,
    and its outputs are the CPU tier's Hopper candidate bit for bit (split-K decided at the recipe's shapes)."""
    mmaemu = pytest.importorskip("mmaemu")
    from correctness.emulated_gpu.stand_ins.te_fp8 import hopper_arithmetic
    from correctness.fp8.hopper import HopperTeGemms, recipe_gemm_shapes, split_decision

    (case,) = _cases("tensorwise-e4m3", linear="mlp-fc1")  # fprop's K is 256: fast and split accumulation differ
    cpu_inputs = case.make_inputs(torch.device("cpu"))
    dtypes = {"y": torch.bfloat16, "dgrad": torch.bfloat16, "wgrad": cpu_inputs.wgrad_dtype}
    plan = {}
    for name, (a, b) in recipe_operands(cpu_inputs).gemms().items():
        smoke = (a.data.shape[0], b.data.shape[0], a.data.shape[1])
        plan[smoke], _ = split_decision(mmaemu, smoke, recipe_gemm_shapes(case.shape)[name], a.data.dtype,
                                        b.data.dtype, dtypes[name], fast=name == "y")
    with hopper_arithmetic(plan):
        te = TeLinear("te-linear-fp8", fp8=True).run(case.make_inputs(torch.device("cuda"))).tensors
    hopper = EmulatedFp8Linear(gemms=HopperTeGemms()).run(cpu_inputs)
    assert "mmaemu hopper-te" in hopper.backend
    for name in dtypes:
        assert torch.equal(te[name].cpu(), hopper.tensors[name]), name
    operands = recipe_operands(cpu_inputs).gemms()
    split_fprop, _ = HopperTeGemms(split_accumulator=("y",)).run(cpu_inputs, {"y": operands["y"]}, dtypes)
    assert not torch.equal(te["y"].cpu(), split_fprop["y"])  # fprop ran with fast accumulation, as TE asks
    fp32_stand_in = EmulatedFp8Linear().run(cpu_inputs).tensors
    assert not torch.equal(te["wgrad"].cpu(), fp32_stand_in["wgrad"])  # FP32 wgrad: Hopper's accumulation shows


def test_delayed_scaling_update_rolls_the_history_and_rescales(gpu):
    """fused_amax_and_scale_update_after_reduction: per column, the reduced amax (the history's current row where
    the buffer holds 0) goes last, the history rolls one step and its current row is zeroed; the scale is
    (448 x 2^-margin) / amax from the most recent or the largest; a column with no amax keeps its history and scale."""
    import transformer_engine_torch as tex

    history = torch.tensor([[4.0, 0.0, 1.0], [2.0, 3.0, 5.0], [1.0, 6.0, 2.0]], device="cuda")  # [length 3, 3 tensors]
    buffer = torch.tensor([8.0, 0.0, 0.0], device="cuda")  # the third: its current row's 1.0
    for algo, amaxes in (("most_recent", [8.0, 0.0, 1.0]), ("max", [8.0, 0.0, 5.0])):
        h, scale = history.clone(), torch.full((3,), 7.0, device="cuda")
        tex.fused_amax_and_scale_update_after_reduction(buffer, [h], [scale], algo, TE_FP8["e4m3"], 1)
        assert h.cpu().tolist() == [[0.0, 0.0, 0.0], [1.0, 3.0, 2.0], [8.0, 6.0, 1.0]]
        expected = torch.tensor(224.0) / torch.tensor(amaxes)  # in FP32
        assert torch.equal(scale.cpu(), torch.where(torch.tensor(amaxes) > 0, expected, torch.tensor(7.0))), algo


def test_empty_tensors_transposes_and_amaxes_through_tes_python(gpu):
    """make_empty (tex.create_empty_quantized_tensor) gives TE's class with the usages' buffers on the GPU; a
    per-tensor transpose made later (update_usage: tex.fp8_transpose) is the data's; tex.compute_amax writes the
    largest magnitude."""
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer, Float8Tensor

    quantizer = Float8CurrentScalingQuantizer(fp8_dtype=TE_FP8["e4m3"], device=torch.device("cuda"), columnwise=False)
    empty = quantizer.make_empty((6, 32), dtype=torch.bfloat16, device="cuda")
    assert isinstance(empty, Float8Tensor) and empty._data.is_cuda and empty._transpose is None
    x = _activations(rows=48, columns=32)
    te = quantizer(x.cuda())
    te.update_usage(columnwise_usage=True)
    assert torch.equal(te._transpose.cpu(), te._data.cpu().t())
    amax = torch.zeros(1, device="cuda")
    tex.compute_amax(x.cuda(), amax)
    assert amax.item() == x.float().abs().amax().item()


def test_what_a_gpu_refuses_and_what_is_not_emulated(gpu):
    """A CPU tensor handed to the cast kernel; a GEMM reading a transpose TE never made (Hopper's FP8 GEMM is TN
    only); an MXFP8 quantizer (compute capability 10.0); and the lever's MXFP8 case, which TE refuses on Hopper
    with its own reason (the case skips, as on a real H100)."""
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.cpp_extensions.gemm import general_gemm
    from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer
    from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer

    quantizer = Float8CurrentScalingQuantizer(fp8_dtype=TE_FP8["e4m3"], device=torch.device("cuda"), columnwise=False)
    with pytest.raises(NotOnGpu, match="quantize: tensor is on cpu"):
        tex.quantize(_activations(rows=32, columns=32), quantizer)
    weight, x = quantizer(_activations(rows=32, columns=48).cuda()), quantizer(_activations(rows=16, columns=32).cuda())
    with pytest.raises(RuntimeError, match="Input A is missing column-wise usage"):
        general_gemm(weight, x, out_dtype=torch.bfloat16, layout="NN")
    with pytest.raises(NotEmulated, match="compute capability 10.0"):
        MXFP8Quantizer(fp8_dtype=TE_FP8["e4m3"])(_activations(rows=32, columns=32).cuda())
    (case,) = _cases("tensorwise-e4m3")
    shape = replace(case.shape, fp8_recipe="mxfp8")
    with pytest.raises(ImplementationUnavailable, match="refuses mxfp8-e4m3 on this GPU.*compute capability 10.0"):
        TeLinear("te-linear-fp8", fp8=True).run(fp8.make_inputs(shape, 0, torch.device("cuda")))
