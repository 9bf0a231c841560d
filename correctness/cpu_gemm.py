"""A low-precision matrix product on the CPU computed as cuBLAS computes it on a GPU, for the levers
that run megatron-core's own functions on the CPU.

`gemm_as_cublas()`: while it is active, every BF16 or FP16 `aten.mm` and `aten.bmm` of CPU tensors
of one dtype is the FP32 product of the operands rounded once to their dtype (cuBLAS's BF16 GEMM:
FP32 accumulation, one rounding of the output), and `aten.baddbmm` is alpha times that product
plus beta times the input, in FP32, rounded once (cuBLAS's alpha and beta are FP32 scalars). It stands in for torch's own low-precision CPU
GEMM, which is 20-70 x slower on a CPU without BF16 hardware (a scalar loop) and whose rounding is
the host's. It is a dispatch mode, so it reaches the products the autograd engine runs in the
backward too (a custom autograd Function's backward), which a TorchFunctionMode does not.
"""

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

LOW_PRECISION = (torch.bfloat16, torch.float16)
_PRODUCTS = (torch.ops.aten.mm.default, torch.ops.aten.bmm.default)


def _on_the_cpu(tensor: torch.Tensor) -> bool:
    """Whether the tensor's memory is the CPU's, read from torch itself: an emulated GPU's tensors
    (correctness.emulated_gpu) report CUDA through torch.Tensor's attributes but live here too."""
    return torch._C.TensorBase.is_cpu.__get__(tensor)


def _low_precision_pair(args) -> bool:
    return (len(args) == 2 and all(isinstance(t, torch.Tensor) and _on_the_cpu(t) for t in args)
            and args[0].dtype in LOW_PRECISION and args[0].dtype == args[1].dtype)


def product_as_cublas(func, args, kwargs) -> torch.Tensor | None:
    """The operator's result as cuBLAS computes it, where it is a low-precision product this module
    covers; None where it is not (the caller runs the operator itself)."""
    if func in _PRODUCTS and not kwargs and _low_precision_pair(args):
        return func(args[0].float(), args[1].float()).to(args[0].dtype)
    if func is torch.ops.aten.baddbmm.default and len(args) == 3 and _low_precision_pair(args[1:]) \
            and args[0].dtype == args[1].dtype and set(kwargs) <= {"beta", "alpha"}:
        beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
        product = torch.bmm(args[1].float(), args[2].float()) * alpha
        return (product if beta == 0 else product + beta * args[0].float()).to(args[1].dtype)
    return None


class _GemmAsCublas(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        product = product_as_cublas(func, args, kwargs)
        return product if product is not None else func(*args, **kwargs)


@contextlib.contextmanager
def gemm_as_cublas() -> Iterator[None]:
    with _GemmAsCublas():
        yield
