"""TE 2.17's FP8 entry points of `transformer_engine_torch` on the emulated GPU: the casts its
quantizers launch, the delayed-scaling update, and the FP8 operands of its GEMM
(correctness.emulated_gpu.stand_ins.te_gemm calls `quantized_product` for them).

TE's Python (tensor/float8_tensor.py, float8_blockwise_tensor.py, quantization.py, module/linear.py)
runs around them unchanged: it builds the quantizers, sets their usages, saves and restores the
tensors, picks each GEMM's layout and accumulation. What the compiled code does, and so what these
stand-ins do, after TE v2.17's pytorch/csrc/quantizer.cpp, csrc/extensions/cast.cpp, recipe.cpp and
common/recipe/*.cu, common/gemm/cublaslt_gemm.cu (CanonicalizeGemmInput):

- `quantize(tensor, quantizer, output=None, noop_flag=None)` allocates TE's tensor as the quantizer's
  C++ create_tensor does (Float8Tensor or, for an `internal` quantizer, Float8TensorStorage; the
  blockwise classes likewise) or coerces `output`'s buffers to the quantizer's usages, then fills them:
  - per tensor (Float8Quantizer: delayed scaling) with the quantizer's `scale`; the tensor's amax goes
    into the quantizer's `amax` (the amax history's current row) as the cast kernel's atomic max does;
  - per tensor (Float8CurrentScalingQuantizer) with a scale from the tensor's own amax (MAX-reduced
    over the quantizer's group where it asks), TE's compute_scale_from_amax with its epsilon and
    power-of-two option;
  - in blocks (Float8BlockQuantizer): 1x128 (block_scaling_dim 1) or 128x128 (2) along the last
    dimension for the row-wise data, along the first for the column-wise data (stored transposed, as
    the Hopper GEMM reads it), each block's scale from its amax as above; the scale-inverses in TE's
    GEMM-ready layout (1D: [blocks along K, rows padded to 4]; 2D: [row blocks, column blocks padded to
    4]), the padding left as allocated.
  Every cast is correctness.fp8.scaling's: the FP32 product value x scale rounded once to nearest even
  with saturation (references.rounding), scale-inverse the FP32 reciprocal of the scale. On Hopper
  (no non-TN FP8 GEMM) column-wise per-tensor data is the transpose of the row-wise data.
- `create_empty_quantized_tensor` (quantizer.make_empty), `dequantize` (per tensor: values times the
  scale-inverse), `fp8_transpose` (a per-tensor copy made later), `compute_amax`, and delayed scaling's
  `fused_amax_and_scale_update_after_reduction` (common/recipe/delayed_scaling.cu kernel_bulk: history
  rolled, current row zeroed, scale (fp8 max x 2^-margin) / amax).
- FP8 GEMM operands (`quantized_product`, for te_gemm.generic_gemm): each operand [rows, K] as the Hopper
  GEMM reads it (row-wise data where its use is transposed in TE's column-major terms, else the column-wise
  copy; a missing copy raises as TE's check does); per tensor, correctness.fp8.scaling.fp8_gemm (the CPU
  tier's FP32 stand-in: FP32 product of the FP8 values, both scale-inverses applied to the accumulator);
  blocks, `split_accumulated` (per 128-element block of K an FP32 product scaled by both blocks'
  scale-inverses, added into an FP32 accumulator). TE's fast-accumulation flag changes neither. mmaemu's
  Hopper arithmetic (correctness.fp8.hopper) runs per-tensor GEMMs only inside `hopper_arithmetic`, with
  split-K decisions its caller gives (tests/test_emulated_te_fp8.py, one case): 0.15-2.8 s a GEMM at the
  smoke shapes, where mmaemu decides cuBLAS's split-K for one of the seeds' 12 GEMMs only.
- MXFP8 and NVFP4 quantizers are refused (NotEmulated): TE refuses their recipes on compute
  capability 9.0 before any cast (quantization.py check_mxfp8_support, check_nvfp4_support).
"""

