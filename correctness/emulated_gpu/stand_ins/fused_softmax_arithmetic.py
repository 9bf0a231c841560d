"""The arithmetic of the fused scaled (masked) softmax kernels, TE's (te_softmax.py) and Apex's for
megatron-core (megatron_softmax.py) alike: the two families launch the same computation, each with
its own checks, and both stand-in modules compute it here. No stand-in is declared here.

- Forward: each BF16/FP16 score read into FP32 and multiplied by the scale, which the launchers hand
  the kernel in the scores' dtype (so rounded to it); masked scores -10000 (`MASKED_SCORE`), keys a
  causal kernel hides -inf; FP32 row max, exp(x - max), FP32 row sum, exp / sum rounded once to the
  scores' dtype; where asked, a row whose max is -10000 (every key masked) gives zeros.
- Backward: from the BF16/FP16 softmax output y and incoming gradient dy, g = dy y in FP32 and
  dx = scale (g - y sum(g)) with the FP32 scale, rounded once to the dtype; in place into dy or into
  a new tensor, as the launcher does.
Row sums are FP32 sums in torch's order, not the kernels' warp-shuffle trees: the last bit can
differ from a GPU's. Vectorised over whole rows; no loop over elements.
"""

import torch

MASKED_SCORE = -10000.0  # what the masked kernels write for a masked score
LOW_PRECISION = (torch.float16, torch.bfloat16)


def scaled_scores(scores: torch.Tensor, scale: float) -> torch.Tensor:
    """The BF16/FP16 scores in FP32 times the scale rounded to their dtype (a new tensor, the caller's own)."""
    return scores.to(torch.float32, copy=True).mul_(float(torch.tensor(float(scale), dtype=scores.dtype)))


def masked_scores(scores: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """`scaled_scores`, with MASKED_SCORE where the mask holds 1 (the kernels read it as bytes)."""
    return scaled_scores(scores, scale).masked_fill_(mask.to(torch.uint8) == 1, MASKED_SCORE)


def causal_scores(scores: torch.Tensor, scale: float) -> torch.Tensor:
    """`scaled_scores` of [batches, queries, keys], keys after their query -inf."""
    above = torch.ones(scores.shape[-2], scores.shape[-1], dtype=torch.bool, device=scores.device).triu(diagonal=1)
    return scaled_scores(scores, scale).masked_fill_(above, float("-inf"))


def softmax(scaled: torch.Tensor, dtype: torch.dtype, *, zero_fully_masked_rows: bool) -> torch.Tensor:
    """exp(x - max) / sum in FP32, rounded once to `dtype`; with zero_fully_masked_rows, rows whose
    max is MASKED_SCORE give zeros. `scaled` (FP32, the caller's own) is overwritten: the scores are
    the largest tensors here."""
    row_max = scaled.amax(dim=-1, keepdim=True)
    exps = scaled.sub_(row_max).exp_()
    exps.div_(exps.sum(dim=-1, keepdim=True))
    if zero_fully_masked_rows:
        fully_masked = row_max == MASKED_SCORE
        if bool(fully_masked.any()):
            exps.masked_fill_(fully_masked, 0.0)
    return exps.to(dtype)


def softmax_gradient(grads: torch.Tensor, probs: torch.Tensor, scale: float, *, in_place: bool) -> torch.Tensor:
    """scale (dy y - y sum(dy y)) in FP32 from the BF16/FP16 dy (`grads`) and y (`probs`), rounded
    once to dy's dtype: written into dy (made contiguous first, as the launchers do) where in_place,
    else into a new tensor."""
    grads = grads.contiguous()
    y = probs.to(torch.float32, copy=True)
    g = grads.to(torch.float32, copy=True).mul_(y)
    g.sub_(y.mul_(g.sum(dim=-1, keepdim=True))).mul_(float(scale))
    return grads.copy_(g) if in_place else g.to(grads.dtype)
