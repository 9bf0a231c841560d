"""Numerical helpers the unit tests share (not the suite's own comparison, which is
correctness.compare's accumulators): a plain relative error, and how near FP32 paths come to FP64."""

import torch

# An FP32 path against the FP64 reference on the same inputs: rounding alone is far below this.
FP32_AGREEMENT = 1e-5


def relative_l2_error(x: torch.Tensor, ref: torch.Tensor) -> tuple[float, str]:
    """||x - ref|| / ||ref|| in FP64, or ||x - ref|| with kind "absolute" where ref is all zeros."""
    ref64 = ref.to(torch.float64)
    diff = torch.linalg.vector_norm(x.to(torch.float64) - ref64).item()
    scale = torch.linalg.vector_norm(ref64).item()
    if scale == 0.0:
        return diff, "absolute"
    return diff / scale, "relative"
