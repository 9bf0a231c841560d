"""FP8 quantisation as Transformer Engine 2.17 does it, in torch's float8 dtypes (any device).

What a recipe means (TE transformer_engine/common/recipe/__init__.py; megatron-core 0.16
fp8_utils.get_fp8_recipe maps --fp8-recipe to these classes and --fp8-format to Format.E4M3 or
Format.HYBRID):

- formats: `e4m3` quantises every tensor to E4M3 (max 448); `hybrid` the forward's tensors (input,
  weight) to E4M3 and the backward's output gradient to E5M2 (max 57344).
- `delayed` (DelayedScaling): one scale per tensor from its amax history, scale = (fp8 max / amax)
  / 2^margin, amax the history's most recent or its max (Megatron: --fp8-amax-history-len 1,
  --fp8-amax-compute-algo most_recent, --fp8-margin 0 by default).
- `tensorwise` (Float8CurrentScaling): one scale per tensor from the tensor's own amax, fp8 max /
  amax in FP32, not rounded to a power of two (NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES unset).
- `blockwise` (Float8BlockScaling): inputs and output gradients in 1x128 blocks along the GEMM's
  contraction, weights in 128x128 blocks; each block's scale fp8 max / amax rounded down to a
  power of two (NVTE_FP8_BLOCK_SCALING_FP32_SCALES unset). The copy a backward GEMM reads (the
  "columnwise" data) is quantised again from the high-precision tensor, in blocks along its own
  contraction.
- `mxfp8` (MXFP8BlockScaling): every tensor in 1x32 blocks along the contraction, each with an
  E8M0 scale (a power of two): the dequantisation scale is amax / fp8 max rounded up to a power of
  two (TE's float_to_e8m0, util/ptx.cuh), so no element saturates; both directions quantised from
  the high-precision tensor.

TE computes a scale as common/recipe/recipe_common.cuh's compute_scale_from_amax: scale = fp8
max / amax in FP32 (1 where amax is 0, Inf or NaN), its mantissa cleared for a power of two; the
value is cast with CUDA's saturating conversion (__NV_SATFINITE), and the GEMM multiplies by the
inverse scale. torch's cast to float8_e5m2 overflows to Inf instead, so the cast here
(references.rounding with `saturate`) clamps values to the format's largest finite value first (the
same result as the saturating cast).
"""

import math
from dataclasses import dataclass, field

import torch

from references.rounding import round_to_nearest, round_toward_zero

RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
FORMATS = ("e4m3", "hybrid")
AMAX_ALGOS = ("most_recent", "max")
BLOCK = 128  # Float8BlockScaling's block edge
MX_BLOCK = 32  # MXFP8's block length


@dataclass(frozen=True)
class Fp8Dtype:
    name: str  # "e4m3" or "e5m2"
    dtype: torch.dtype
    mantissa_bits: int

    @property
    def max(self) -> float:
        return float(torch.finfo(self.dtype).max)

    @property
    def saturation(self) -> float:
        """Where clamping starts to matter: above max + half its ulp even an unbounded format would
        not round a value down to max."""
        ulp = 2.0 ** (math.floor(math.log2(self.max)) - self.mantissa_bits)
        return self.max + ulp / 2


E4M3 = Fp8Dtype("e4m3", torch.float8_e4m3fn, 3)
E5M2 = Fp8Dtype("e5m2", torch.float8_e5m2, 2)


@dataclass(frozen=True, kw_only=True)
class Fp8Config:
    """The recipe's FP8 settings (Megatron's --fp8-format, --fp8-recipe, --fp8-margin,
    --fp8-amax-history-len, --fp8-amax-compute-algo)."""

    recipe: str
    format: str
    margin: int = 0
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"

    def __post_init__(self):
        if self.recipe not in RECIPES:
            raise ValueError(f"FP8 recipe {self.recipe!r}: expected one of {', '.join(RECIPES)}")
        if self.format not in FORMATS:
            raise ValueError(f"FP8 format {self.format!r}: expected one of {', '.join(FORMATS)}")
        if self.amax_compute_algo not in AMAX_ALGOS:
            raise ValueError(f"FP8 amax compute algo {self.amax_compute_algo!r}: expected one of {', '.join(AMAX_ALGOS)}")
        if not (isinstance(self.amax_history_len, int) and self.amax_history_len >= 1):
            raise ValueError(f"FP8 amax history length {self.amax_history_len!r}: expected a positive integer")

    @property
    def forward(self) -> Fp8Dtype:
        return E4M3

    @property
    def backward(self) -> Fp8Dtype:
        return E5M2 if self.format == "hybrid" else E4M3

    @property
    def id(self) -> str:
        extra = ""
        if self.recipe == "delayed":
            extra = f"-h{self.amax_history_len}{'max' if self.amax_compute_algo == 'max' else ''}"
            extra += f"-m{self.margin}" if self.margin else ""
        return f"{self.recipe}-{self.format}{extra}"

    def block(self, role: str) -> tuple[int, int] | None:
        """The quantisation block (rows, columns along the contraction) of an operand: `role` is
        "input", "weight" or "grad"; None for one scale per tensor."""
        if self.recipe == "blockwise":
            return (BLOCK, BLOCK) if role == "weight" else (1, BLOCK)
        if self.recipe == "mxfp8":
            return (1, MX_BLOCK)
        return None


