"""torch.nn.functional.scaled_dot_product_attention on the emulated GPU: torch's CUDA dispatch
among its backends (flash, memory-efficient, cuDNN, math), and what each backend computes.

The entry (`scaled_dot_product_attention`, in torch.nn.functional's place) passes a call without GPU
tensors to torch's own SDPA: the CPU build's CPU kernels, as on any machine. With q, k and v on the
GPU it validates the call and chooses the backend as torch's CUDA build does
(correctness.emulated_gpu.stand_ins.sdpa_dispatch: torch's priority order, the switches of
torch.nn.attention.sdpa_kernel, each fused backend's checks with torch's reasons, deterministic
algorithms, torch's errors), then runs that backend's stand-in, counted under its name, so that a
record's provenance says which backend ran.

What each backend computes: flash, efficient and cuDNN share one computation
(correctness.emulated_gpu.stand_ins.sdpa_fused.FusedAttention: the flash algorithm's arithmetic, FP32
logits and softmax, P and dS entering their products in the inputs' dtype, each output rounded
once); math is torch's own device-generic math composite (aten._scaled_dot_product_attention_math),
which torch's CUDA build runs too, on the GPU's tensors. Not emulated (NotEmulated): dropout on a
fused backend (its Philox stream), a mask that needs a gradient, FA3, nested tensors.
"""

import math
from collections.abc import Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from correctness.emulated_gpu.kernels import require_on_gpu, stand_in
from correctness.emulated_gpu.placement import PLACES
from correctness.emulated_gpu.runtime import NotEmulated
from correctness.emulated_gpu.stand_ins.sdpa_dispatch import SdpaCall, select_backend, validate
from correctness.emulated_gpu.stand_ins.sdpa_fused import FusedAttention, mask_bias

TORCH_SDPA = torch._C._nn.scaled_dot_product_attention  # torch's own (torch.nn.functional's, outside the emulation)

RUNS = {SDPBackend.FLASH_ATTENTION: "flash_attention", SDPBackend.EFFICIENT_ATTENTION: "efficient_attention",
        SDPBackend.CUDNN_ATTENTION: "cudnn_attention", SDPBackend.MATH: "math_attention"}


@stand_in(name="torch.nn.functional.scaled_dot_product_attention",
          stands_for="torch's scaled_dot_product_attention on CUDA tensors: its choice among flash, memory-efficient,"
                     " cuDNN and math attention (sdp_utils.cpp select_sdp_backend)",
          computes="torch's CUDA dispatch: validation, the enabled backends in torch's priority order, each fused"
                   " backend's checks with torch's reasons and errors, deterministic algorithms; the chosen backend's"
                   " stand-in runs (CPU tensors: torch's own CPU SDPA)")
def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    if not any(PLACES.of(t) >= 0 for t in (query, key, value)):
        return TORCH_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                          enable_gqa=enable_gqa)
    validate(query, key, value, attn_mask)
    call = SdpaCall(query=query, key=key, value=value, attn_mask=attn_mask, dropout_p=float(dropout_p),
                    is_causal=bool(is_causal), enable_gqa=bool(enable_gqa),
                    capability=tuple(torch.cuda.get_device_capability()), cudnn_version=int(torch.backends.cudnn.version()))
    backend = select_backend(call)
    run = globals()[RUNS[backend]]  # the installed stand-in, counted under its name
    return run(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
               enable_gqa=enable_gqa)


def _fused(backend: SDPBackend, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    kernel = RUNS[backend]
    require_on_gpu(kernel, query=query, key=key, value=value, attn_mask=attn_mask)
    if dropout_p:
        raise NotEmulated(f"torch SDPA {kernel} with dropout {dropout_p}: its Philox stream is not emulated")
    if backend == SDPBackend.FLASH_ATTENTION and torch._C._get_fa3_sdp_enabled():
        raise NotEmulated("torch SDPA flash attention 3 (torch._C._set_sdp_use_fa3) is not emulated")
    softmax_scale = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
    return FusedAttention.apply(backend, query, key, value, mask_bias(attn_mask, query.dtype), is_causal, softmax_scale)


FUSED_COMPUTES = ("the flash algorithm's arithmetic (FusedAttention): FP32 logits and softmax from the BF16/FP16"
                  " inputs, P and dS entering their products in the inputs' dtype, FP32 accumulation, each output and"
                  " gradient rounded once; one computation for flash, efficient and cuDNN")


def _fused_stand_in(backend: SDPBackend, stands_for: str) -> Callable[..., torch.Tensor]:
    """Declares the stand-in of one fused backend, installed as this module's RUNS[backend]: the
    shared computation (`_fused`) under the backend's name."""
    def run(query, key, value, *, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        return _fused(backend, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)

    run.__name__ = RUNS[backend]
    return stand_in(name=f"{__name__}.{RUNS[backend]}", stands_for=stands_for, computes=FUSED_COMPUTES)(run)


flash_attention = _fused_stand_in(
    SDPBackend.FLASH_ATTENTION,
    "torch SDPA's flash attention CUDA kernel (FlashAttention-2, aten._scaled_dot_product_flash_attention)")
efficient_attention = _fused_stand_in(
    SDPBackend.EFFICIENT_ATTENTION,
    "torch SDPA's memory-efficient attention CUDA kernel (CUTLASS, aten._scaled_dot_product_efficient_attention)")
cudnn_attention = _fused_stand_in(SDPBackend.CUDNN_ATTENTION,
                                  "torch SDPA's cuDNN attention (aten._scaled_dot_product_cudnn_attention)")


@stand_in(name=f"{__name__}.math_attention",
          stands_for="torch SDPA's math backend on CUDA (aten._scaled_dot_product_attention_math)",
          computes="torch's own device-generic math composite on the GPU's tensors (its BF16/FP16 inputs upcast to FP32"
                   " unless torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp); its GEMMs as the emulated GPU runs"
                   " torch's")
def math_attention(query, key, value, *, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    # torch's SDPA switched to math alone for the call: on the CPU tensors underneath, torch's CPU
    # dispatch then runs the device-generic math composite its CUDA build runs.
    with sdpa_kernel([SDPBackend.MATH]):
        return TORCH_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                          enable_gqa=enable_gqa)
