"""torch's CUDA choice among its SDPA backends, as the emulated GPU's SDPA makes it
(correctness.emulated_gpu.stand_ins.sdpa): aten/src/ATen/native/transformers/cuda/sdp_utils.cpp
select_sdp_backend and its checks (read at commit 001f694), attention.cpp validate_sdpa_input.

- `select_backend`: the first backend in torch's priority order (torch._C._get_sdp_priority_order():
  flash, efficient, math, cuDNN; torch puts cuDNN first with cuDNN past 9.15 on sm90/sm10x,
  check_prefer_cudnn_attention) that is switched on (torch.nn.attention.sdpa_kernel,
  torch.backends.cuda.enable_*_sdp) and whose checks take the call; where none does, torch's
  warnings ("Memory efficient kernel not used because:" and the reason, for each fused backend) and
  its error "No available kernel. Aborting execution."; with every backend switched off, "No viable
  backend for scaled_dot_product_attention was found...".
- `flash_refusal`, `efficient_refusal`, `cudnn_refusal`: each fused backend's checks for a dense call
  in torch's order, the first that fails being the reason, in torch's words. Their numbers are
  correctness.attention.sdpa_rules' (the GPU tiers plan by the same rules), asked of the emulated
  GPU's capability and its cuDNN (torch.backends.cudnn.version()); deterministic algorithms (not
  warn-only) rule cuDNN out.
"""

import math
import warnings
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend

from correctness.attention.sdpa_rules import (FLASH_MAX_HEAD_DIM, HALF_DTYPES, cudnn_backward_head_dims_fit,
                                              cudnn_head_dim_limit, cudnn_refuses_determinism, efficient_head_dims_fit,
                                              flash_head_dims_fit, gemm_alignment)
from correctness.emulated_gpu.placement import PLACES
from correctness.emulated_gpu.runtime import NotEmulated

NO_KERNEL = "No available kernel. Aborting execution."
NO_BACKEND = ("No viable backend for scaled_dot_product_attention was found. This is likely due to turning off both"
              " the math kernel and the fused kernels.")
# torch's names of dtypes in its warnings: ScalarType names in the allowed lists, TypeMeta names for a tensor's
TYPE_NAMES = {torch.float16: "Half", torch.bfloat16: "BFloat16", torch.float32: "Float"}
META_NAMES = {torch.float16: "c10::Half", torch.bfloat16: "c10::BFloat16", torch.float32: "float", torch.float64: "double"}
CUDNN_MAX_DIM_SIZE = 65535  # check_cudnn_tensor_shapes: batch and heads
CUDNN_PREFERRED_FROM = 91500  # check_prefer_cudnn_attention: cuDNN past 9.15 on sm90/sm10x goes first
DEFAULT_ORDER = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH, SDPBackend.CUDNN_ATTENTION,
                 SDPBackend.OVERRIDEABLE]  # at::Context's sdp_priority_order
SWITCHES = {
    SDPBackend.FLASH_ATTENTION: torch.backends.cuda.flash_sdp_enabled,
    SDPBackend.EFFICIENT_ATTENTION: torch.backends.cuda.mem_efficient_sdp_enabled,
    SDPBackend.CUDNN_ATTENTION: torch.backends.cuda.cudnn_sdp_enabled,
    SDPBackend.MATH: torch.backends.cuda.math_sdp_enabled,
    SDPBackend.OVERRIDEABLE: torch._C._get_overrideable_sdp_enabled,
}
DISABLED = {SDPBackend.FLASH_ATTENTION: "Flash attention has been runtime disabled.",
            SDPBackend.EFFICIENT_ATTENTION: "Memory Efficient attention has been runtime disabled.",
            SDPBackend.CUDNN_ATTENTION: "cuDNN attention has been runtime disabled."}
# select_sdp_backend's order of its warnings where no backend runs
NOT_USED = ((SDPBackend.EFFICIENT_ATTENTION, "Memory efficient kernel not used because:"),
            (SDPBackend.FLASH_ATTENTION, "Flash attention kernel not used because:"),
            (SDPBackend.CUDNN_ATTENTION, "cuDNN attention kernel not used because:"))