def _power_of_two_below(scale: torch.Tensor) -> torch.Tensor:
    """The scale with its FP32 mantissa cleared: 2^floor(log2(scale)) for a positive normal scale."""
    bits = scale.float().contiguous().view(torch.int32) & -8388608  # 0xFF800000 as a signed int32
    return bits.view(torch.float32)


def _power_of_two_above(value: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(value)) for a positive FP32 value: an exact power of two stays."""
    mantissa, exponent = torch.frexp(value.float())  # value = mantissa * 2^exponent, mantissa in [0.5, 1)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    return torch.ldexp(torch.ones_like(mantissa), exponent)


def scale_from_amax(amax: torch.Tensor, fp8_max: float, power_of_two: bool) -> torch.Tensor:
    """TE's compute_scale_from_amax (epsilon 0): fp8_max / amax in FP32; 1 where amax is 0, Inf or
    NaN; FP32's max where the quotient overflows."""
    amax = amax.float()
    scale = torch.full_like(amax, fp8_max) / amax
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, torch.finfo(torch.float32).max), scale)
    scale = torch.where((amax == 0) | torch.isinf(amax) | torch.isnan(amax), torch.ones_like(scale), scale)
    return _power_of_two_below(scale) if power_of_two else scale


def e8m0_scale_inv(amax: torch.Tensor, fp8_max: float, *, round_up: bool = True) -> torch.Tensor:
    """MXFP8's dequantisation scale (TE's float_to_e8m0 of amax x (1 / fp8 max), util/ptx.cuh): the
    FP32 product rounded up to a power of two; 2^-127 where amax is 0. Stored as float8_e8m0fnu.
    `round_up` False rounds it down instead, so that a block's largest elements saturate: a wrong
    implementation (correctness.fp8.wrong)."""
    product = amax.float() * torch.tensor(1.0 / fp8_max, dtype=torch.float32)
    scale_inv = _power_of_two_above(product) if round_up else _power_of_two_below(product)
    scale_inv = torch.where(product == 0, torch.full_like(product, 2.0 ** -127), scale_inv)
    return scale_inv.to(torch.float8_e8m0fnu)


