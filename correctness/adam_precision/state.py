"""How TE FusedAdam stores its optimizer state in lowered precision (TE 2.17), in torch ops on FP32
values: the storage half of the CPU tier's stand-in for the kernel (correctness.adam_precision.paths).

Read in NVIDIA/TransformerEngine v2.17, transformer_engine/pytorch/optimizers/fused_adam.py:
- Dtypes (`__init__`): master weights FP32 or FP16 (anything else raises "FusedAdam only supports
  fp32/fp16 master weights"); exp_avg and exp_avg_sq FP32, FP16, BF16 or torch.uint8 (FP8 E4M3).
  Megatron maps its flag values fp32 / bf16 / fp16 / fp8 to exactly these dtypes (the recipes'
  megatron/training/arguments.py 710-718 at radixark/Megatron-LM 37f91617; `--main-params-dtype`
  takes fp32 or fp16 only, 2958).
- Every step (`step`) reads each state unscaled into FP32 (`get_unscaled_state`), runs the FP32
  kernel on it, and stores it back (`_apply_scale`):
  - FP32: kept as it is.
  - BF16: `unscaled.bfloat16()`, round to nearest even, no scale; where both moments are BF16 the
    kernel reads and writes them itself (`fuse_unscale`, common/multi_tensor/adam.cu 148-151:
    `static_cast<MOMENT_T>`), the same rounding.
  - FP16: one FP32 scale per tensor, scale = absmax / (65504 / 2), values stored as
    FP16(x * (1 / scale)) (the product in FP32, then round to nearest even); read back as
    FP16 value x scale in FP32.
  - FP8 (E4M3): scale = absmax / 448, the Float8Tensor's quantizer scale set to 1 / scale, values
    quantized by TE's cast kernel as E4M3(x * (1 / scale)), saturating at +-448 (CUDA's
    `__nv_fp8_e4m3` conversion, round to nearest even), scale_inv = 1 / (1 / scale)
    (common/cast/fp8/quantize_fp8.cuh: `reciprocal<float>`); read back as value x scale_inv.
  - A fresh state (`_initialize_state`): zeros with scale 1; the FP16 or FP32 master starts as the
    BF16 parameter's values, stored as above (`initialize_state` -> `set_scaled_state`).
- `store_param_remainders` (FP32 masters of BF16 parameters, Megatron's default
  `store_param_remainders=True`, megatron-core 0.16.1 optimizer_config.py 192): the master is kept
  as the BF16 parameter plus the low 16 bits of its FP32 pattern (int16). adam.cu 239-284 splits the
  updated FP32 master into its high half, rounded up by one where the low half, read as int16, is
  negative (low bits >= 0x8000: ties go away from zero, where torch's BF16 rounding goes to even),
  and the low half; reading undoes the rounding, so the FP32 master is kept exactly.

What this emulation is not: the CUDA kernel (its FMA contraction, its multi-tensor chunking), TE's
Float8Tensor class, or FP8 parameters; the GPU tier runs TE itself.

The same storage serves the lever's format floor (correctness.adam_precision.floor): `store` also
takes FP64 values, which it rounds once, correctly, to the storage format (references.rounding;
torch converts FP64 to BF16, FP16 and E4M3 through FP32, two roundings), with the scale computed as
TE computes it, in FP32 from the absmax rounded to FP32; `load` reads them back in FP64.
`toward_zero` (a wrong implementation, correctness.adam_precision.wrong) rounds toward zero instead
of to nearest even.
"""

from dataclasses import dataclass

import torch

from references.rounding import round_to_nearest, round_toward_zero

FP16_STATE_RANGE = torch.finfo(torch.float16).max / 2.0  # fused_adam.py: dtype_to_range_map
FP8_STATE_RANGE = 448.0  # E4M3's largest finite value


@dataclass(frozen=True)
class StateFormat:
    """One dtype a FusedAdam state may be stored in, by Megatron's flag value."""

    name: str  # "fp32", "bf16", "fp16", "fp8": the values of --exp-avg-dtype and its siblings
    te_dtype: torch.dtype  # what Megatron hands to FusedAdam (torch.uint8 stands for FP8)
    storage: torch.dtype  # the element type the values are stored as
    scale_range: float | None  # a per-tensor scale maps absmax onto this; None: stored unscaled

    @property
    def lowered(self) -> bool:
        return self.storage != torch.float32


