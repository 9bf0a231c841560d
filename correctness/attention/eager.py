"""An eager path with Transformer Engine's unfused numerics, on any device.

As TE's UnfusedDotProductAttention: K and V repeated per query head (repeat_interleave), logits
from baddbmm with the softmax scale folded in and stored in the input dtype, masked positions set
to -10000 in FP32, softmax accumulated in FP32, probabilities rounded back to the input dtype, then
multiplied by V in the input dtype. Gradients by autograd through the same graph.
"""

from dataclasses import dataclass

import torch

from correctness.attention.inputs import AttentionInputs
from correctness.attention.masks import from_heads_first, to_heads_first, visible_keys
from correctness.lever import PathOutput

MASKED_LOGIT = -10000.0  # TE's attention_mask_func fill value


@dataclass(frozen=True)
class EagerUnfused:
    name: str = "eager-unfused"

    def run(self, inputs: AttentionInputs) -> PathOutput:
        shape = inputs.shape
        q, k, v = (x.detach().requires_grad_() for x in (inputs.q, inputs.k, inputs.v))
        qh = to_heads_first(shape, q)
        kh = to_heads_first(shape, k).repeat_interleave(shape.gqa_ratio, dim=1)
        vh = to_heads_first(shape, v).repeat_interleave(shape.gqa_ratio, dim=1)
        batch, heads, n, dim = qh.shape
        q3, k3, v3 = (x.reshape(batch * heads, n, dim) for x in (qh, kh, vh))
        logits = torch.baddbmm(
            torch.empty(batch * heads, n, n, dtype=q.dtype, device=q.device),
            q3,
            k3.transpose(1, 2),
            beta=0.0,
            alpha=shape.softmax_scale,
        )
        masked = logits.float().masked_fill(~visible_keys(shape, q.device), MASKED_LOGIT)
        probabilities = torch.softmax(masked, dim=-1).to(q.dtype)
        out = from_heads_first(shape, torch.bmm(probabilities, v3).reshape(batch, heads, n, dim))
        out.backward(inputs.grad_out)
        return PathOutput(
            tensors={"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad},
            backend="eager-unfused",
            details={"logits_dtype": str(q.dtype).removeprefix("torch."), "softmax": "float32"},
        )