def _blocks(t: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """A [rows, cols] tensor as [row blocks, block rows, column blocks, block cols]; partial blocks
    at the edges padded with zeros (which change no block's amax)."""
    rows, cols = t.shape
    br, bc = block
    if rows % br or cols % bc:
        t = torch.nn.functional.pad(t, (0, -cols % bc, 0, -rows % br))
    return t.reshape(math.ceil(rows / br), br, math.ceil(cols / bc), bc)


def _unblocked(blocks: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    grid_rows, br, grid_cols, bc = blocks.shape
    return blocks.reshape(grid_rows * br, grid_cols * bc)[: shape[0], : shape[1]]


@dataclass(frozen=True, kw_only=True)
class Quantized:
    """An operand as an FP8 GEMM reads it: `data` [rows, cols] in an FP8 dtype, quantised along its
    columns (the GEMM's contraction), and its dequantisation scale: one FP32 scalar, or one per
    block of `block` elements ([row blocks, column blocks], FP32 or E8M0)."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple[int, int] | None
    saturated: int = 0  # elements clamped to the format's largest value beyond rounding (counted where the scale came from elsewhere)
    details: dict = field(default_factory=dict, compare=False)

    def values(self) -> torch.Tensor:
        """The FP8 values in FP32, unscaled (exact)."""
        return self.data.float()

    def dequantize(self, times_scaled: int = 1, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The FP8 values times their scales in `dtype` (exact in FP32 for power-of-two scales, in
        FP64 for any FP32 scale). `times_scaled`: how many times the inverse scale is applied (1;
        0 or 2 only for the negative controls)."""
        values = self.data.to(dtype)
        if times_scaled == 0:
            return values
        scale_inv = self.scale_inv.to(dtype) ** times_scaled
        if self.block is None:
            return values * scale_inv
        return _unblocked(_blocks(values, self.block) * scale_inv[:, None, :, None], self.data.shape)


def _cast(scaled: torch.Tensor, fmt: Fp8Dtype, count_saturated: bool, truncate: bool) -> tuple[torch.Tensor, int]:
    """The FP32 `scaled` cast to `fmt`, saturating (toward zero: `truncate`, a wrong implementation),
    and how many elements saturated (counted only where `count_saturated`)."""
    saturated = int(torch.count_nonzero(scaled.abs() > fmt.saturation)) if count_saturated else 0
    rounding = round_toward_zero if truncate else round_to_nearest
    return rounding(scaled, fmt.dtype, saturate=True), saturated


def quantize(t: torch.Tensor, config: Fp8Config, role: str, fmt: Fp8Dtype, *,
             amax_override: torch.Tensor | None = None, truncate: bool = False,
             scale_toward_saturation: bool = False) -> Quantized:
    """`t` [rows, cols] quantised along its columns as the config's recipe does for an operand of
    `role` ("input", "weight", "grad"). `amax_override`: the amax the scale comes from, where it
    is not the tensor's own (delayed scaling's history; a control's wrong tensor); only then can
    an element exceed the format's range (a scale from a tensor's own amax maps it to the largest
    value), and only then are the saturated elements counted.

    Two wrong implementations (correctness.fp8.wrong), TE's cast and scales otherwise: `truncate`
    rounds toward zero instead of to nearest even; `scale_toward_saturation` rounds a block's
    power-of-two scale the other way (blockwise: up; MXFP8: its E8M0 scale down), so the block's
    largest elements land beyond the format's largest value and saturate (then counted too)."""
    block = config.block(role)
    t = t.float()
    overridden = amax_override is not None
    if block is None:
        own_amax = t.abs().amax()
        amax = amax_override.float().reshape(()) if overridden else own_amax
        margin = 2.0 ** config.margin if config.recipe == "delayed" else 1.0
        scale = scale_from_amax(amax, fmt.max, power_of_two=False) / margin
        data, saturated = _cast(t * scale, fmt, overridden, truncate)
        return Quantized(data=data, scale_inv=torch.reciprocal(scale), block=None, saturated=saturated,
                         details={"amax": float(own_amax), "scale_amax": float(amax)})
    blocks = _blocks(t, block)
    amax = blocks.abs().amax(dim=(1, 3))
    if overridden:
        amax = torch.full_like(amax, float(amax_override))
    if config.recipe == "mxfp8":
        scale_inv = e8m0_scale_inv(amax, fmt.max, round_up=not scale_toward_saturation)
        scale = torch.reciprocal(scale_inv.float())  # a power of two: exact
    else:
        scale = scale_from_amax(amax, fmt.max, power_of_two=False)
        scale = _power_of_two_above(scale) if scale_toward_saturation else _power_of_two_below(scale)
        scale_inv = torch.reciprocal(scale)
    scaled = _unblocked(blocks * scale[:, None, :, None], t.shape)
    data, saturated = _cast(scaled, fmt, overridden or scale_toward_saturation, truncate)
    return Quantized(data=data, scale_inv=scale_inv, block=block, saturated=saturated)


def fp8_gemm(a: Quantized, b: Quantized, out_dtype: torch.dtype, *, times_scaled: int = 1) -> torch.Tensor:
    """a [M, K] times b [N, K] transposed, both quantised along K: the named stand-in for an FP8
    GEMM with FP32 accumulation (cuBLAS with split accumulation; torch._scaled_mm on the CPU). One
    scale per tensor: the FP32 product of the unscaled FP8 values, multiplied by both inverse scales
    after the accumulation, as cuBLAS applies scale_a x scale_b to its FP32 accumulator; per-block
    power-of-two scales: the exactly dequantised operands multiplied in FP32 (a block-scaled GEMM
    scales each block's partial sum by the same powers of two). Then rounded to `out_dtype`.
    `times_scaled`: how many times the inverse scales are applied (1; 0 or 2 for the controls)."""
    if a.block is None and b.block is None:
        product = a.values() @ b.values().t()
        if times_scaled:
            product = product * (a.scale_inv * b.scale_inv) ** times_scaled
        return product.to(out_dtype)
    return (a.dequantize(times_scaled) @ b.dequantize(times_scaled).t()).to(out_dtype)
