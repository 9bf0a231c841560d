"""Roundings of values to a narrower float format: `round_to_nearest`, one correct rounding to
nearest even, for the format floors (the FP64 reference passed through exactly the roundings a
narrower format forces); `round_toward_zero`, truncation, the wrong conversion that the wrong
implementations of the format-floored levers make.

torch converts FP64 to BF16 or FP16 through FP32, which rounds twice: 1 + 2^-8 + 2^-30 becomes
1 + 2^-8 in FP32, a tie that BF16 then rounds to even, 1.0, where the nearest BF16 value is 1 + 2^-7.
Rounding to odd first (FP32 toward zero, its last bit set where that was inexact) keeps the
information a later round to nearest even needs: a 24-bit round to odd followed by a round to
nearest even at 8 or 11 bits is the correctly rounded result (Boldo and Melquiond, "Emulation of
FMA and correctly rounded sums: proved algorithms using rounding to odd", 2008: p >= q + 2).
"""

import torch

NARROW = (torch.bfloat16, torch.float16)


def round_to_nearest(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`values` (any float dtype) rounded once to nearest even in `dtype` (BF16 or FP16), returned
    in `dtype`. Values beyond FP32's normal range are not handled specially (gradients never are)."""
    if dtype not in NARROW:
        raise ValueError(f"round_to_nearest: {dtype} is not one of {NARROW}")
    exact = values.to(torch.float64)
    nearest = exact.to(torch.float32)
    bits = nearest.view(torch.int32)
    inexact = nearest.to(torch.float64) != exact
    # FP32 toward zero: one step down in magnitude where round-to-nearest went past the value (in
    # sign-magnitude bits, one less in the integer view for either sign), then the last bit set.
    overshot = inexact & (nearest.to(torch.float64).abs() > exact.abs())
    odd = torch.where(overshot, bits - 1, bits)
    odd = torch.where(inexact, odd | 1, odd)
    return odd.view(torch.float32).to(dtype)


def round_toward_zero(values: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """FP32 `values` to BF16 rounded toward zero (the low 16 bits dropped), returned in BF16."""
    if dtype != torch.bfloat16 or values.dtype != torch.float32:
        raise ValueError(f"round_toward_zero: FP32 to BF16 only, got {values.dtype} to {dtype}")
    return (values.contiguous().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)
