"""The computation torch's fused SDPA backends (flash, memory-efficient, cuDNN) share on the
emulated GPU (correctness.emulated_gpu.stand_ins.sdpa): `FusedAttention`, the flash algorithm's
arithmetic (flash_attention_arithmetic.py) with an autograd backward, and the mask as those kernels
take it (`bias`)."""

import warnings

import torch
from torch.nn.attention import SDPBackend

from correctness.emulated_gpu.runtime import NotEmulated
from correctness.emulated_gpu.stand_ins import flash_attention_arithmetic

# The deterministic-algorithms warning each fused backward gives when torch only warns (attention_backward.cu)
NONDETERMINISTIC = {SDPBackend.FLASH_ATTENTION: "Flash Attention", SDPBackend.EFFICIENT_ATTENTION: "Memory Efficient attention",
                    SDPBackend.CUDNN_ATTENTION: "cuDNN Attention"}


def _scores(q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor | None, is_causal: bool, scale: float) -> torch.Tensor:
    """FP32 logits [batch, heads, queries, keys] (flash_attention_arithmetic.logits), the mask's bias
    added, keys after a query's own position (top-left causal) -inf."""
    scores = flash_attention_arithmetic.logits(q, k, scale)
    if bias is not None:
        scores = scores + bias
    if is_causal:
        above = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).triu(diagonal=1)
        scores = scores.masked_fill(above, float("-inf"))
    return scores


class FusedAttention(torch.autograd.Function):
    """The arithmetic that torch's flash (FlashAttention-2), memory-efficient (CUTLASS) and cuDNN
    kernels document alike, forward and backward, on whole rows (no tiles), that of
    flash_attention_arithmetic (shared with TE's cuDNN attention):
    - forward: FP32 logits (`_scores`); per query row the FP32 max m, P~ = exp(S - m) and l = sum P~;
      O = (P~ V) / l with P~ entering the product in the inputs' dtype (the flash algorithm's
      tensor-core operand), accumulated and divided in FP32, rounded once; a row that sees no key
      gives zeros;
    - backward: P = P~ / l in FP32, kept by autograd (the kernels recompute it from the log-sum-exp
      they save: the same to FP32 rounding); D = rowsum(dO * O) in FP32 from the BF16 dO and O;
      dV = P^T dO, dP = dO V^T, dS = P (dP - D), dQ = scale dS K, dK = scale dS^T Q, P and dS
      entering their products in the inputs' dtype, every product accumulated in FP32, a K/V
      group's query heads summed in FP32, each gradient rounded once.
    FP32 sums are in torch's order, not the kernels' tiles (the last bits can differ from a GPU's,
    where flash and efficient also round each query head's dK and dV before summing a group); the
    same inputs give the same bits on every run, deterministic algorithms or not."""

    @staticmethod
    def forward(ctx, backend, q, k, v, bias, is_causal, scale):
        attended = flash_attention_arithmetic.attend(_scores(q, k, bias, is_causal, scale), v, q.dtype)
        probs = attended.exps.div_(torch.where(attended.seen, attended.total, torch.ones_like(attended.total)))
        ctx.save_for_backward(q, k, v, attended.out, probs)
        ctx.backend, ctx.scale = backend, scale
        return attended.out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, probs = ctx.saved_tensors
        _warn_if_nondeterministic(ctx.backend)
        dq, dk, dv, _ = flash_attention_arithmetic.gradients(q, k, v, out, grad_out, probs, ctx.scale)
        return None, dq, dk, dv, None, None, None


_WARNED: set[SDPBackend] = set()


def _warn_if_nondeterministic(backend: SDPBackend) -> None:
    """The warning each fused backward gives once where deterministic algorithms only warn
    (attention_backward.cu); under them, not warn-only, torch's kernels run deterministically, as
    this computation always does."""
    if torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled() \
            and backend not in _WARNED:
        _WARNED.add(backend)
        warnings.warn(f"{NONDETERMINISTIC[backend]} defaults to a non-deterministic algorithm. To explicitly enable"
                      " determinism call torch.use_deterministic_algorithms(True, warn_only=False).", UserWarning)


def mask_bias(attn_mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The mask as the fused kernels take it: a boolean mask as 0 where a key is seen and -inf where
    not (torch converts it so), a float mask as a bias in the inputs' dtype, both read into FP32."""
    if attn_mask is None:
        return None
    if attn_mask.requires_grad and torch.is_grad_enabled():
        raise NotEmulated("torch SDPA's fused backends with a mask that needs a gradient are not emulated")
    if attn_mask.dtype == torch.bool:
        return torch.zeros_like(attn_mask, dtype=torch.float32).masked_fill(~attn_mask, float("-inf"))
    return attn_mask.to(dtype).float()
