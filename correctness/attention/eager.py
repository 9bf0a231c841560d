"""An eager path with Transformer Engine's unfused numerics, on any device.

As TE's UnfusedDotProductAttention: K and V repeated per query head (repeat_interleave), logits
from baddbmm with the softmax scale folded in and stored in the input dtype, masked positions set
to -10000 in FP32, softmax accumulated in FP32, probabilities rounded back to the input dtype, then
multiplied by V in the input dtype. Gradients by autograd through the same graph.

Its two GEMMs (and their gradients) are what cuBLAS does for BF16 on the GPU: the product of the
BF16 values accumulated in FP32, scaled, rounded once to BF16. On a GPU torch's own bmm does that.
On the CPU the path computes exactly that, an FP32 product of the BF16 values rounded to BF16
(`LowPrecisionGemm`): a CPU without BF16 hardware emulates torch's BF16 bmm some 20x slower, and
its result would depend on the host's BF16 support. The errors against FP64 are the same to three
significant figures (README: the attention lever's CPU tier).

Features TE's unfused path has or that the models' own eager code adds, in the same numerics:
- a logit softcap c (Gemma 2) as transformers' Gemma 2 eager attention applies it: c tanh(logits / c)
  on the scaled logits in their dtype, before the mask (TE has none);
- sinks as TE's unfused path with softmax_type "learnable" (and transformers' GPT-OSS): the sink
  logit in the logits' dtype concatenated to the logits as one more column, masked with them, the
  FP32 softmax over both, the sink's column dropped. dsink is the gradient of the sink logits upcast
  to FP32 (TE keeps `softmax_offset` in FP32); in the sink's column it passes through the
  logits' dtype, as in TE;
- V of its own head dim (MLA) needs nothing: the second GEMM takes it as it is.

Memory: the score-sized arrays (the logits, their FP32 masked copy and probabilities, the rounded
probabilities, and in the backward the gradient of each) take SCORE_BYTES per score. Where every
(row, head) pair's scores would pass SCORE_CHUNK_BYTES (the recipe scale: Gemma 4's 16 heads of
8,192 x 8,192 scores take 26 GB) the path runs as many pairs at a time as fit, at least one, each
chunk's forward and backward before the next, and sends the chunks' gradients of q, k, v (and the
sinks' column) through the same K/V repetition and layout changes as one run would: every GEMM,
softmax and sum sees the same values, so the outputs are bitwise those of one run
(tests/test_attention_paths.py holds it).
"""

from dataclasses import dataclass

import torch

from correctness.attention.inputs import AttentionInputs
from correctness.attention.masks import from_heads_first, to_heads_first, visible_keys
from correctness.lever import ImplementationOutput

MASKED_LOGIT = -10000.0  # TE's attention_mask_func fill value
# Peak bytes per score of the score-sized arrays (see Memory above); measured on the CPU with the
# token-sized tensors (correctness.attention.backend_lever.attention_memory).
SCORE_BYTES = 24
SCORE_CHUNK_BYTES = 2 * 2**30