import contextlib
import math
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from correctness.emulated_gpu.kernels import require_on_gpu, stand_in
from correctness.emulated_gpu.placement import AMBIENT, CPU
from correctness.emulated_gpu.runtime import NotEmulated
from correctness.emulated_gpu.stand_ins.te_gemm import quantized, torch_dtype
from correctness.fp8.scaling import E4M3, E5M2, Fp8Dtype, Quantized, fp8_gemm, scale_from_amax
from references.rounding import round_to_nearest

FP8_FORMATS = {7: E4M3, 8: E5M2}  # TE's DType kFloat8E4M3, kFloat8E5M2 -> correctness.fp8.scaling's formats
BLOCK_LEN = 128  # Float8BlockQuantizer's block edge
SCALE_PADDING = 4  # its GEMM-ready scale-inverses pad one dimension to a multiple of 4


def _format(te_dtype: Any) -> Fp8Dtype:
    value = int(te_dtype)
    if value not in FP8_FORMATS:
        raise NotEmulated(f"TE quantization to DType {value} (not FP8 E4M3 or E5M2) is not emulated")
    return FP8_FORMATS[value]


def _quantizer_kind(quantizer: Any) -> str:
    """"delayed", "current" or "block"; NotEmulated for the quantizers Hopper never runs."""
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer
    from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer, Float8Quantizer

    if isinstance(quantizer, Float8Quantizer):
        return "delayed"
    if isinstance(quantizer, Float8CurrentScalingQuantizer):
        return "current"
    if isinstance(quantizer, Float8BlockQuantizer):
        return "block"
    raise NotEmulated(f"TE's {type(quantizer).__name__} is not emulated: its recipe (MXFP8, NVFP4) needs compute"
                      " capability 10.0, which TE refuses on the emulated H100/H200 before any cast")


def _current_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _contiguous_strides(shape: list[int]) -> list[int]:
    return [math.prod(shape[dim + 1:]) for dim in range(len(shape))]


def _padded(count: int) -> int:
    return SCALE_PADDING * math.ceil(count / SCALE_PADDING)


def _columnwise_shape(shape: list[int]) -> list[int]:
    """The transposed layout of column-wise data: the last dimension first (quantizer.cpp make_transpose_shape)."""
    return [shape[-1], *shape[:-1]] if shape else []


def _matrix_shape(shape: list[int]) -> tuple[int, int]:
    """A tensor's 2-D view as TE's kernels read it: all leading dimensions flattened, the last kept."""
    columns = shape[-1] if shape else 1
    return math.prod(shape[:-1]), columns


def block_scale_shape(shape: list[int], block_scaling_dim: int, columnwise: bool) -> tuple[int, int]:
    """Float8BlockQuantizer's scale-inverse shape (quantizer.cpp get_scale_shape, GEMM-ready)."""
    rows, columns = _matrix_shape(shape)
    row_blocks, column_blocks = math.ceil(rows / BLOCK_LEN), math.ceil(columns / BLOCK_LEN)
    if block_scaling_dim == 2:
        return (column_blocks, _padded(row_blocks)) if columnwise else (row_blocks, _padded(column_blocks))
    return (row_blocks, _padded(columns)) if columnwise else (column_blocks, _padded(rows))


# --- TE's tensors, as the quantizers' C++ create_tensor makes them -------------------------------------

