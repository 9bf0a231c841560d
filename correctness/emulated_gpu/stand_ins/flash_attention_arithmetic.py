"""The flash algorithm's arithmetic, forward and backward, that cuDNN's fused attention (TE's
stand-ins, cudnn_sdpa.py) and torch SDPA's flash, memory-efficient and cuDNN backends (sdpa_fused.py)
share. No stand-in is declared here.

Tensors are [..., heads, tokens, dim] (any leading dimensions: a batch, or none for one sequence);
K and V may have fewer heads (`groups`), each serving heads // groups query heads, in order.
- `logits`: S = scale Q K^T, the product accumulated in FP32 from the inputs' values, scaled in FP32.
  The callers mask S (keys a query does not see -inf) or add a bias.
- `attend`: per query row the FP32 max m (a sink logit counts where there is one; a row without a
  finite max uses 0), P~ = exp(S - m), l = sum P~ (+ exp(sink - m)); O = (P~ V) / l with P~ entering
  the product in the inputs' dtype (the tensor-core operand format of the flash algorithm),
  accumulated in FP32, divided in FP32, rounded once; a row that sees no key gives zeros.
- `gradients`: from P (FP32; how it is had is the caller's: cuDNN recomputes it from its saved
  statistics, torch's autograd keeps P~ / l), D = rowsum(dO O) in FP32 from the BF16/FP16 dO and O;
  dV = P^T dO; dP = dO V^T; dS = P (dP - D); dQ = scale dS K; dK = scale dS^T Q; P and dS entering
  their products in the inputs' dtype, every product accumulated in FP32, a K/V group's query heads
  summed in FP32, each gradient rounded once.
The order of FP32 sums is torch's, not the kernels' tiles, and the online softmax's rescaling by
running maxima is done with the row's final max: the last bits can differ from a GPU's. Everything
runs on whole rows at once (no loop over tiles or elements).
"""

from dataclasses import dataclass

import torch


def _per_group(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[..., heads, rows, cols] as [..., groups, heads // groups, rows, cols]."""
    return x.reshape(*x.shape[:-3], groups, x.shape[-3] // groups, *x.shape[-2:])


def _shared(kv: torch.Tensor) -> torch.Tensor:
    """K or V heads [..., groups, tokens, dim] in FP32, as [..., groups, 1, tokens, dim]: each group's
    head broadcast over the query heads it serves."""
    return kv.float().unsqueeze(-3)


def logits(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """FP32 S [..., heads, tokens_q, tokens_kv] = scale Q K^T, accumulated in FP32 from the inputs' values."""
    groups = k.shape[-3]
    scores = torch.matmul(_per_group(q.float(), groups), _shared(k).transpose(-1, -2)) * scale
    return scores.reshape(*q.shape[:-1], k.shape[-2])


@dataclass(frozen=True)
class Attended:
    """What `attend` computes: O, and the softmax's FP32 terms a caller keeps for its backward."""

    out: torch.Tensor  # O [..., heads, tokens_q, dim_v] in the inputs' dtype
    exps: torch.Tensor  # P~ = exp(S - m) [..., heads, tokens_q, tokens_kv], FP32
    total: torch.Tensor  # l [..., heads, tokens_q, 1], FP32, the sink's term included; 0 where a row sees nothing
    row_max: torch.Tensor  # m [..., heads, tokens_q, 1], FP32; 0 where a row's max is not finite

    @property
    def seen(self) -> torch.Tensor:
        """[..., heads, tokens_q, 1]: the row sees a key or has a sink (l > 0)."""
        return self.total > 0


def attend(scores: torch.Tensor, v: torch.Tensor, dtype: torch.dtype, sink: torch.Tensor | None = None) -> Attended:
    """O = softmax(S) V the flash way, from the masked FP32 logits `scores` (overwritten: they hold
    S - m after) and V [..., groups, tokens_kv, dim_v]; `sink`: FP32 [heads] sink logits, else None."""
    row_max = scores.amax(dim=-1, keepdim=True)
    if sink is not None:
        sink = sink.float().reshape(-1, 1, 1)
        row_max = torch.maximum(row_max, sink)
    finite_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    exps = torch.exp(scores.sub_(finite_max))
    total = exps.sum(dim=-1, keepdim=True)
    if sink is not None:
        total = total + torch.exp(sink - finite_max)
    weighted = torch.matmul(_per_group(exps.to(dtype).float(), v.shape[-3]), _shared(v))
    seen = total > 0  # false only where a row sees no key and has no sink: its weighted sum is zero
    out = weighted.reshape(*exps.shape[:-1], v.shape[-1]) / torch.where(seen, total, torch.ones_like(total))
    return Attended(out=out.to(dtype), exps=exps, total=total, row_max=finite_max)


def gradients(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, grad_out: torch.Tensor,
              probs: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV in the inputs' dtypes, D = rowsum(dO O) FP32 [..., heads, tokens_q, 1]) from the
    softmax P (FP32 [..., heads, tokens_q, tokens_kv])."""
    groups = k.shape[-3]
    dout = grad_out.float()
    delta = (dout * out.float()).sum(dim=-1, keepdim=True)
    dout_grouped = _per_group(dout, groups)
    dv = torch.matmul(_per_group(probs.to(q.dtype).float(), groups).transpose(-1, -2), dout_grouped).sum(dim=-3)
    dprobs = torch.matmul(dout_grouped, _shared(v).transpose(-1, -2)).reshape(probs.shape)
    dscores = _per_group((probs * dprobs.sub_(delta)).to(q.dtype).float(), groups)
    dq = (torch.matmul(dscores, _shared(k)) * scale).reshape(q.shape)
    dk = torch.matmul(dscores.transpose(-1, -2), _per_group(q.float(), groups)).sum(dim=-3) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), delta