def pairs_per_chunk(pairs: int, queries: int, keys: int) -> int:
    """How many (row, head) pairs of `queries` x `keys` scores the path runs at a time."""
    return max(1, min(pairs, SCORE_CHUNK_BYTES // (SCORE_BYTES * queries * keys)))


class LowPrecisionGemm(torch.autograd.Function):
    """alpha * (a @ b), batched, as torch's baddbmm computes it in a low-precision dtype on a GPU:
    forward, one GEMM with FP32 accumulation, alpha applied in FP32, rounded once to the inputs'
    dtype; backward, as autograd's baddbmm formula, each gradient a GEMM rounded to the dtype and
    then, where alpha is not 1, multiplied by alpha in that dtype."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, alpha: float) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        ctx.alpha = alpha
        return (torch.bmm(a.float(), b.float()) * alpha).to(a.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, b = ctx.saved_tensors
        grad = grad.float()
        grad_a = torch.bmm(grad, b.float().transpose(1, 2)).to(a.dtype)
        grad_b = torch.bmm(a.float().transpose(1, 2), grad).to(b.dtype)
        if ctx.alpha != 1.0:
            grad_a, grad_b = grad_a * ctx.alpha, grad_b * ctx.alpha
        return grad_a, grad_b, None


def gemm(a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """alpha * (a @ b) in the inputs' dtype with FP32 accumulation: torch's own on a GPU, the FP32
    product rounded on the CPU."""
    if a.device.type == "cpu":
        return LowPrecisionGemm.apply(a, b, alpha)
    return torch.baddbmm(torch.empty(a.shape[0], a.shape[1], b.shape[2], dtype=a.dtype, device=a.device), a, b,
                         beta=0.0, alpha=alpha)


@dataclass(frozen=True)
class EagerUnfused:
    name: str = "eager-unfused"

    def visible(self, shape, device: torch.device) -> torch.Tensor:
        """The keys each query may attend (a deliberately wrong variant overrides it)."""
        return visible_keys(shape, device)

    def _attend(self, shape, q3, k3, v3, column, hidden) -> torch.Tensor:
        """The output [pairs, n, dv] of (row, head) pairs; `column`: the sinks' logits, or None."""
        logits = gemm(q3, k3.transpose(1, 2), alpha=shape.softmax_scale)
        if shape.softcap is not None:
            logits = torch.tanh(logits / shape.softcap) * shape.softcap
        masked = logits.float().masked_fill(hidden, MASKED_LOGIT)
        if column is not None:
            masked = torch.cat((masked, column.float()), dim=-1)
        probabilities = torch.softmax(masked, dim=-1)
        if column is not None:
            probabilities = probabilities[..., :-1]
        return gemm(probabilities.to(q3.dtype), v3)

    def run(self, inputs: AttentionInputs) -> ImplementationOutput:
        shape = inputs.shape
        q, k, v = (x.detach().requires_grad_() for x in (inputs.q, inputs.k, inputs.v))
        qh = to_heads_first(shape, q)
        kh = to_heads_first(shape, k).repeat_interleave(shape.gqa_ratio, dim=1)
        vh = to_heads_first(shape, v).repeat_interleave(shape.gqa_ratio, dim=1)
        batch, heads, n, dim = qh.shape
        q3, k3 = (x.reshape(batch * heads, n, dim) for x in (qh, kh))
        v3 = vh.reshape(batch * heads, n, vh.shape[-1])
        sinks = column = None
        if inputs.sinks is not None:
            sinks = inputs.sinks.detach().float().requires_grad_()
            column = sinks.to(q.dtype).reshape(1, heads, 1, 1).expand(batch, heads, n, 1).reshape(batch * heads, n, 1)
        parts = (q3, k3, v3) if column is None else (q3, k3, v3, column)
        grad_out3 = to_heads_first(shape, inputs.grad_out).reshape(batch * heads, n, vh.shape[-1])
        hidden = ~self.visible(shape, q.device)
        out3 = torch.empty_like(grad_out3)
        grads = [torch.empty_like(part) for part in parts]
        step = pairs_per_chunk(batch * heads, n, n + (column is not None))
        for start in range(0, batch * heads, step):
            chunk = [part[start:start + step].detach().requires_grad_() for part in parts]
            out_chunk = self._attend(shape, *chunk[:3], chunk[3] if column is not None else None, hidden)
            out_chunk.backward(grad_out3[start:start + step])
            out3[start:start + step] = out_chunk.detach()
            for grad, leaf in zip(grads, chunk):
                grad[start:start + step] = leaf.grad
        torch.autograd.backward(parts, grads)
        out = from_heads_first(shape, out3.reshape(batch, heads, n, vh.shape[-1]))
        tensors = {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad}
        if sinks is not None:
            tensors["dsink"] = sinks.grad
        return ImplementationOutput(
            tensors=tensors,
            backend="eager-unfused",
            details={
                "logits_dtype": str(q.dtype).removeprefix("torch."),
                "softmax": "float32",
                "gemm": "fp32 product rounded" if q.device.type == "cpu" else "torch bmm",
                **({"softcap": f"{shape.softcap:g} tanh(logits / {shape.softcap:g}) in the logits' dtype"}
                   if shape.softcap is not None else {}),
                **({"sinks": "one more logit column, dropped after the softmax"} if sinks is not None else {}),
            },
        )
