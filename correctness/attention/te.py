"""Transformer Engine's DotProductAttention, on its auto choice or forced to one backend.

TE is optional: it is imported only when this path runs, and a missing or unusable TE makes the
path unavailable (the case skips with TE's own reason). Backends are forced with TE's switches
NVTE_FLASH_ATTN, NVTE_FUSED_ATTN and NVTE_UNFUSED_ATTN, set only around the call and restored
after it; TE caches its choice in `_attention_backends`, so the cache is told to re-select before
and after. Which backend actually ran is read back from that cache. Needs TE 2.3 or newer.
"""

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from correctness.attention.inputs import AttentionInputs
from correctness.errors import PathUnavailable
from correctness.lever import PathOutput

SWITCHES = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")
FORCED = {
    "auto": {"NVTE_FLASH_ATTN": "1", "NVTE_FUSED_ATTN": "1", "NVTE_UNFUSED_ATTN": "1"},
    "flash": {"NVTE_FLASH_ATTN": "1", "NVTE_FUSED_ATTN": "0", "NVTE_UNFUSED_ATTN": "0"},
    "fused": {"NVTE_FLASH_ATTN": "0", "NVTE_FUSED_ATTN": "1", "NVTE_UNFUSED_ATTN": "0"},
    "unfused": {"NVTE_FLASH_ATTN": "0", "NVTE_FUSED_ATTN": "0", "NVTE_UNFUSED_ATTN": "1"},
}
FUSED_SUB_BACKENDS = {0: "F16_max512_seqlen", 1: "F16_arbitrary_seqlen", 2: "FP8"}


def import_transformer_engine() -> tuple[Any, Mapping[str, Any]]:
    """(transformer_engine.pytorch, its backend cache), or PathUnavailable with the reason."""
    try:
        import transformer_engine.pytorch as te
        from transformer_engine.pytorch.attention.dot_product_attention import _attention_backends
    except Exception as error:  # TE raises RuntimeError, OSError, AssertionError... when unusable
        raise PathUnavailable(f"Transformer Engine is not usable here: {type(error).__name__}: {error}") from None
    if not torch.cuda.is_available():
        raise PathUnavailable("Transformer Engine needs a CUDA device; none is available")
    return te, _attention_backends


def te_versions() -> dict[str, Any]:
    """TE's version, the cuDNN it loaded and the flash-attn it sees (None where this TE cannot say)."""
    import transformer_engine

    versions: dict[str, Any] = {"transformer_engine": transformer_engine.__version__, "torch": torch.__version__}
    try:
        from transformer_engine.pytorch.utils import get_cudnn_version

        versions["cudnn_runtime"] = ".".join(str(part) for part in get_cudnn_version())
    except (ImportError, AttributeError):
        versions["cudnn_runtime"] = None
    try:
        from transformer_engine.pytorch.attention.dot_product_attention.utils import FlashAttentionUtils

        versions["flash_attn"] = str(FlashAttentionUtils.version)
    except (ImportError, AttributeError):
        versions["flash_attn"] = None
    return versions


@contextlib.contextmanager
def backend_switches(values: Mapping[str, str], cache: dict) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in SWITCHES}
    os.environ.update(values)
    cache["backend_selection_requires_update"] = True
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        cache["backend_selection_requires_update"] = True


def backend_that_ran(cache: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    if cache.get("use_fused_attention"):
        sub = cache.get("fused_attention_backend")
        sub_name = FUSED_SUB_BACKENDS.get(int(sub), str(sub)) if sub is not None else "unknown"
        return "fused", {"fused_attention_backend": sub_name}
    if cache.get("use_flash_attention"):
        return "flash", {"flash_attention_backend": str(cache.get("flash_attention_backend"))}
    if cache.get("use_unfused_attention"):
        return "unfused", {}
    return "none", {}


@dataclass(frozen=True)
class TransformerEngine:
    backend: str  # "auto" or the backend forced: "fused", "flash", "unfused"

    def __post_init__(self):
        if self.backend not in FORCED:
            raise ValueError(f"TE path: unknown backend {self.backend!r} (known: {sorted(FORCED)})")

    @property
    def name(self) -> str:
        return f"te-{self.backend}"

    def run(self, inputs: AttentionInputs) -> PathOutput:
        te, cache = import_transformer_engine()
        shape = inputs.shape
        thd = shape.qkv_format == "thd"
        window = shape.window if shape.window is not None else (-1, 0 if shape.causal else -1)
        mask_type = ("padding_causal" if thd else "causal") if shape.causal else ("padding" if thd else "no_mask")
        module = te.DotProductAttention(
            num_attention_heads=shape.heads,
            kv_channels=shape.head_dim,
            num_gqa_groups=shape.groups,
            attention_dropout=0.0,
            qkv_format=shape.qkv_format,
            attn_mask_type=mask_type,
            window_size=window,
            softmax_scale=shape.softmax_scale,
        ).train()  # TE chooses backends that support backward from the training flag
        packing: dict[str, Any] = {}
        if thd:
            cu_seqlens = torch.tensor(shape.cu_seqlens, dtype=torch.int32, device=inputs.q.device)
            longest = max(b - a for a, b in zip(shape.cu_seqlens, shape.cu_seqlens[1:]))
            packing = {
                "cu_seqlens_q": cu_seqlens,
                "cu_seqlens_kv": cu_seqlens,
                "max_seqlen_q": longest,
                "max_seqlen_kv": longest,
            }
        q, k, v = (x.detach().requires_grad_() for x in (inputs.q, inputs.k, inputs.v))
        with backend_switches(FORCED[self.backend], cache):
            try:
                out = module(q, k, v, qkv_format=shape.qkv_format, attn_mask_type=mask_type, window_size=window, **packing)
            except Exception as error:  # TE asserts or raises when no backend supports the case
                raise PathUnavailable(f"TE {self.backend} refuses {shape.id}: {type(error).__name__}: {error}") from None
            ran, sub = backend_that_ran(cache)
            out = out.reshape(inputs.grad_out.shape)
            out.backward(inputs.grad_out)
        if self.backend != "auto" and ran != self.backend:
            raise PathUnavailable(f"TE was forced to {self.backend} but ran {ran} on {shape.id}")
        return PathOutput(
            tensors={"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad},
            backend=f"te-{ran}" + (f" ({sub['fused_attention_backend']})" if ran == "fused" else ""),
            details={"requested": self.backend, "ran": ran, **sub, "mask_type": mask_type,
                     "window_size": list(window), **te_versions()},
        )
