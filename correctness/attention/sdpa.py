"""torch.nn.functional.scaled_dot_product_attention with one backend forced.

Only the forced backend is enabled, so a call either runs it or fails. Only torch's refusal (CUDA:
"No available kernel", CPU: "No viable backend", with the reasons as warnings) makes the path
unavailable for the case (PathUnavailable); out-of-memory and any other kernel error fail it. On the CPU "flash" is torch's
flash-attention CPU kernel. Windows and THD rows are given as a boolean mask; plain causal BSHD
uses is_causal. GQA is native (enable_gqa) where the backend takes it, else K and V are repeated.
"""

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from correctness.attention.inputs import AttentionInputs
from correctness.attention.masks import from_heads_first, to_heads_first, visible_keys
from correctness.errors import PathUnavailable
from correctness.lever import PathOutput

# torch's messages when no enabled backend takes the inputs (aten sdp_utils: CUDA, then CPU)
REFUSALS = ("No available kernel", "No viable backend for scaled_dot_product_attention")


def refusal(error: BaseException) -> bool:
    """Whether an exception of SDPA is its refusal of every enabled backend for these inputs."""
    return (
        isinstance(error, RuntimeError)
        and not isinstance(error, torch.OutOfMemoryError)
        and str(error).startswith(REFUSALS)
    )


BACKENDS = {
    "math": SDPBackend.MATH,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}


def uses_is_causal(shape) -> bool:
    """Plain causal BSHD needs no mask, which lets backends that take no mask run."""
    return shape.causal and shape.window is None and shape.qkv_format == "bshd"


@dataclass(frozen=True)
class Sdpa:
    backend: str

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"sdpa path: unknown backend {self.backend!r} (known: {sorted(BACKENDS)})")

    @property
    def name(self) -> str:
        return f"sdpa-{self.backend}"

    def _attend(self, inputs: AttentionInputs, q, k, v, gqa_native: bool) -> torch.Tensor:
        shape = inputs.shape
        plain_causal = uses_is_causal(shape)
        mask = None if plain_causal else visible_keys(shape, q.device)
        qh, kh, vh = (to_heads_first(shape, x) for x in (q, k, v))
        if not gqa_native and shape.gqa_ratio > 1:
            kh = kh.repeat_interleave(shape.gqa_ratio, dim=1)
            vh = vh.repeat_interleave(shape.gqa_ratio, dim=1)
        with sdpa_kernel([BACKENDS[self.backend]]):
            out = F.scaled_dot_product_attention(
                qh,
                kh,
                vh,
                attn_mask=mask,
                is_causal=plain_causal,
                scale=shape.softmax_scale,
                enable_gqa=gqa_native and shape.gqa_ratio > 1,
            )
        return from_heads_first(shape, out)

    def run(self, inputs: AttentionInputs) -> PathOutput:
        refusals = []
        for gqa_native in (True, False):
            q, k, v = (x.detach().requires_grad_() for x in (inputs.q, inputs.k, inputs.v))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    out = self._attend(inputs, q, k, v, gqa_native)
                except RuntimeError as error:
                    if not refusal(error):
                        raise
                    reasons = "; ".join(str(w.message) for w in caught) or str(error)
                    refusals.append(f"{'enable_gqa' if gqa_native else 'repeated K/V'}: {reasons}")
                    continue
            out.backward(inputs.grad_out)
            device = q.device.type
            return PathOutput(
                tensors={"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad},
                backend=f"{self.name} ({device} kernel)",
                details={
                    "sdpa_backend": BACKENDS[self.backend].name,
                    "device": device,
                    "gqa": "enable_gqa" if gqa_native else "repeat_interleave",
                    "mask": "is_causal" if uses_is_causal(inputs.shape) else "boolean",
                },
            )
        raise PathUnavailable(f"torch SDPA {self.backend} refuses {inputs.shape.id}: {' | '.join(refusals)}")