@dataclass(frozen=True)
class SdpaCall:
    """One call's arguments, as torch's sdp_params holds them, and the emulated GPU it runs on."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attn_mask: torch.Tensor | None
    dropout_p: float
    is_causal: bool
    enable_gqa: bool
    capability: tuple[int, int]
    cudnn_version: int

    @property
    def requires_grad(self) -> bool:
        """input_requires_grad: an input needs a gradient and grad mode is on."""
        return torch.is_grad_enabled() and any(t.requires_grad for t in (self.query, self.key, self.value))

    def sizes(self, dim: int) -> tuple[int, int, int]:
        return self.query.shape[dim], self.key.shape[dim], self.value.shape[dim]


def _between(capability: tuple[int, int], low: tuple[int, int], high: tuple[int, int]) -> bool:
    return low <= capability <= high


def _dims(call: SdpaCall) -> str | None:
    """check_tensor_shapes: 4-D q, k and v."""
    if call.query.dim() == call.key.dim() == call.value.dim() == 4:
        return None
    q, k, v = (t.dim() for t in (call.query, call.key, call.value))
    return (f"All fused kernels requires query, key and value to be 4 dimensional, but got Query dim: {q}, Key dim: {k},"
            f" Value dim: {v} instead.")


def _dtypes(call: SdpaCall, allowed: tuple[torch.dtype, ...]) -> str | None:
    """check_tensor_dtype."""
    dtype = call.query.dtype
    if dtype == call.key.dtype == call.value.dtype and dtype in allowed:
        return None
    names = ", ".join(TYPE_NAMES[each] for each in allowed)
    got = [META_NAMES.get(t.dtype, str(t.dtype)) for t in (call.query, call.key, call.value)]
    return (f"Expected query, key and value to all be of dtype: {{{names}}}. Got Query dtype: {got[0]}, Key dtype:"
            f" {got[1]}, and Value dtype: {got[2]} instead.")


def _sizes(tensor: torch.Tensor) -> str:
    return "[" + ", ".join(str(size) for size in tensor.shape) + "]"


def _batch_and_heads(call: SdpaCall, requires_same_kv_heads: bool) -> str | None:
    """check_batch_size_and_num_heads_dense (every backend here takes grouped-query attention)."""
    q, k, v = call.query, call.key, call.value
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        return ("For dense inputs, both fused kernels require query, key and value to have the same batch_size. Query.sizes():"
                f" {_sizes(q)}, Key.sizes(): {_sizes(k)}, Value.sizes(): {_sizes(v)} instead. To broadcast dense inputs, try"
                " using unsqueeze and expand_to before passing them into the kernel.")
    heads_q, heads_k, heads_v = call.sizes(-3)
    if call.enable_gqa:
        if requires_same_kv_heads and heads_k != heads_v:
            return ("Both fused kernels require key and value to have the same num_heads and batch_size but got: Key sizes:"
                    f" {_sizes(k)}, Value sizes: {_sizes(v)}, Query sizes: {_sizes(q)} instead.")
        if heads_q % heads_k or (not requires_same_kv_heads and heads_q % heads_v):
            return ("The number of heads in key/value must divide number of heads in query.Got input Key sizes():"
                    f" {heads_k}, Value sizes(): {heads_v}, Query sizes(): {heads_q} instead.")
        return None
    if not heads_q == heads_k == heads_v:
        return ("For dense input, both fused kernels require query, key and value to have the same num_heads. Query.sizes():"
                f" {_sizes(q)}, Key sizes(): {_sizes(k)}, Value sizes(): {_sizes(v)} instead. To broadcast dense inputs, try"
                " using unsqueeze and expand_to before passing them into the kernel.")
    return None


def _sequence_lengths(call: SdpaCall) -> str | None:
    """check_nonzero_sequence_lengths_dense."""
    if call.query.shape[-2] == 0 or call.key.shape[-2] == 0:
        return "All fused kernels do not support zero seq_len_q or seq_len_kv."
    return None


def _last_dim_strides(call: SdpaCall, ignore_singleton: bool) -> str | None:
    """check_last_dim_stride_equals_1_dense: a GPU backend also needs the mask's last stride 1."""
    q, k, v = call.query, call.key, call.value
    unit = all(t.stride(-1) == 1 for t in (q, k, v)) or (ignore_singleton and q.shape[-1] == 1)
    mask = call.attn_mask
    if unit and (mask is None or mask.stride(-1) == 1):
        return None
    text = ("All fused kernels require the last dimension of the input to have stride 1. Got Query.stride(-1):"
            f" {q.stride(-1)}, Key.stride(-1): {k.stride(-1)}, Value.stride(-1): {v.stride(-1)}")
    if mask is not None:
        text += (f", Attn_mask.stride(-1): {mask.stride(-1)} (GPU backends require attn_mask's last dimension to have"
                 " stride 1 while the CPU does not).")
    return text