def _new_tensor(quantizer: Any, shape: list[int], fake_dtype: torch.dtype, device: torch.device) -> Any:
    kind = _quantizer_kind(quantizer)
    rowwise, columnwise = bool(quantizer.rowwise_usage), bool(quantizer.columnwise_usage)

    def bytes_of(dims):
        return torch.empty(dims, dtype=torch.uint8, device=device)

    def floats(dims):
        return torch.empty(dims, dtype=torch.float32, device=device)

    wrapper = {} if quantizer.internal else {"shape": shape, "stride": _contiguous_strides(shape),
                                             "dtype": fake_dtype, "device": device}
    if kind == "block":
        from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockwiseQTensor
        from transformer_engine.pytorch.tensor.storage.float8_blockwise_tensor_storage import (
            Float8BlockwiseQTensorStorage)

        dim = int(quantizer.block_scaling_dim)
        buffers = {
            "rowwise_data": bytes_of(shape) if rowwise else None,
            "rowwise_scale_inv": floats(block_scale_shape(shape, dim, False)) if rowwise else None,
            "columnwise_data": bytes_of(_columnwise_shape(shape)) if columnwise else None,
            "columnwise_scale_inv": floats(block_scale_shape(shape, dim, True)) if columnwise else None,
        }
        common = {**buffers, "fp8_dtype": quantizer.dtype, "quantizer": quantizer, "is_2D_scaled": dim == 2}
        if quantizer.internal:
            return Float8BlockwiseQTensorStorage(**common, fake_dtype=fake_dtype)
        return Float8BlockwiseQTensor(**common, **wrapper)
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Tensor
    from transformer_engine.pytorch.tensor.storage.float8_tensor_storage import Float8TensorStorage

    common = {"data": bytes_of(shape) if rowwise else None, "fp8_scale_inv": floats([1]),
              "data_transpose": bytes_of(_columnwise_shape(shape)) if columnwise else None,
              "fp8_dtype": quantizer.dtype, "quantizer": quantizer}
    if quantizer.internal:
        return Float8TensorStorage(**common, fake_dtype=fake_dtype)
    return Float8Tensor(**common, **wrapper)


def _coerced(output: Any, quantizer: Any) -> Any:
    """`output`'s buffers made to match the quantizer's usages (quantizer.cpp convert_and_update_tensor):
    a buffer the usage needs is allocated, one it does not need dropped."""
    kind = _quantizer_kind(quantizer)
    rowwise, columnwise = bool(quantizer.rowwise_usage), bool(quantizer.columnwise_usage)
    shape = list(output.size())
    if kind == "block":
        dim = 2 if output._is_2D_scaled else 1
        wanted = {"_rowwise_data": (rowwise, torch.uint8, shape),
                  "_rowwise_scale_inv": (rowwise, torch.float32, block_scale_shape(shape, dim, False)),
                  "_columnwise_data": (columnwise, torch.uint8, _columnwise_shape(shape)),
                  "_columnwise_scale_inv": (columnwise, torch.float32, block_scale_shape(shape, dim, True))}
    else:
        wanted = {"_data": (rowwise, torch.uint8, shape),
                  "_transpose": (columnwise, torch.uint8, _columnwise_shape(shape))}
        output._transpose_invalid = not columnwise
    for attribute, (needed, dtype, dims) in wanted.items():
        present = getattr(output, attribute) is not None
        if needed and not present:
            setattr(output, attribute, torch.empty(dims, dtype=dtype, device=_current_device()))
        elif present and not needed:
            setattr(output, attribute, None)
    output._fp8_dtype = quantizer.dtype
    return output


# --- the casts ----------------------------------------------------------------------------------------

def _cast(values: torch.Tensor, scale: torch.Tensor, fmt: Fp8Dtype) -> torch.Tensor:
    """FP32 `values` times `scale` (broadcast), rounded once to nearest even in `fmt` with saturation
    (CUDA's __NV_SATFINITE conversion), as bytes."""
    return round_to_nearest(values * scale, fmt.dtype, saturate=True).view(torch.uint8)


def _scale(amax: torch.Tensor, fmt: Fp8Dtype, *, power_of_two: bool, epsilon: float) -> torch.Tensor:
    """recipe_common.cuh compute_scale_from_amax: amax floored at epsilon, fp8 max / amax in FP32."""
    return scale_from_amax(torch.clamp_min(amax.float(), float(epsilon)), fmt.max, power_of_two=power_of_two)


def _blocks(matrix: torch.Tensor, block_rows: int) -> torch.Tensor:
    """[rows, columns] as [row blocks, block_rows, column blocks, BLOCK_LEN], zero-padded (zeros change no amax)."""
    rows, columns = matrix.shape
    padded = torch.nn.functional.pad(matrix, (0, -columns % BLOCK_LEN, 0, -rows % block_rows))
    return padded.reshape(math.ceil(rows / block_rows), block_rows, math.ceil(columns / BLOCK_LEN), BLOCK_LEN)


