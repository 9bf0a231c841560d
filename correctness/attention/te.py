"""Transformer Engine's DotProductAttention, on its auto choice or forced to one backend.

TE is optional: it is imported only when this path runs, and a missing or unusable TE makes the
path unavailable (the case skips with TE's own reason). Backends are forced with TE's switches
NVTE_FLASH_ATTN, NVTE_FUSED_ATTN and NVTE_UNFUSED_ATTN, set only around the call and restored
after it; TE caches its choice in `_attention_backends`, so the cache is told to re-select before
and after. Which backend actually ran is read back from that cache. Needs TE 2.3 or newer.

A refusal is only TE's own "no backend for this configuration" signal (TE 2.17: the ValueError
DotProductAttention raises when backend selection finds none, dot_product_attention.py 1699-1704);
a cuDNN error, out-of-memory, an assertion or a forced backend that did not run fails the case.

Model features, as TE 2.17 has them (read in its source at the v2.17 tag):
- logit softcap (Gemma 2): no TE backend has one. DotProductAttention takes no softcap (only its
  context-parallel code passes flash-attn softcap=0.0), and the experimental cuDNN `score_mod`
  callback, which could express one, "is mutually exclusive with masks, bias, ALiBi, sink attention,
  dropout, FP8, context parallelism, THD format" (forward's docstring), so no causal or windowed
  softcap: the path refuses a softcap case (ImplementationUnavailable), and the case skips.
- sinks (GPT-OSS): softmax_type="learnable" (TE 2.8 and newer), whose parameter `softmax_offset`
  ([heads], FP32) the path fills with the case's sink logits and whose gradient it reads (dsink).
  FusedAttention (cuDNN) and UnfusedDotProductAttention take it, FlashAttention does not (utils.py
  get_attention_backend, "Filter: Softmax type"); FusedAttention takes it in FP8 only on sm100 with
  cuDNN 9.21 or newer, for THD only with cuDNN 9.18 or newer, and not where determinism is asked
  for (NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 or torch.use_deterministic_algorithms). The unfused
  backend rounds the sink to the logits' dtype (backends.py: softmax_offset.to(matmul_result.dtype));
  the sinks here are already in that dtype.
- V of its own head dim (MLA): kv_channels=(head_dim, v_head_dim). FusedAttention takes it with
  separate q, k, v tensors (layout hd_hd_hd, as here); FlashAttention 2 pads the head dims to one
  (_pad_qkv_head_dim), FlashAttention 3 takes (192, 128) (utils.py "Filter: Head dimension").
"""

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from correctness.attention.inputs import AttentionInputs
from correctness.environment import environment_set
from correctness.errors import CorrectnessError, ImplementationUnavailable
from correctness.lever import ImplementationOutput

SWITCHES = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")
FORCED = {
    "auto": {"NVTE_FLASH_ATTN": "1", "NVTE_FUSED_ATTN": "1", "NVTE_UNFUSED_ATTN": "1"},
    "flash": {"NVTE_FLASH_ATTN": "1", "NVTE_FUSED_ATTN": "0", "NVTE_UNFUSED_ATTN": "0"},
    "fused": {"NVTE_FLASH_ATTN": "0", "NVTE_FUSED_ATTN": "1", "NVTE_UNFUSED_ATTN": "0"},
    "unfused": {"NVTE_FLASH_ATTN": "0", "NVTE_FUSED_ATTN": "0", "NVTE_UNFUSED_ATTN": "1"},
}
# NVTE_Fused_Attn_Backend in TE 2.17 (common/include/transformer_engine/fused_attn.h 156-163); 0 was
# F16_max512_seqlen before 2.x dropped it. The enum's own name is used where TE hands one over.
FUSED_SUB_BACKENDS = {-1: "No_Backend", 1: "F16_arbitrary_seqlen", 2: "FP8"}
NO_BACKEND = "No dot product attention backend is available"


