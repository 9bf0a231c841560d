"""Roundings of FP32 or FP64 values to a float format (BF16, FP16, FP8 E4M3 or E5M2, FP32), the one
home of both: `round_to_nearest`, one correct rounding to nearest even, for the format floors (the
FP64 reference passed through exactly the roundings a narrower format forces) and the emulated
casts of the code under test (Adam's lowered state, FP8 quantisation); `round_toward_zero`,
truncation, the wrong conversion that the wrong implementations of the format-floored levers make.

torch converts FP64 to BF16, FP16 or FP8 through FP32, which rounds twice: 1 + 2^-8 + 2^-30 becomes
1 + 2^-8 in FP32, a tie that BF16 then rounds to even, 1.0, where the nearest BF16 value is 1 + 2^-7.
Rounding to odd first (FP32 toward zero, its last bit set where that was inexact) keeps the
information a later round to nearest even needs: a 24-bit round to odd followed by a round to
nearest even at 22 bits or fewer (BF16 8, FP16 11, FP8 4 or 3) is the correctly rounded result
(Boldo and Melquiond, "Emulation of FMA and correctly rounded sums: proved algorithms using
rounding to odd", 2008: p >= q + 2).

Beyond the format's largest finite value `round_to_nearest` gives what torch's cast gives (inf for
BF16, FP16 and E5M2; E4M3 has no inf), `round_toward_zero` the largest finite value for a finite
value. `saturate=True` first clamps the values to +-the largest finite value, as CUDA's saturating
FP8 conversion (__NV_SATFINITE) does.
"""

import torch

FORMATS = (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2, torch.float32)
_SAME_SIZE_INTS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
                   torch.float8_e4m3fn: torch.int8, torch.float8_e5m2: torch.int8}


def round_to_nearest(values: torch.Tensor, dtype: torch.dtype, *, saturate: bool = False) -> torch.Tensor:
    """FP32 or FP64 `values` rounded once to nearest even in `dtype` (one of FORMATS), returned in
    `dtype`; `saturate`: clamped to the format's largest finite value first (module docstring)."""
    values = _checked(values, dtype, saturate)
    if values.dtype == torch.float64 and dtype != torch.float32:
        values = _round_to_odd_fp32(values)
    return values.to(dtype)


def round_toward_zero(values: torch.Tensor, dtype: torch.dtype, *, saturate: bool = False) -> torch.Tensor:
    """FP32 or FP64 `values` rounded toward zero in `dtype` (one of FORMATS; FP32 to BF16: the low
    16 bits dropped), returned in `dtype`; `saturate` as in `round_to_nearest`."""
    values = _checked(values, dtype, saturate)
    return _one_unit_toward_zero(values, round_to_nearest(values, dtype))


def _checked(values: torch.Tensor, dtype: torch.dtype, saturate: bool) -> torch.Tensor:
    if values.dtype not in (torch.float32, torch.float64) or dtype not in FORMATS:
        raise ValueError(f"rounding: FP32 or FP64 values to one of {FORMATS}, got {values.dtype} to {dtype}")
    if not saturate:
        return values
    largest = float(torch.finfo(dtype).max)
    return values.clamp(-largest, largest)


def _round_to_odd_fp32(values: torch.Tensor) -> torch.Tensor:
    """FP64 `values` in FP32 rounded to odd: toward zero, the last bit set where that was inexact."""
    truncated = _one_unit_toward_zero(values, values.to(torch.float32))
    inexact = (truncated.to(torch.float64) != values).to(torch.int32)
    return (truncated.view(torch.int32) | inexact).view(torch.float32)


def _one_unit_toward_zero(values: torch.Tensor, nearest: torch.Tensor) -> torch.Tensor:
    """`nearest` (`values` rounded to nearest in a narrower format) moved one unit toward zero where
    it is farther from zero than `values`: `values` rounded toward zero. The formats are sign and
    magnitude, so one unit less magnitude is one less in the bit pattern read as an integer."""
    bits = nearest.view(_SAME_SIZE_INTS[nearest.dtype])
    away = nearest.to(values.dtype).abs() > values.abs()
    return torch.where(away, bits - 1, bits).view(nearest.dtype)
