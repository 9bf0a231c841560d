"""The arithmetic of cuDNN's fused (flash) attention, forward and backward, for one sequence at a
time: what TE's F16_arbitrary_seqlen stand-ins (te_attention.py) compute on the emulated GPU.

Forward, from BF16/FP16 Q, K, V of one sequence ([heads, tokens, head dim]; grouped K/V heads serve
heads // groups query heads each, in order):
- S = attn_scale * Q K^T, the product accumulated in FP32 and scaled in FP32; keys the mask hides
  are -inf (`visibility`);
- per query row, FP32 max m (the sink logit counts where there is one), P = exp(S - m),
  l = sum P (+ exp(sink - m));
- O = (P V) / l, P entering the product in the input dtype (the tensor-core operand format of the
  flash algorithm cuDNN implements), accumulated in FP32, divided in FP32, rounded once to the
  input dtype; a row that sees no key gives zeros;
- the softmax statistics cuDNN saves for the backward (its `Stats`): m + log l, FP32 (-inf for a
  row that sees no key).
Backward, from the saved statistics as cuDNN uses them (P is recomputed from them, not from a
softmax of its own): P = exp(S - Stats); D = rowsum(dO * O) in FP32 from the BF16 dO and O;
dV = P^T dO; dP = dO V^T; dS = P * (dP - D); dQ = attn_scale * dS K; dK = attn_scale * dS^T Q; with
P and dS entering their products in the input dtype, every product accumulated in FP32, the grouped
heads' dK and dV summed in FP32, each gradient rounded once. With sinks, d(sink) = -sum over queries
of exp(sink - Stats) * D, FP32.

The flash arithmetic that torch SDPA's fused backends share (logits, softmax and O, the gradients
from P) is flash_attention_arithmetic.py; cuDNN's own is here: which keys a query sees, the saved
Stats, P recomputed from them, the sinks. The order of FP32 sums is torch's, not the kernel's tiles,
and the online softmax's rescaling by running maxima is done with the row's final max: the last
bits can differ from a GPU's. Everything runs on whole rows of the sequence at once (no loop over
tiles or elements).
"""

from dataclasses import dataclass

import torch

from correctness.emulated_gpu.stand_ins import flash_attention_arithmetic


@dataclass(frozen=True, kw_only=True)
class Masking:
    """Which keys a query sees, as cuDNN's SDPA graph is told (fused_attn_f16_arbitrary_seqlen.cu
    67-78, 274-283): a causal mask aligned top-left or bottom-right, and a diagonal band of
    (left, right) keys (-1: unbounded) aligned to the top-left or bottom-right corner."""

    causal: bool = False
    causal_bottom_right: bool = False
    window: tuple[int, int] = (-1, -1)
    diagonal_bottom_right: bool = False


def visibility(masking: Masking, tokens_q: int, tokens_kv: int, device: torch.device) -> torch.Tensor:
    """[tokens_q, tokens_kv] booleans: key j is visible to query i. Bottom-right alignment shifts the
    diagonal by tokens_kv - tokens_q; the band keeps i' - left <= j <= i' + right (inclusive, TE's
    convention: cuDNN's left bound is left + 1 keys exclusive), i' the aligned query position."""
    query = torch.arange(tokens_q, device=device).unsqueeze(1)
    key = torch.arange(tokens_kv, device=device).unsqueeze(0)
    shift = tokens_kv - tokens_q
    seen = torch.ones(tokens_q, tokens_kv, dtype=torch.bool, device=device)
    if masking.causal:
        seen &= key <= query
    if masking.causal_bottom_right:
        seen &= key <= query + shift
    diagonal = query + (shift if masking.diagonal_bottom_right else 0)
    left, right = masking.window
    if left != -1:
        seen &= key >= diagonal - left
    if right != -1:
        seen &= key <= diagonal + right
    return seen


def _logits(q: torch.Tensor, k: torch.Tensor, scale: float, seen: torch.Tensor) -> torch.Tensor:
    return flash_attention_arithmetic.logits(q, k, scale).masked_fill_(~seen, float("-inf"))


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seen: torch.Tensor, scale: float,
            sink: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(O [heads, tokens_q, dim_v] in q's dtype, Stats [heads, tokens_q] FP32) of one sequence;
    `sink`: FP32 [heads] sink logits (softmax_type off-by-one or learnable), else None."""
    attended = flash_attention_arithmetic.attend(_logits(q, k, scale, seen), v, q.dtype, sink)
    stats = torch.where(attended.seen, attended.row_max + torch.log(attended.total),
                        torch.full_like(attended.total, float("-inf")))
    return attended.out, stats.squeeze(-1)


def backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, grad_out: torch.Tensor,
             stats: torch.Tensor, seen: torch.Tensor, scale: float, sink: torch.Tensor | None = None,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(dQ, dK, dV in the inputs' dtype, d(sink) FP32 [heads] or None) of one sequence, from the
    forward's Stats [heads, tokens_q]."""
    # A row that saw no key has Stats -inf: its P is zero, as its logits are all -inf.
    saved = torch.where(torch.isfinite(stats), stats, torch.full_like(stats, float("inf")))
    probs = torch.exp(_logits(q, k, scale, seen) - saved.unsqueeze(-1))
    dq, dk, dv, delta = flash_attention_arithmetic.gradients(q, k, v, out, grad_out, probs, scale)
    dsink = None
    if sink is not None:
        dsink = -(torch.exp(sink.float().unsqueeze(-1) - saved) * delta.squeeze(-1)).sum(dim=-1)
    return dq, dk, dv, dsink