def _head_dims_text(call: SdpaCall) -> str:
    q, k, v = call.sizes(-1)
    return f"Got Query.size(-1): {q}, Key.size(-1): {k}, Value.size(-1): {v} instead."


def flash_refusal(call: SdpaCall) -> str | None:
    """can_use_flash_attention's checks in its order (a dense call), the first that fails; None: it runs."""
    if not SWITCHES[SDPBackend.FLASH_ATTENTION]():
        return DISABLED[SDPBackend.FLASH_ATTENTION]
    if (reason := _dims(call)) is not None:
        return reason
    if call.attn_mask is not None:  # check_for_attn_mask
        return "Flash Attention does not support non-null attn_mask."
    if not flash_head_dims_fit(*call.sizes(-1)):
        return (f"Flash attention requires q,k,v to have the same last dimension and to be less than or equal to"
                f" {FLASH_MAX_HEAD_DIM}. {_head_dims_text(call)}")
    major, minor = call.capability
    if not _between(call.capability, (8, 0), (12, 1)):
        return (f"Flash attention only supports gpu architectures in the range [sm80, sm121]. Attempting to run on a sm"
                f" {major}.{minor} gpu.")
    head_dim = call.query.shape[-1]
    consumer = _between(call.capability, (8, 6), (8, 9)) or _between(call.capability, (12, 0), (12, 1))
    if call.requires_grad and consumer and not (head_dim <= 192 or (call.dropout_p == 0 and head_dim > 224)):
        return ("Flash attention currently doesn't support training with head_dim \u2208 (192, 224] or (head_dim \u2208"
                " (224, 256] and dropout > 0.0) on gpu architectures in the range[sm86, sm89].Attempting to run with"
                f" dropout set to: {call.dropout_p}and head_dim: {head_dim} on a sm {major}.{minor} gpu.")
    seq_q, seq_k = call.query.shape[-2], call.key.shape[-2]
    if call.is_causal and seq_q != seq_k:  # check_flash_causal_non_square_seqlens
        return (f"Flash attention does not support the is_causal flag when seqlen_q != seqlen_k. Got seqlen_q: {seq_q}"
                f" seqlen_k: {seq_k}. If you would like to use causal attention with non-square masks, please see"
                " CausalAttnMask.")
    if (reason := _dtypes(call, HALF_DTYPES if major >= 8 else (torch.float16,))) is not None:
        return reason
    return (_batch_and_heads(call, requires_same_kv_heads=True) or _sequence_lengths(call)
            or _last_dim_strides(call, ignore_singleton=True))


def efficient_refusal(call: SdpaCall) -> str | None:
    """can_use_mem_efficient_attention's checks in its order (a dense call); None: it runs."""
    if not SWITCHES[SDPBackend.EFFICIENT_ATTENTION]():
        return DISABLED[SDPBackend.EFFICIENT_ATTENTION]
    major, minor = call.capability
    if not _between(call.capability, (5, 0), (12, 1)):
        return (f"Mem Efficient Attention only supports gpu architectures in the range [sm50, sm121]. Attempting to run on"
                f" a sm {major}.{minor} gpu.")
    if (reason := _dims(call)) is not None:
        return reason
    alignment = gemm_alignment(call.query.dtype, call.capability)
    if not efficient_head_dims_fit(*call.sizes(-1), alignment):
        return f"Mem efficient attention requires last dimension of inputs to be divisible by {alignment}. {_head_dims_text(call)}"
    if major >= 8:  # check_data_ptr_alignment_mem_efficient: storage offsets, the allocator aligning bases
        size = call.query.element_size()
        offsets = [t.storage_offset() * t.element_size() % (alignment * size) for t in (call.query, call.key, call.value)]
        if any(t.numel() and offset for t, offset in zip((call.query, call.key, call.value), offsets)):
            return ("Mem efficient attention on sm80 or newer requires q, k, and v storage offsets * element_size to be"
                    f" aligned to {alignment * size} bytes. Got query.storage_offset() * element_size % alignment_bytes:"
                    f" {offsets[0]}, key.storage_offset() * element_size % alignment_bytes: {offsets[1]},"
                    f" value.storage_offset() * element_size % alignment_bytes: {offsets[2]}.")
    reason = (_sequence_lengths(call) or _last_dim_strides(call, ignore_singleton=False)
              or _batch_and_heads(call, requires_same_kv_heads=True))
    if reason is not None:
        return reason
    return _dtypes(call, (torch.float16, torch.float32, torch.bfloat16) if major >= 8 else (torch.float16, torch.float32))


