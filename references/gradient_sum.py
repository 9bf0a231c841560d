"""FP64 reference for a data-parallel gradient reduction: the sum over ranks of each rank's
gradient, times a scale.

For ranks r = 0 .. n-1 holding gradients g_r of one parameter (any float dtype, all one shape):

    reduced = scale * sum_r g_r          (in FP64: every g_r is exact in FP64, and so is their sum
                                          up to FP64's own rounding, 2^-53 relative per addition)

`scale` is what Megatron multiplies the gradients by before it sums them (1 / DP without
per-token loss; 1 with --calculate-per-token-loss), applied here once to the FP64 sum. A rank's
gradient may be dropped (`dropped`): the sum over the others, for a reference of what a path that
lost that rank's gradient should give (the negative control is judged against the full sum).

`rounding` (the format floor of a reduction in a narrower format): a function applied to each
rank's scaled FP64 gradient before the sum and to the sum, e.g. a rounding to BF16; everything
else stays FP64. The floor is then

    floored = rounding( sum_r rounding(scale * g_r) )
"""

from collections.abc import Callable, Collection, Sequence

import torch


def fp64_sum(gradients: Sequence[torch.Tensor], scale: float = 1.0, dropped: Collection[int] = (),
             rounding: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """FP64 scale * sum of gradients[r] over the ranks r not in `dropped`; zeros where none is left.
    With `rounding`: each scaled gradient and the sum passed through it (module docstring)."""
    if not gradients:
        raise ValueError("fp64_sum needs at least one rank's gradient")
    shape = gradients[0].shape
    for rank, gradient in enumerate(gradients):
        if gradient.shape != shape:
            raise ValueError(f"rank {rank}'s gradient has shape {tuple(gradient.shape)}, rank 0's {tuple(shape)}")
        if not gradient.is_floating_point():
            raise ValueError(f"rank {rank}'s gradient is {gradient.dtype}, not a floating-point tensor")
    for rank in dropped:
        if not 0 <= rank < len(gradients):
            raise ValueError(f"dropped rank {rank} outside 0..{len(gradients) - 1}")
    total = torch.zeros(shape, dtype=torch.float64, device=gradients[0].device)
    if rounding is not None:
        for rank, gradient in enumerate(gradients):
            if rank not in dropped:
                total += rounding(gradient.to(torch.float64) * float(scale)).to(torch.float64)
        return rounding(total).to(torch.float64)
    for rank, gradient in enumerate(gradients):
        if rank not in dropped:
            total += gradient.to(torch.float64)
    return total * float(scale)
