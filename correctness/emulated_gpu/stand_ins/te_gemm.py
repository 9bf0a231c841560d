"""TE 2.17's cuBLASLt GEMM (`transformer_engine_torch.generic_gemm`, called by
cpp_extensions/gemm.py general_gemm) on the emulated GPU.

TE's layouts in row-major terms: D = op(B) @ op(A), op(X) = X^T where its trans flag is set ("TN":
forward, out = input @ weight^T; "NN": dgrad, grad_out @ weight; "NT": wgrad, grad_out^T @ input).
The stand-in computes the FP32 product of the operands, alpha times it, plus beta times the
output where it accumulates, rounded once to the output's dtype (cuBLAS with FP32 compute, as
correctness.cpu_gemm does for torch's GEMMs), and writes it into `out` where one is given. FP8
operands (TE's Float8Tensor and blockwise tensors) are read as the Hopper GEMM reads them and
multiplied by correctness.emulated_gpu.stand_ins.te_fp8.quantized_product (FP32 accumulation, the
scales applied; blocks with the split accumulator). It refuses what it does not model (NotEmulated):
GELU epilogues, communication overlap, a bias gradient, an output quantizer.
"""

from typing import Any

import torch

from correctness.emulated_gpu.kernels import require_on_gpu, stand_in
from correctness.emulated_gpu.runtime import NotEmulated

# TE's DType enum values (te_on_cpu.ENUMS["DType"]) -> torch dtypes.
TORCH_DTYPES = {4: torch.float32, 5: torch.float16, 6: torch.bfloat16}


def torch_dtype(te_dtype: Any) -> torch.dtype | None:
    """A torch dtype from TE's DType enum (None: none given)."""
    if te_dtype is None:
        return None
    value = int(te_dtype)
    if value not in TORCH_DTYPES:
        raise NotEmulated(f"TE GEMM output dtype {getattr(te_dtype, 'name', value)} is not emulated")
    return TORCH_DTYPES[value]


def quantized(tensor: Any) -> bool:
    """A TE quantized tensor or storage (Float8Tensor, Float8BlockwiseQTensorStorage, MXFP8Tensor...)."""
    return type(tensor).__module__.startswith("transformer_engine")


def _operand(tensor: Any, transposed: bool) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor) or quantized(tensor):
        raise NotEmulated(f"TE GEMM with a {type(tensor).__name__} operand (quantized) is not emulated here")
    matrix = tensor.reshape(-1, tensor.shape[-1]).float()
    return matrix.t() if transposed else matrix


@stand_in(name="transformer_engine_torch.generic_gemm", stands_for="TE's cuBLASLt GEMM (generic_gemm)",
          computes="the FP32 product of op(B) and op(A), alpha and beta in FP32, rounded once to the output dtype;"
                   " FP8 operands: the FP32 product of their FP8 values with the scale-inverses applied (per tensor:"
                   " after the accumulation, TE's fast-accumulation flag not modelled; 128-element blocks of K: per"
                   " block, added into an FP32 accumulator), not Hopper's own FP8 accumulation (mmaemu's model of it"
                   " is off here: 0.15-2.8 s a GEMM, and cuBLAS's split-K unknown to it at 11 of the seeds' 12 smoke"
                   " GEMMs)")
def generic_gemm(A, transa, B, transb, out, quantizer, out_dtype, bias, bias_type, gelu, gelu_in, grad, workspace,
                 workspace_size, accumulate, use_split_accumulator, comm_overlap=None, comm_type=None,
                 extra_output=None, bulk_overlap=False, alpha=1.0, beta=None):
    plain = {name: t for name, t in (("A", A), ("B", B)) if not quantized(t)}  # te_fp8 checks a quantized one's data
    require_on_gpu("generic_gemm", out=out, bias=bias, **plain)
    if gelu or comm_overlap is not None or quantizer is not None or (grad and bias is not None):
        raise NotEmulated("TE GEMM with a GELU epilogue, communication overlap, an output quantizer or a bias"
                          " gradient is not emulated")
    if quantized(A) or quantized(B):
        from correctness.emulated_gpu.stand_ins.te_fp8 import quantized_product

        product = quantized_product(A, bool(transa), B, bool(transb), bool(use_split_accumulator))
    else:
        product = _operand(B, bool(transb)) @ _operand(A, bool(transa))
    product = product * float(alpha)
    if bias is not None:
        product = product + bias.float()
    dtype = out.dtype if out is not None else (torch_dtype(out_dtype) or A.dtype)
    lead = B.size()[:-1] if not transb else B.size()[-1:]
    if accumulate and out is not None:
        product = product + (1.0 if beta is None else float(beta)) * out.reshape(product.shape).float()
    result = product.to(dtype)
    if out is not None:
        out.copy_(result.reshape(out.shape))
        return out, None, None, extra_output
    shape = (*lead, result.shape[-1]) if not transb and len(B.size()) > 2 else result.shape
    return result.reshape(shape), None, None, extra_output
