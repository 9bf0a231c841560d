"""torch.nn.functional.scaled_dot_product_attention with one backend forced.

Only the forced backend is enabled, so a call either runs it or fails. Only torch's refusal (CUDA:
"No available kernel", CPU: "No viable backend", with the reasons as warnings) makes the path
unavailable for the case (ImplementationUnavailable); out-of-memory and any other kernel error
fail it. On the CPU "flash" is torch's flash-attention CPU kernel. Windows and THD rows are given as a boolean mask; plain causal BSHD
uses is_causal. GQA is native (enable_gqa) where the backend takes it, else K and V are repeated.

Features SDPA has no argument for:
- a logit softcap: SDPA cannot apply one, so the path refuses a softcap case (ImplementationUnavailable);
- V of another head dim than q and k (MLA): tried as it is; where the backend refuses it (the flash
  kernels want one head dim), q, k and v are zero-padded to the larger head dim and the output
  sliced back (`equal_head_dims`): zero columns of q and k add nothing to a logit, V's only add output
  columns that are dropped, so the attention computed is the same;
- sinks, on the flash CPU kernel only: one extra key after the sequence, visible to every query,
  whose key and value vectors are zero and whose logit is the head's sink logit, given in a float
  mask (0 where visible, -inf where not; [1, heads, tokens, tokens + 1] in the inputs' dtype, which
  holds the sinks exactly). SDPA gives no gradient for a mask, so dsink = -sum over queries of
  p_sink * D, in FP32, with p_sink = exp(sink - LSE) from the kernel's own FP32 log-sum-exp and
  D = dO . O from its output: what a flash kernel's backward computes for a sink. The kernel is
  called as aten._scaled_dot_product_flash_attention_for_cpu, the op SDPA runs for that backend,
  which also returns the LSE. Elsewhere the path refuses sinks: a probability read back through an
  output column would be rounded to BF16, which makes dsink's error about twice the default's.
"""

import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from correctness.attention.inputs import AttentionInputs
from correctness.attention.masks import from_heads_first, to_heads_first, visible_keys
from correctness.errors import ImplementationUnavailable
from correctness.lever import ImplementationOutput

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

    def _attend(self, inputs: AttentionInputs, q, k, v, gqa_native: bool, equal_head_dims: bool):
        """The output in the inputs' layout, and with sinks the kernel's LSE [batch, heads, tokens]."""
        shape = inputs.shape
        qh, kh, vh = (to_heads_first(shape, x) for x in (q, k, v))
        value_dim = vh.shape[-1]
        if equal_head_dims:
            width = max(qh.shape[-1], value_dim)
            qh, kh, vh = (F.pad(x, (0, width - x.shape[-1])) if x.shape[-1] < width else x for x in (qh, kh, vh))
        if not gqa_native and shape.gqa_ratio > 1:
            kh = kh.repeat_interleave(shape.gqa_ratio, dim=1)
            vh = vh.repeat_interleave(shape.gqa_ratio, dim=1)
        lse = None
        if inputs.sinks is None:
            plain_causal = uses_is_causal(shape)
            with sdpa_kernel([BACKENDS[self.backend]]):
                out = F.scaled_dot_product_attention(
                    qh,
                    kh,
                    vh,
                    attn_mask=None if plain_causal else visible_keys(shape, q.device),
                    is_causal=plain_causal,
                    scale=shape.softmax_scale,
                    enable_gqa=gqa_native and shape.gqa_ratio > 1,
                )
        else:
            visible = visible_keys(shape, q.device)
            tokens = visible.shape[0]
            mask = torch.zeros(1, shape.heads, tokens, tokens + 1, dtype=q.dtype, device=q.device)
            mask[..., :tokens].masked_fill_(~visible, -math.inf)
            mask[..., tokens] = inputs.sinks.to(q.dtype)[:, None]
            kh, vh = (torch.cat((x, x.new_zeros(*x.shape[:2], 1, x.shape[-1])), dim=2) for x in (kh, vh))
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                qh, kh, vh, attn_mask=mask, scale=shape.softmax_scale
            )
        if out.shape[-1] > value_dim:
            out = out[..., :value_dim]
        return from_heads_first(shape, out), lse

    def run(self, inputs: AttentionInputs) -> ImplementationOutput:
        shape = inputs.shape
        device = inputs.q.device.type
        if shape.softcap is not None:
            raise ImplementationUnavailable(
                f"torch SDPA {self.backend} cannot apply a logit softcap ({shape.id}: softcap {shape.softcap:g});"
                " scaled_dot_product_attention has no softcap argument"
            )
        sinks = inputs.sinks is not None
        if sinks and (self.backend, device) != ("flash", "cpu"):
            raise ImplementationUnavailable(
                f"torch SDPA {self.backend} on {device} refuses {shape.id}: SDPA has no sinks, and this path"
                " emulates them (with dsink from the kernel's log-sum-exp) only on the flash CPU kernel"
            )
        # Tried in order until one runs: native GQA, repeated K/V; then the same with equal head dims
        # where V has another head dim than q and k. The flash CPU kernel called directly (sinks)
        # refuses nothing: it gets equal head dims at once.
        other_dims = shape.v_head_dim != shape.head_dim
        attempts = [(True, False), (False, False)] + ([(True, True), (False, True)] if other_dims else [])
        if sinks:
            attempts = [(True, other_dims)]
        refusals = []
        for gqa_native, equal_head_dims in attempts:
            q, k, v = (x.detach().requires_grad_() for x in (inputs.q, inputs.k, inputs.v))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    out, lse = self._attend(inputs, q, k, v, gqa_native, equal_head_dims)
                except RuntimeError as error:
                    if not refusal(error):
                        raise
                    reasons = "; ".join(str(w.message) for w in caught) or str(error)
                    how = "enable_gqa" if gqa_native else "repeated K/V"
                    refusals.append(f"{how}{', equal head dims' if equal_head_dims else ''}: {reasons}")
                    continue
            out.backward(inputs.grad_out)
            tensors = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
            details = {
                "sdpa_backend": BACKENDS[self.backend].name,
                "device": device,
                "gqa": "enable_gqa" if gqa_native else "repeat_interleave",
                "mask": "float, with the sinks' column" if sinks else (
                    "is_causal" if uses_is_causal(shape) else "boolean"),
            }
            if equal_head_dims:
                details["equal_head_dims"] = (
                    f"q, k ({shape.head_dim}) and v ({shape.v_head_dim}) zero-padded to one head dim,"
                    " the output sliced back"
                )
            if sinks:
                sink_probability = from_heads_first(shape, (inputs.sinks.float()[:, None] - lse).exp().unsqueeze(-1))
                tensors["dsink"] = sink_gradient(shape, sink_probability.squeeze(-1), tensors["out"], inputs.grad_out)
                details["sinks"] = ("a zero key with the sink logit in a float mask; dsink from exp(sink - LSE)"
                                    " and dO . O in FP32")
            return ImplementationOutput(tensors=tensors, backend=f"{self.name} ({device} kernel)", details=details)
        raise ImplementationUnavailable(f"torch SDPA {self.backend} refuses {shape.id}: {' | '.join(refusals)}")


def sink_gradient(shape, sink_probability: torch.Tensor, out: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """dsink_h = -sum over the queries of head h of p_sink * (dO . O), in FP32: [heads]."""
    delta = (grad_out.float() * out.float()).sum(dim=-1)  # [..., tokens, heads]
    products = sink_probability.float() * delta
    return -products.reshape(-1, shape.heads).sum(dim=0)