STATE_FORMATS = {
    "fp32": StateFormat(name="fp32", te_dtype=torch.float32, storage=torch.float32, scale_range=None),
    "bf16": StateFormat(name="bf16", te_dtype=torch.bfloat16, storage=torch.bfloat16, scale_range=None),
    "fp16": StateFormat(name="fp16", te_dtype=torch.float16, storage=torch.float16, scale_range=FP16_STATE_RANGE),
    "fp8": StateFormat(name="fp8", te_dtype=torch.uint8, storage=torch.float8_e4m3fn, scale_range=FP8_STATE_RANGE),
}
MASTER_FORMATS = ("fp32", "fp16")  # --main-params-dtype's choices, and TE FusedAdam's
MOMENT_FORMATS = ("fp32", "fp16", "bf16", "fp8")  # --exp-avg-dtype's and --exp-avg-sq-dtype's


def state_format(name: str, allowed: tuple[str, ...] = MOMENT_FORMATS) -> StateFormat:
    if name not in allowed:
        raise ValueError(f"state dtype {name!r} is not one of {list(allowed)}")
    return STATE_FORMATS[name]


@dataclass(frozen=True)
class Stored:
    """A state as FusedAdam holds it: `values` in the format's storage dtype and the FP32 factor
    that reads them back (`scale` for FP16, the Float8Tensor's `scale_inv` for FP8; None where
    the values are read as they are: FP32, BF16, and a fresh state, whose factor is 1)."""

    values: torch.Tensor
    factor: torch.Tensor | None = None  # FP32 scalar


def _fp32(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32)


def zeros(fmt: StateFormat, shape) -> Stored:
    """A fresh moment: zeros, factor 1 (`_initialize_state` with `zero_buffer`)."""
    return Stored(values=torch.zeros(shape, dtype=fmt.storage))


def store(fmt: StateFormat, x: torch.Tensor, *, scaled: bool = True, toward_zero: bool = False) -> Stored:
    """FP32 values `x` stored as FusedAdam's `_apply_scale` stores them (FP64 values: the format
    floor's, module docstring). `scaled=False` (a negative control) skips the per-tensor scale of
    the FP16 and FP8 formats; `toward_zero` (a wrong implementation) truncates."""
    if x.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"state values must be FP32 (or FP64, the floor's) before storing, got {x.dtype}")
    saturate = fmt.storage == torch.float8_e4m3fn  # at +-448, as CUDA's conversion
    if fmt.scale_range is None or not scaled:
        return Stored(values=rounded(x, fmt.storage, toward_zero=toward_zero, saturate=saturate))
    low, high = torch.aminmax(x)
    absmax = torch.maximum(-low, high).float()
    scale = absmax / _fp32(fmt.scale_range)  # FP32 division, as torch.div(absmax, max_range, out=scale)
    if fmt.storage == torch.float16:
        reciprocal = torch.where(scale > 0, scale.reciprocal(), _fp32(0.0))
        return Stored(values=rounded(x * reciprocal, torch.float16, toward_zero=toward_zero), factor=scale)
    quantizer_scale = _fp32(1.0) / scale  # the quantizer's scale; infinite for an all-zero state, as in TE
    return Stored(values=rounded(x * quantizer_scale, fmt.storage, toward_zero=toward_zero, saturate=saturate),
                  factor=_fp32(1.0) / quantizer_scale)


def load(stored: Stored, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The FP32 values the kernel computes with (`get_unscaled_state`); FP64 for the floor (the
    stored values times their FP32 factor, exactly)."""
    values = stored.values.to(dtype)
    return values if stored.factor is None else values * stored.factor


def rounded(x: torch.Tensor, storage: torch.dtype, *, toward_zero: bool = False,
            saturate: bool = False) -> torch.Tensor:
    """`x` (FP32, or FP64) rounded once to `storage` by references.rounding: to nearest even, or
    toward zero (`toward_zero`, a wrong implementation); `saturate`: clamped to the format's
    largest finite value first."""
    rounding = round_toward_zero if toward_zero else round_to_nearest
    return rounding(x, storage, saturate=saturate)


def split_remainder(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP32 master as TE's remainder kernel stores it: (BF16 parameter, int16 low half). The high
    half is rounded up by one where the low half is negative as an int16 (adam.cu 271-276)."""
    bits = master.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    low = bits & 0xFFFF
    high = (bits >> 16) + (low >= 0x8000).to(torch.int64)
    return _as_int16(high & 0xFFFF).view(torch.bfloat16), _as_int16(low)


def join_remainder(bf16: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The FP32 master from the BF16 parameter and its int16 remainder (adam.cu 239-244)."""
    low = remainder.to(torch.int64) & 0xFFFF
    high = (bf16.contiguous().view(torch.int16).to(torch.int64) - (low >= 0x8000).to(torch.int64)) & 0xFFFF
    bits = (high << 16) | low
    return torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32).view(torch.float32)


def _as_int16(unsigned: torch.Tensor) -> torch.Tensor:
    return torch.where(unsigned >= 1 << 15, unsigned - (1 << 16), unsigned).to(torch.int16)
