"""torch's CUDA rules for which SDPA backend takes a call's head dims, dtype and switches, after
aten/src/ATen/native/transformers/cuda/sdp_utils.cpp (the stored copy at commit 001f694, of the
2.11 era); each function names the function of that file it follows.

Two users decide by these rules, so that they are written once:
- correctness.attention.combinations plans a GPU tier before a GPU is touched: what a backend
  refuses on any CUDA GPU (the GPU-dependent rules at their most permissive: PERMISSIVE_GPU);
- the emulated GPU's SDPA (correctness.emulated_gpu.stand_ins.sdpa) refuses at run time what torch's
  CUDA build refuses on the emulated GPU, with its capability and cuDNN version.
"""

import torch

FLASH_MAX_HEAD_DIM = 256  # check_head_dim_size_flash: "less than or equal to 256"
HALF_DTYPES = (torch.float16, torch.bfloat16)
# The GPU and cuDNN with the widest cuDNN head dims: sm90 with cuDNN past 9.22 (check_cudnn_tensor_shapes)
PERMISSIVE_GPU = {"capability": (9, 0), "cudnn_version": 92300}


def flash_head_dims_fit(query: int, key: int, value: int) -> bool:
    """check_head_dim_size_flash: one head dim for q, k and v, of at most FLASH_MAX_HEAD_DIM."""
    return query == key == value and query <= FLASH_MAX_HEAD_DIM


def gemm_alignment(dtype: torch.dtype, capability: tuple[int, int]) -> int:
    """minimum_gemm_alignment: the head-dim multiple the efficient kernel's GEMMs need, 128 bits of a
    tensor-core operand where tensor cores are used (sm80 and newer; sm70 for FP16/BF16)."""
    half = dtype in HALF_DTYPES
    major = capability[0]
    alignment = 4 if major >= 8 else 1
    if major >= 8 or (major >= 7 and half):
        alignment = max(alignment, 128 // (16 if half else 32))
    return alignment


def efficient_head_dims_fit(query: int, key: int, value: int, alignment: int) -> bool:
    """check_head_dim_size_mem_efficient: q and k of one head dim, q's and v's positive multiples of
    `alignment` (gemm_alignment)."""
    return query == key and query > 0 and value > 0 and query % alignment == 0 and value % alignment == 0


def _sm90_or_sm10x(capability: tuple[int, int]) -> bool:
    major, minor = capability
    return (major == 9 and minor == 0) or major == 10


def cudnn_takes_d256(capability: tuple[int, int], cudnn_version: int) -> bool:
    """check_cudnn_tensor_shapes / check_cudnn_d256_bprop_head_dim: head dims up to 256 on sm90 and
    sm10x (not sm107 before cuDNN 9.25) with cuDNN past 9.22 (and a cuDNN frontend that has them)."""
    if capability == (10, 7) and cudnn_version <= 92500:
        return False
    return _sm90_or_sm10x(capability) and cudnn_version > 92200


def cudnn_head_dim_limit(capability: tuple[int, int], cudnn_version: int, query: int, value: int) -> int:
    """check_cudnn_tensor_shapes: the largest head dim cuDNN attention takes: 128; 256 where
    cudnn_takes_d256; 192 for q and k with 128 for v on sm90/sm10x from cuDNN 9.11."""
    if cudnn_takes_d256(capability, cudnn_version):
        return 256
    if _sm90_or_sm10x(capability) and cudnn_version >= 91100 and (query, value) == (192, 128):
        return 192
    return 128


def cudnn_backward_head_dims_fit(capability: tuple[int, int], cudnn_version: int, query: int, value: int) -> bool:
    """check_cudnn_d256_bprop_head_dim: where cuDNN takes head dims up to 256, its backward takes
    q/k and v head dims of at most 128 each, (192, 128) or (256, 256) only."""
    if not cudnn_takes_d256(capability, cudnn_version):
        return True
    return (query <= 128 and value <= 128) or (query, value) in ((192, 128), (256, 256))


def cudnn_refuses_determinism(deterministic: bool, warn_only: bool) -> bool:
    """check_cudnn_deterministic: torch's deterministic algorithms, unless only warning, rule cuDNN
    attention out."""
    return deterministic and not warn_only
