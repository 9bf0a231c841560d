"""FP64 reference for a linear layer's weight gradient accumulated over the microbatches of one
training step (gradient accumulation into the gradient buffer, `main_grad`).

For microbatches m = 0 .. M-1, each with an input x_m [tokens, in] and an upstream gradient dy_m
[tokens, out] (the layout of Megatron's and Transformer Engine's Linear, weight [out, in]):

    wgrad_m       = dy_m^T x_m                   [out, in]
    main_grad(k)  = initial + sum_{m < k} wgrad_m   after k microbatches

Every input is upcast to FP64 (exact for BF16 and FP32 values); each product and each sum is
FP64's own, 2^-53 relative per operation. 3-D inputs [seq, batch, features] are read as
[seq x batch, features], as Megatron flattens them before its wgrad GEMM.

`rounding` (the format floor of an accumulation whose terms are narrower than the buffer): a
function applied to each microbatch's FP64 wgrad_m before it is added, e.g. a rounding to BF16;
everything else stays FP64.
"""

from collections.abc import Callable, Collection, Iterable

import torch


def _flat(tensor: torch.Tensor, what: str, m: int) -> torch.Tensor:
    if tensor.dim() == 3:
        return tensor.reshape(-1, tensor.shape[-1])
    if tensor.dim() != 2:
        raise ValueError(f"weight gradient: microbatch {m}'s {what} is {tensor.dim()}-D, not 2-D or 3-D")
    return tensor


def accumulated_weight_gradient(
    microbatches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    after: Collection[int],
    initial: torch.Tensor | None = None,
    rounding: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[int, torch.Tensor]:
    """{k: main_grad after k microbatches} in FP64 for each k in `after`, from (x_m, dy_m) pairs in
    the order they are accumulated; `initial` (default zeros) is the buffer before the first;
    `rounding` applied to each microbatch's wgrad before it is added (module docstring)."""
    wanted = set(after)
    if not wanted or min(wanted) < 1:
        raise ValueError(f"weight gradient: counts of microbatches must be positive, got {sorted(wanted)}")
    total = None if initial is None else initial.to(torch.float64).clone()
    sums: dict[int, torch.Tensor] = {}
    count = 0
    for count, (x, dy) in enumerate(microbatches, start=1):
        x, dy = _flat(x, "input", count - 1), _flat(dy, "upstream gradient", count - 1)
        if x.shape[0] != dy.shape[0]:
            raise ValueError(f"weight gradient: microbatch {count - 1} has {x.shape[0]} input tokens and"
                             f" {dy.shape[0]} gradient tokens")
        wgrad = dy.to(torch.float64).t() @ x.to(torch.float64)
        if rounding is not None:
            wgrad = rounding(wgrad).to(torch.float64)
        if total is None:
            total = torch.zeros_like(wgrad)
        if total.shape != wgrad.shape:
            raise ValueError(f"weight gradient: microbatch {count - 1}'s gradient is {tuple(wgrad.shape)}, the buffer"
                             f" {tuple(total.shape)}")
        total += wgrad
        if count in wanted:
            sums[count] = total.clone()
    missing = sorted(wanted - sums.keys())
    if missing:
        raise ValueError(f"weight gradient: asked for the sum after {missing} microbatches, given {count}")
    return sums