def _mask_shape(call: SdpaCall) -> tuple[bool, str | None]:
    """check_attn_mask_shape: (whether cuDNN takes the mask, torch's warning where it says one)."""
    mask = call.attn_mask
    if mask is None:
        return True, None
    if mask.requires_grad:
        return False, None
    batch, heads, queries = call.query.shape[0], call.query.shape[1], call.query.shape[2]
    keys = call.key.shape[2]
    if mask.shape[-2] not in (queries, 1) or mask.shape[-1] not in (keys, 1):
        return False, None
    if mask.dim() == 2 or (mask.dim() == 4 and mask.shape[0] in (1, batch) and mask.shape[1] in (1, heads)):
        return True, None
    return False, ("Please use the following attn mask shapes: 2d - ({Q_seq_len, 1}  x {KV_seq_len, 1}); 4d - ({Batch, 1}"
                   " x {Num_heads, 1} x {Q_seq_len, 1}  x {KV_seq_len, 1})")


def _cudnn_shapes(call: SdpaCall) -> str | None:
    """check_cudnn_tensor_shapes and check_cudnn_d256_bprop_head_dim."""
    batch, heads = call.query.shape[0], call.query.shape[1]
    if batch > CUDNN_MAX_DIM_SIZE or heads > CUDNN_MAX_DIM_SIZE:
        return (f"cuDNN SDPA does not support batch size or num_heads greater than {CUDNN_MAX_DIM_SIZE}. Got batch size:"
                f" {batch}, num_heads: {heads}")
    seq_q, seq_k = call.query.shape[2], call.key.shape[2]
    d_qk, d_v = call.query.shape[3], call.value.shape[3]
    version = call.cudnn_version
    if version < 8903:
        return "SDPA fprop requires cudnn 8.9.3 or higher"
    if version < 8906 and call.dropout_p != 0:
        return "Dropout reference is only supported on 8.9.6 onwards."
    limit = cudnn_head_dim_limit(call.capability, version, d_qk, d_v)
    if d_qk > limit or d_v > limit:
        return f"head_dim should be no more than {limit}"
    if d_qk % 8 or d_v % 8:
        return "head_dim should be a multiple of 8"
    if version < 8906 and seq_k % 64:
        return "not-multiple-of-64 seq_kv is not supported below 8.9.6"
    if version < 90000:
        if seq_q < 64:
            return "s_q less than 64 is not supported before cudnn 9.0.0"
        if call.dropout_p != 0 and (seq_q % 64 or seq_k % 64):
            return "s_q not a multiple of 64 with padding/dropout is not supported with cudnn version 9.0.0"
    if seq_k == 1:
        return "cudnn SDPA does not support key/value sequence length 1."
    if call.dropout_p != 0 and seq_q == 1:
        return "cudnn SDPA does not support query sequence length 1 with dropout."
    if call.requires_grad and not cudnn_backward_head_dims_fit(call.capability, version, d_qk, d_v):
        return f"cuDNN SDPA on SM 9.0/10.x does not support backward with these head dimensions. Got d_qk: {d_qk}, d_v: {d_v}"
    return None