def te_backend_name(backend: str) -> str:
    """How this path names a TE backend it ran: "te-fused", "te-unfused", "te-flash"."""
    return f"te-{backend}"


def refusal(error: BaseException) -> bool:
    """Whether an exception of TE's forward is its refusal of the configuration."""
    return isinstance(error, ValueError) and str(error).startswith(NO_BACKEND)


def import_transformer_engine() -> tuple[Any, Mapping[str, Any]]:
    """(transformer_engine.pytorch, its backend cache), or ImplementationUnavailable with the reason."""
    try:
        import transformer_engine.pytorch as te
        from transformer_engine.pytorch.attention.dot_product_attention import _attention_backends
    except Exception as error:  # TE raises RuntimeError, OSError, AssertionError... when unusable
        raise ImplementationUnavailable(
            f"Transformer Engine is not usable here: {type(error).__name__}: {error}") from None
    if not torch.cuda.is_available():
        raise ImplementationUnavailable("Transformer Engine needs a CUDA device; none is available")
    return te, _attention_backends


def _installed_version(utils: Any, installed: str, version: str) -> str | None:
    """A FlashAttention version as TE sees it: None where it is not installed (TE says "0")."""
    value = getattr(utils, version, None)
    if not getattr(utils, installed, False) or value is None or str(value) == "0":
        return None
    return str(value)


def te_versions() -> dict[str, Any]:
    """TE's version, the cuDNN it loaded and the FlashAttention 2, 3 and 4 it sees (None where
    absent or where this TE cannot say)."""
    import transformer_engine

    versions: dict[str, Any] = {"transformer_engine": transformer_engine.__version__, "torch": torch.__version__}
    try:
        from transformer_engine.pytorch.utils import get_cudnn_version

        versions["cudnn_runtime"] = ".".join(str(part) for part in get_cudnn_version())
    except (ImportError, AttributeError):
        versions["cudnn_runtime"] = None
    try:
        from transformer_engine.pytorch.attention.dot_product_attention.utils import FlashAttentionUtils as utils
    except (ImportError, AttributeError):
        utils = None
    versions["flash_attn"] = _installed_version(utils, "is_installed", "version")
    versions["flash_attn_3"] = _installed_version(utils, "v3_is_installed", "fa3_version")
    versions["flash_attn_4"] = _installed_version(utils, "v4_is_installed", "fa4_version")
    return versions


def fused_sub_backend(value: Any) -> str:
    """The name of TE's fused-attention sub-backend from the value its cache holds."""
    if value is None:
        return "unknown"
    name = getattr(value, "name", None)  # TE's NVTE_Fused_Attn_Backend enum
    if isinstance(name, str):
        return name.removeprefix("NVTE_")
    number = int(value)
    return FUSED_SUB_BACKENDS.get(number, str(number))


@contextlib.contextmanager
def backend_switches(values: Mapping[str, str], cache: dict) -> Iterator[None]:
    cache["backend_selection_requires_update"] = True
    try:
        with environment_set({name: values[name] for name in SWITCHES}):
            yield
    finally:
        cache["backend_selection_requires_update"] = True


