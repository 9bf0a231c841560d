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
"""

from dataclasses import dataclass

import torch

from correctness.attention.inputs import AttentionInputs
from correctness.attention.masks import from_heads_first, to_heads_first, visible_keys
from correctness.lever import PathOutput

MASKED_LOGIT = -10000.0  # TE's attention_mask_func fill value


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

    def run(self, inputs: AttentionInputs) -> PathOutput:
        shape = inputs.shape
        q, k, v = (x.detach().requires_grad_() for x in (inputs.q, inputs.k, inputs.v))
        qh = to_heads_first(shape, q)
        kh = to_heads_first(shape, k).repeat_interleave(shape.gqa_ratio, dim=1)
        vh = to_heads_first(shape, v).repeat_interleave(shape.gqa_ratio, dim=1)
        batch, heads, n, dim = qh.shape
        q3, k3, v3 = (x.reshape(batch * heads, n, dim) for x in (qh, kh, vh))
        logits = gemm(q3, k3.transpose(1, 2), alpha=shape.softmax_scale)
        masked = logits.float().masked_fill(~self.visible(shape, q.device), MASKED_LOGIT)
        probabilities = torch.softmax(masked, dim=-1).to(q.dtype)
        out = from_heads_first(shape, gemm(probabilities, v3).reshape(batch, heads, n, dim))
        out.backward(inputs.grad_out)
        return PathOutput(
            tensors={"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad},
            backend="eager-unfused",
            details={
                "logits_dtype": str(q.dtype).removeprefix("torch."),
                "softmax": "float32",
                "gemm": "fp32 product rounded" if q.device.type == "cpu" else "torch bmm",
            },
        )