def cudnn_refusal(call: SdpaCall) -> str | None:
    """can_use_cudnn_attention's checks in its order (a dense call); None: it runs. A check torch makes
    without a warning refuses with an empty reason."""
    version = call.cudnn_version
    if call.dropout_p > 0 and 91100 < version < 91400:
        return f"{version} cuDNN version does not support droppout in SDPA (9.11 - 9.13)."
    if not SWITCHES[SDPBackend.CUDNN_ATTENTION]():
        return DISABLED[SDPBackend.CUDNN_ATTENTION]
    if (reason := _dims(call)) is not None:
        return reason
    if cudnn_refuses_determinism(torch.are_deterministic_algorithms_enabled(),
                                 torch.is_deterministic_algorithms_warn_only_enabled()):
        return "cuDNN SDPA is not deterministic."
    if (reason := _dtypes(call, HALF_DTYPES if call.capability[0] >= 8 else (torch.float16,))) is not None:
        return reason
    takes_mask, said = _mask_shape(call)
    if not takes_mask:
        return said or ""
    major, minor = call.capability
    if not _between(call.capability, (8, 0), (12, 1)):
        return (f"cuDNN MHA only supports gpu architectures in the range [sm80, sm121]. Attempting to run on a sm"
                f" {major}.{minor} gpu.")
    if call.dropout_p * 16.0 != math.floor(call.dropout_p * 16.0):
        return ("cuDNN dropout probability resolution is limited to 1/16.Use a dropout probability that is a multiple of"
                " 1/16 to select the cuDNN backend")
    return (_sequence_lengths(call) or _last_dim_strides(call, ignore_singleton=True)
            or _batch_and_heads(call, requires_same_kv_heads=False) or _cudnn_shapes(call))


REFUSALS = {SDPBackend.FLASH_ATTENTION: flash_refusal, SDPBackend.EFFICIENT_ATTENTION: efficient_refusal,
            SDPBackend.CUDNN_ATTENTION: cudnn_refusal}


def priority_order(call: SdpaCall) -> list[SDPBackend]:
    """torch's order of trying the backends (priority_order): the context's, where torch would have
    put cuDNN first (check_prefer_cudnn_attention) and nobody set another, with cuDNN first."""
    order = [SDPBackend(int(each)) for each in torch._C._get_sdp_priority_order()]
    if order == DEFAULT_ORDER and call.cudnn_version > CUDNN_PREFERRED_FROM and call.capability[0] in (9, 10):
        order = [SDPBackend.CUDNN_ATTENTION] + [each for each in order if each != SDPBackend.CUDNN_ATTENTION]
    return order


def select_backend(call: SdpaCall) -> SDPBackend:
    """The backend torch's CUDA build runs the call on (select_sdp_backend); raises torch's errors,
    with its warnings, where none can."""
    if not any(SWITCHES[each]() for each in (SDPBackend.MATH, SDPBackend.FLASH_ATTENTION,
                                             SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION)):
        raise RuntimeError(NO_BACKEND)
    for backend in priority_order(call):
        if backend in REFUSALS:
            if REFUSALS[backend](call) is None:
                return backend
        elif backend == SDPBackend.MATH and SWITCHES[SDPBackend.MATH]():
            return backend
        elif backend == SDPBackend.OVERRIDEABLE and SWITCHES[SDPBackend.OVERRIDEABLE]():
            raise RuntimeError("Invalid backend")
    for backend, heading in NOT_USED:
        warnings.warn(heading, UserWarning, stacklevel=3)
        reason = REFUSALS[backend](call)
        if reason:
            warnings.warn(reason, UserWarning, stacklevel=3)
    raise RuntimeError(NO_KERNEL)


def validate(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None) -> None:
    """validate_sdpa_input (attention.cpp)."""
    if not query.dtype == key.dtype == value.dtype:
        raise RuntimeError(f"Expected query, key, and value to have the same dtype, but got query.dtype: {query.dtype}"
                           f" key.dtype: {key.dtype} and value.dtype: {value.dtype} instead.")
    if not PLACES.of(query) == PLACES.of(key) == PLACES.of(value):
        raise RuntimeError(f"Expected query, key, and value to have the same device type, but got query.device:"
                           f" {query.device} key.device: {key.device} and value.device: {value.device} instead.")
    if min(t.dim() for t in (query, key, value)) < 2:
        raise RuntimeError(f"Expected query, key, and value to all be  at least 2 dimensional, but got query.dim:"
                           f" {query.dim()} key.dim: {key.dim()} and value.dim: {value.dim()} instead.")
    if attn_mask is not None and attn_mask.dtype not in (torch.bool, torch.float32, query.dtype):
        raise RuntimeError(f"Expected attn_mask dtype to be bool or float or to match query dtype, but got attn_mask.dtype:"
                           f" {attn_mask.dtype} and  query.dtype: {query.dtype} instead.")
    if any(t.is_nested for t in (query, key, value)):
        raise NotEmulated("torch SDPA on nested tensors is not emulated (correctness.emulated_gpu.stand_ins.sdpa)")