def quantize_blocks(matrix: torch.Tensor, block_rows: int, fmt: Fp8Dtype, *, power_of_two: bool,
                    epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 `matrix` [rows, columns] in blocks of block_rows x 128 along its columns: (FP8 bytes
    [rows, columns], FP32 scale-inverses [row blocks, column blocks])."""
    blocks = _blocks(matrix, block_rows)
    scale = _scale(blocks.abs().amax(dim=(1, 3)), fmt, power_of_two=power_of_two, epsilon=epsilon)
    data = _cast(blocks, scale[:, None, :, None], fmt)
    rows, columns = matrix.shape
    return data.reshape(blocks.shape[0] * block_rows, -1)[:rows, :columns], torch.reciprocal(scale)


def _per_tensor(matrix: torch.Tensor, output: Any, scale: torch.Tensor, fmt: Fp8Dtype) -> None:
    data = _cast(matrix, scale, fmt)
    if output._data is not None:
        output._data.copy_(data.reshape(output._data.shape))
    if output._transpose is not None:
        output._transpose.copy_(data.t().reshape(output._transpose.shape))
    output._scale_inv.copy_(torch.reciprocal(scale).reshape(output._scale_inv.shape))


def _blockwise(matrix: torch.Tensor, output: Any, quantizer: Any, fmt: Fp8Dtype) -> None:
    block_rows = BLOCK_LEN if output._is_2D_scaled else 1
    options = {"power_of_two": bool(quantizer.force_pow_2_scales), "epsilon": float(quantizer.amax_epsilon)}
    for data_name, scale_name, source in (("_rowwise_data", "_rowwise_scale_inv", matrix),
                                          ("_columnwise_data", "_columnwise_scale_inv", matrix.t())):
        data, scale_inv = getattr(output, data_name), getattr(output, scale_name)
        if data is None:
            continue
        values, grid = quantize_blocks(source, block_rows, fmt, **options)
        data.copy_(values.reshape(data.shape))
        # GEMM-ready: 1x128 scales stored transposed ([blocks along K, rows]); 128x128 as [row blocks, column blocks].
        grid = grid if output._is_2D_scaled else grid.t()
        scale_inv[: grid.shape[0], : grid.shape[1]].copy_(grid)


@stand_in(name="transformer_engine_torch.quantize", stands_for="TE's FP8 cast kernels (tex.quantize: nvte_quantize_v2,"
          " with nvte_compute_amax and nvte_compute_scale_from_amax for current scaling)",
          computes="TE's tensor for the quantizer's usages, filled with the input times its scale (delayed: the"
                   " quantizer's; current: from the tensor's amax; blockwise: per 1x128 or 128x128 block) rounded once"
                   " to nearest even in E4M3 or E5M2 with saturation (references.rounding), column-wise copies"
                   " transposed, scale-inverses the FP32 reciprocals; delayed scaling's amax recorded by max")
def quantize(tensor, quantizer, output=None, noop_flag=None):
    kind = _quantizer_kind(quantizer)
    require_on_gpu("quantize", tensor=tensor, noop_flag=noop_flag)
    shape = list(tensor.shape)
    if output is None:
        output = _new_tensor(quantizer, shape, tensor.dtype, _current_device())
    else:
        output = _coerced(output, quantizer)
    if tensor.numel() == 0 or (noop_flag is not None and float(noop_flag.reshape(-1)[0]) == 1.0):
        return output
    fmt = _format(quantizer.dtype)
    matrix = tensor.contiguous().reshape(_matrix_shape(shape)).float()
    if kind == "block":
        _blockwise(matrix, output, quantizer, fmt)
        return output
    amax = matrix.abs().amax()
    if kind == "delayed":
        require_on_gpu("quantize", scale=quantizer.scale, amax=quantizer.amax)
        quantizer.amax.copy_(torch.maximum(quantizer.amax, amax.reshape(quantizer.amax.shape)))
        _per_tensor(matrix, output, quantizer.scale.float().reshape(()), fmt)
        return output
    if quantizer.with_amax_reduction:
        amax = amax.reshape(1).clone()
        torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX,
                                     group=quantizer._canonicalized_amax_reduction_group())
    scale = _scale(amax.reshape(()), fmt, power_of_two=bool(quantizer.force_pow_2_scales),
                   epsilon=float(quantizer.amax_epsilon))
    _per_tensor(matrix, output, scale, fmt)
    return output


@stand_in(name="transformer_engine_torch.create_empty_quantized_tensor",
          stands_for="TE's quantizer create_tensor (tex.create_empty_quantized_tensor)",
          computes="TE's tensor class for the quantizer with uninitialised buffers for its usages, as TE allocates"
                   " them")
def create_empty_quantized_tensor(quantizer, shape, dtype, device=None, pin_memory=False):
    if pin_memory:
        raise NotEmulated("a quantized tensor in pinned host memory is not emulated")
    place = torch.device(device) if device is not None else _current_device()
    return _new_tensor(quantizer, list(shape), dtype, place)


@stand_in(name="transformer_engine_torch.dequantize", stands_for="TE's FP8 dequantization kernel (tex.dequantize)",
          computes="the FP8 values in FP32 times the per-tensor scale-inverse, rounded once to the output dtype")
def dequantize(tensor, otype):
    from transformer_engine.pytorch.tensor.storage.float8_tensor_storage import Float8TensorStorage

    if not isinstance(tensor, Float8TensorStorage):
        raise NotEmulated(f"tex.dequantize of a {type(tensor).__name__} is not emulated (TE's Python dequantizes"
                          " blockwise tensors itself)")
    require_on_gpu("dequantize", data=tensor._data, scale_inv=tensor._scale_inv)
    values = tensor._data.view(_format(tensor._fp8_dtype).dtype).float() * tensor._scale_inv.float()
    return values.to(torch_dtype(otype))


@stand_in(name="transformer_engine_torch.fp8_transpose", stands_for="TE's FP8 transpose kernel (tex.fp8_transpose)",
          computes="the bytes of the 2-D view transposed, last dimension first (exact)")
def fp8_transpose(tensor, dtype, out=None):
    require_on_gpu("fp8_transpose", tensor=tensor, out=out)
    shape = list(tensor.shape)
    transposed = tensor.reshape(_matrix_shape(shape)).t().reshape(_columnwise_shape(shape))
    if out is None:
        return transposed.contiguous()
    out.copy_(transposed)
    return out


@stand_in(name="transformer_engine_torch.compute_amax", stands_for="TE's amax kernel (tex.compute_amax)",
          computes="the largest magnitude of the tensor in FP32, written into the one-element amax")
def compute_amax(tensor, amax):
    require_on_gpu("compute_amax", tensor=tensor, amax=amax)
    amax.copy_(tensor.float().abs().amax().reshape(amax.shape))


@stand_in(name="transformer_engine_torch.fused_amax_and_scale_update_after_reduction",
          stands_for="TE's delayed-scaling update (nvte_delayed_scaling_recipe_amax_and_scale_update_after_reduction)",
          computes="per tensor, its amax from the reduction buffer (the history's current row where that is 0);"
                   " the history rolled one step with that amax last and the current row zeroed; the scale (fp8 max x"
                   " 2^-margin) / amax in FP32 from the most recent or the largest amax, FP32's max where that"
                   " overflows, kept where the amax is 0, Inf or NaN")
def fused_amax_and_scale_update_after_reduction(amax_reduction_buffer, amax_histories, scales, amax_compute_algo,
                                                fp8_dtype, margin):
    if amax_compute_algo not in ("most_recent", "max"):
        raise RuntimeError(f"Unsupported amax compute algorithm ({amax_compute_algo})")
    scaled_max = _format(fp8_dtype).max * 2.0 ** -float(margin)  # exact in FP32 for an integer margin
    offset = 0
    for history, scale in zip(amax_histories, scales):
        require_on_gpu("fused_amax_and_scale_update_after_reduction", buffer=amax_reduction_buffer, history=history,
                       scale=scale)
        count = history.shape[1]
        reduced = amax_reduction_buffer[offset: offset + count].float()
        offset += count
        latest = torch.where(reduced != 0, reduced, history[0])
        rolled = torch.cat([history[1:], latest[None]])  # one step older, the latest amax last
        amax = latest if amax_compute_algo == "most_recent" else rolled.amax(dim=0)
        rolled[0] = 0  # the current row, which the next casts fill
        seen = latest != 0  # a zero amax leaves its history and scale as they are
        history.copy_(torch.where(seen, rolled, history))
        amax = torch.where(seen, amax, torch.zeros_like(amax))
        quotient = scaled_max / amax
        quotient = torch.where(torch.isinf(quotient), torch.finfo(torch.float32).max, quotient)
        usable = torch.isfinite(amax) & (amax > 0)
        scale.copy_(torch.where(usable, quotient, scale))


# --- FP8 GEMM operands (te_gemm.generic_gemm) -------------------------------------------------------

def _gemm_matrix(tensor: Any, rowwise: bool, name: str) -> Quantized:
    """The operand a Hopper FP8 GEMM reads from TE's tensor, [rows, K] with K its contraction
    (cublaslt_gemm.cu CanonicalizeGemmInput: TN only, so a transposed use reads the column-wise copy)."""
    from transformer_engine.pytorch.tensor.storage.float8_blockwise_tensor_storage import (
        Float8BlockwiseQTensorStorage)
    from transformer_engine.pytorch.tensor.storage.float8_tensor_storage import Float8TensorStorage

    usage = "row-wise" if rowwise else "column-wise"
    if isinstance(tensor, Float8TensorStorage):
        data = tensor._data if rowwise else (None if tensor._transpose_invalid else tensor._transpose)
        scale_inv = tensor._scale_inv
    elif isinstance(tensor, Float8BlockwiseQTensorStorage):
        data = tensor._rowwise_data if rowwise else tensor._columnwise_data
        scale_inv = tensor._rowwise_scale_inv if rowwise else tensor._columnwise_scale_inv
    else:
        raise NotEmulated(f"TE GEMM with a {type(tensor).__name__} operand is not emulated")
    if data is None:
        raise RuntimeError(f"Input {name} is missing {usage} usage (TE's FP8 GEMM on Hopper reads the {usage} data)")
    require_on_gpu("generic_gemm", **{f"{name}_data": data, f"{name}_scale_inv": scale_inv})
    matrix = data.reshape(-1, data.shape[-1]) if rowwise else data.reshape(data.shape[0], -1)
    values = matrix.view(_format(tensor._fp8_dtype).dtype)
    if isinstance(tensor, Float8TensorStorage):
        return Quantized(data=values, scale_inv=scale_inv.float().reshape(()), block=None)
    rows, columns = values.shape
    if tensor._is_2D_scaled:
        grid = scale_inv[:, : math.ceil(columns / BLOCK_LEN)]
        return Quantized(data=values, scale_inv=grid.float(), block=(BLOCK_LEN, BLOCK_LEN))
    return Quantized(data=values, scale_inv=scale_inv[:, :rows].t().float(), block=(1, BLOCK_LEN))


def _scales_per_row(q: Quantized) -> torch.Tensor:
    """A block-scaled operand's scale-inverses per row and 128-element block of K: [rows, K blocks]."""
    rows = q.data.shape[0]
    return q.scale_inv.repeat_interleave(q.block[0], dim=0)[:rows]


def split_accumulated(a: Quantized, b: Quantized) -> torch.Tensor:
    """a [N, K] times b [M, K] transposed, both block-scaled along K: per 128-element block of K the FP32
    product of the FP8 values times both blocks' scale-inverses, the blocks' results added into an FP32
    accumulator in order (the split accumulator TE's block-scaled GEMM always uses: gemm.py general_gemm)."""
    k = a.data.shape[1]
    k_blocks = math.ceil(k / BLOCK_LEN)

    def by_block(q: Quantized) -> torch.Tensor:  # [K blocks, rows, 128]
        values = torch.nn.functional.pad(q.values(), (0, k_blocks * BLOCK_LEN - k))
        return values.reshape(values.shape[0], k_blocks, BLOCK_LEN).transpose(0, 1)

    partial = torch.bmm(by_block(a), by_block(b).transpose(1, 2))
    scaled = partial * (_scales_per_row(a).t()[:, :, None] * _scales_per_row(b).t()[:, None, :])
    total = scaled[0]
    for block in scaled[1:]:
        total = total + block
    return total


class _HopperPlan:
    """The split-K decisions of the GEMMs mmaemu computes while `hopper_arithmetic` is active (None: off)."""

    split_k: Mapping[tuple[int, int, int], Any] | None = None
    lock = threading.Lock()


@contextlib.contextmanager
def hopper_arithmetic(split_k: Mapping[tuple[int, int, int], Any]) -> Iterator[None]:
    """Per-tensor FP8 GEMMs by mmaemu's hopper-te profile (correctness.fp8.hopper: the H100 PCIe's FP8 GEMM, bit
    for bit) instead of the FP32 stand-in, for the block; fast accumulation or the split accumulator as TE asks
    (its use_split_accumulator). `split_k` maps each GEMM's (M, N, K) (rows of op(B), rows of op(A), contraction)
    to cuBLAS's split of K, decided by the caller (correctness.fp8.hopper.split_decision, at the recipe's shape):
    a GEMM not in it is refused, never guessed. Off by default: a GEMM costs 0.15-2.8 s at the smoke shapes."""
    with _HopperPlan.lock:
        saved, _HopperPlan.split_k = _HopperPlan.split_k, dict(split_k)
    try:
        yield
    finally:
        with _HopperPlan.lock:
            _HopperPlan.split_k = saved


def _hopper_product(a: Quantized, b: Quantized, split_accumulator: bool) -> torch.Tensor:
    from correctness.fp8.hopper import PROFILE, import_mmaemu, subnormals_kept

    shape = (a.data.shape[0], b.data.shape[0], a.data.shape[1])
    plan = _HopperPlan.split_k
    if shape not in plan:
        raise NotEmulated(f"mmaemu's split-K for the FP8 GEMM (M, N, K) = {shape} was not given: not guessed")
    mmaemu = import_mmaemu()
    device = a.data.device
    # Host code: the tensors it makes (mmaemu's cached plans) belong on the CPU, in a backward's ambient GPU place too.
    saved, AMBIENT.place = AMBIENT.place, CPU
    try:
        with subnormals_kept(), torch.no_grad():
            product = mmaemu.scaled_mm(a.data.cpu(), b.data.cpu().t(), a.scale_inv.cpu(), b.scale_inv.cpu(),
                                       out_dtype=torch.float32, use_fast_accum=not split_accumulator, profile=PROFILE,
                                       splitk=plan[shape])
    finally:
        AMBIENT.place = saved
    return product.to(device)


def quantized_product(A: Any, transa: bool, B: Any, transb: bool, use_split_accumulator: bool) -> torch.Tensor:
    """op(B) @ op(A)^T of TE's FP8 operands in FP32, scales applied: [N, M]. One scale per tensor: the FP32
    product of the FP8 values times both scale-inverses after the accumulation (correctness.fp8.scaling.fp8_gemm,
    the CPU tier's stand-in; mmaemu's Hopper arithmetic under `hopper_arithmetic`); blocks: `split_accumulated`."""
    if not (quantized(A) and quantized(B)):
        raise NotEmulated("TE GEMM with one quantized operand and one not is not emulated (cuBLAS takes FP8 pairs)")
    a = _gemm_matrix(B, rowwise=not transb, name="B")
    b = _gemm_matrix(A, rowwise=transa, name="A")
    if a.data.shape[1] != b.data.shape[1]:
        raise RuntimeError(f"TE FP8 GEMM: contractions differ, {a.data.shape} and {b.data.shape}")
    if a.block is None and b.block is None:
        if _HopperPlan.split_k is not None:
            return _hopper_product(a, b, use_split_accumulator)
        return fp8_gemm(a, b, torch.float32)
    if a.block is None or b.block is None:
        raise RuntimeError("Inputs A and B to GEMM need to have compatible scaling modes (per-tensor and block)")
    return split_accumulated(a, b)