def backend_that_ran(cache: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    if cache.get("use_fused_attention"):
        return "fused", {"fused_attention_backend": fused_sub_backend(cache.get("fused_attention_backend"))}
    if cache.get("use_flash_attention"):
        return "flash", {"flash_attention_backend": str(cache.get("flash_attention_backend"))}
    if cache.get("use_unfused_attention"):
        return "unfused", {}
    return "none", {}


@dataclass(frozen=True)
class TransformerEngine:
    backend: str  # "auto" or the backend forced: "fused", "flash", "unfused"
    # TE 2.17's own Python on the CPU (correctness.te_on_cpu): the unfused backend runs, the fused
    # ones are refused by backend selection (no compiled kernels there).
    on_cpu: bool = False

    def __post_init__(self):
        if self.backend not in FORCED:
            raise ValueError(f"TE path: unknown backend {self.backend!r} (known: {sorted(FORCED)})")

    @property
    def name(self) -> str:
        return te_backend_name(self.backend)

    def run(self, inputs: AttentionInputs) -> ImplementationOutput:
        if not self.on_cpu:
            return self._run(inputs)
        from correctness.te_on_cpu import provenance, te_on_cpu

        with te_on_cpu():
            output = self._run(inputs)
        return replace(output, details={**output.details, **provenance()})

    def _run(self, inputs: AttentionInputs) -> ImplementationOutput:
        shape = inputs.shape
        if shape.softcap is not None:
            raise ImplementationUnavailable(
                f"TE {self.backend} cannot apply a logit softcap ({shape.id}: softcap {shape.softcap:g}):"
                " Transformer Engine 2.17's DotProductAttention has no softcap on any backend"
            )
        te, cache = import_transformer_engine()
        thd = shape.qkv_format == "thd"
        sinks = inputs.sinks is not None
        window = shape.window if shape.window is not None else (-1, 0 if shape.causal else -1)
        mask_type = ("padding_causal" if thd else "causal") if shape.causal else ("padding" if thd else "no_mask")
        module = te.DotProductAttention(
            num_attention_heads=shape.heads,
            kv_channels=shape.head_dim if shape.v_head_dim == shape.head_dim else (shape.head_dim, shape.v_head_dim),
            num_gqa_groups=shape.groups,
            attention_dropout=0.0,
            qkv_format=shape.qkv_format,
            attn_mask_type=mask_type,
            window_size=window,
            softmax_scale=shape.softmax_scale,
            **({"softmax_type": "learnable"} if sinks else {}),  # TE 2.8 and newer
        ).train()  # TE chooses backends that support backward from the training flag
        if sinks:
            with torch.no_grad():
                module.softmax_offset.copy_(inputs.sinks.float())
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
        # Each its own storage: TE's layout detection (utils.py get_qkv_layout, 2251-2433) refuses a view
        # that starts inside another tensor's storage, as a packed row's slice does (PerRow).
        q, k, v = (x.detach().clone().requires_grad_() for x in (inputs.q, inputs.k, inputs.v))
        with backend_switches(FORCED[self.backend], cache):
            try:
                out = module(q, k, v, qkv_format=shape.qkv_format, attn_mask_type=mask_type, window_size=window, **packing)
            except Exception as error:
                if refusal(error):
                    raise ImplementationUnavailable(f"TE {self.backend} refuses {shape.id}: {error}") from None
                raise
            ran, sub = backend_that_ran(cache)
            if out.numel() != inputs.grad_out.numel():  # TE returns [b, s, h * d] for BSHD
                raise CorrectnessError(
                    f"TE {self.backend} returned an output of shape {list(out.shape)} for {shape.id},"
                    f" expected {list(inputs.grad_out.shape)}"
                )
            out = out.reshape(inputs.grad_out.shape)
            out.backward(inputs.grad_out)
        if self.backend != "auto" and ran != self.backend:
            raise CorrectnessError(f"TE was forced to {self.backend} but ran {ran} on {shape.id}")
        tensors = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
        if sinks:
            if module.softmax_offset.grad is None:
                raise CorrectnessError(f"TE {ran} gave no gradient for its sink logits (softmax_offset) on {shape.id}")
            tensors["dsink"] = module.softmax_offset.grad.detach().float()
        return ImplementationOutput(
            tensors=tensors,
            backend=te_backend_name(ran) + (f" ({sub['fused_attention_backend']})" if ran == "fused" else ""),
            details={"requested": self.backend, "ran": ran, **sub, "mask_type": mask_type,
                     "window_size": list(window), **({"softmax_type": "learnable"} if sinks else {}),
                     **({} if self.on_cpu else te_versions())},
        )
