"""TE 2.17's multi-tensor Adam kernels (`transformer_engine_torch.multi_tensor_adam*`, called by
pytorch/optimizers/fused_adam.py through multi_tensor_applier) on the emulated GPU.

TE's Python passes each kernel `(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, eps, step,
mode, bias_correction, weight_decay[, fp8 out dtype])` (fused_adam.py 736-758), the lists as
FusedAdam built them: [grads, params, exp_avgs, exp_avg_sqs(, masters)]. The stand-ins update every
list in place, as the kernels do (common/multi_tensor/adam.cu at v2.17):

- The hyperparameters cross into the kernel as C floats (pytorch/csrc/extensions/multi_tensor/
  adam.cpp 11-15); the bias corrections 1 - beta^step are computed on the host in double from the
  FP32 betas and stored as floats (adam.cu 580-585); every element's step is FP32 math, ADAMW
  (mode 1): m = b1 m + (1 - b1) g, v = b2 v + (1 - b2) g^2, update = (m / bc1) / (sqrt(v / bc2) +
  eps) + decay p, p -= lr update (adam.cu 134-141). That is the project's model of the kernel,
  correctness.adam.arithmetic.fused_adam_arithmetic, reused here, not a second copy.
- Each element is read into FP32 from its list's dtype and written back with a C cast to that
  dtype (round to nearest even): FP32 or BF16 moments (both the same, adam.cu 609-619: BF16 is
  FusedAdam's fused-unscale path), the parameter in its own dtype, the FP32 master where a fifth
  list is given (AdamFunctorMaster, adam.cu 52-176: the step starts from the master, and the
  parameter is the master cast).
- The remainder kernel (multi_tensor_adam_param_remainder, adam.cu 178-292): the BF16 parameter and
  the int16 remainder are the FP32 master's two halves, the high half rounded up where the low
  half is negative as an int16; correctness.adam_precision.state's split_remainder and
  join_remainder, reused.

What stands in here is the kernels' documented arithmetic on the CPU, element for element; the
CUDA kernel's FMA contraction (nvcc may fuse b1 m + (1 - b1) g) is not modelled, so the last bit
can differ from a GPU's. It is the CPU tiers' own model of the kernel, so TE FusedAdam run around it
gives, by construction, bitwise what the offload lever's EagerAdamW, the megatron-cpu tier's
CpuFusedAdam and the precision-aware lever's EmulatedFusedAdam give (tests/test_emulated_te_adam.py):
an emulated record proves TE's and Megatron's code paths ran, never the kernel's numbers. Each stand-in checks the shapes and dtypes the kernel checks (adam.cu
587-625, 718-751) and that every tensor is on the GPU (require_on_gpu).

Refused (NotEmulated): Adam's L2 mode (mode 0; Megatron and the tiers use ADAMW), the FP8-parameter
kernel (multi_tensor_adam_fp8: FP8 model weights, which no tier holds), and the CUDA-graph
capturable kernels (FusedAdam(capturable=True): lr and step as device tensors, gradients unscaled in
place; no tier builds one).
"""

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from correctness.adam.arithmetic import fused_adam_arithmetic
from correctness.adam_precision.state import join_remainder, split_remainder
from correctness.emulated_gpu.kernels import require_on_gpu, stand_in
from correctness.emulated_gpu.runtime import NotEmulated
from references.adamw import AdamWHyperparameters

ADAMW_MODE = 1  # adamMode_t ADAM_MODE_1, decoupled weight decay (adam.cu 22-25)
LISTS = ("grad", "param", "exp_avg", "exp_avg_sq", "master")
NON_FP8 = (torch.float32, torch.float16, torch.bfloat16)
MOMENT_DTYPES = (torch.float32, torch.bfloat16)


class KernelCheckFailed(RuntimeError):
    """What TE's NVTE_CHECK raises in the kernel's launcher: a list of the wrong length or dtype."""


def _checked_lists(kernel: str, tensor_lists: Any, counts: tuple[int, ...]) -> list[list[torch.Tensor]]:
    lists = [list(each) for each in tensor_lists]
    if len(lists) not in counts:
        raise KernelCheckFailed(f"{kernel}: Expected {' or '.join(map(str, counts))} tensor lists, but found"
                                f" {len(lists)}")
    for index, each in enumerate(lists[1:], start=1):
        if len(each) != len(lists[0]):
            raise KernelCheckFailed(f"{kernel}: Tensor list {index} has size={len(each)}, but expected"
                                    f" size={len(lists[0])}")
    for index, each in enumerate(lists):
        for position, tensor in enumerate(each):
            require_on_gpu(kernel, **{f"{LISTS[index]}[{position}]": tensor})
            if tensor.numel() != lists[0][position].numel():
                raise KernelCheckFailed(f"{kernel}: {LISTS[index]} tensor {position} has {tensor.numel()} elements,"
                                        f" its gradient {lists[0][position].numel()}")
    return lists


def _same_dtype(kernel: str, name: str, tensors: list[torch.Tensor], allowed: tuple[torch.dtype, ...]) -> None:
    if not tensors:
        return
    first = tensors[0].dtype
    for position, tensor in enumerate(tensors):
        if tensor.dtype != first:
            raise KernelCheckFailed(f"{kernel}: {name} tensor {position} has dtype={tensor.dtype}, but expected"
                                    f" dtype={first}")
    if first not in allowed:
        raise KernelCheckFailed(f"{kernel}: {name} dtype {first} is not one of {list(allowed)}")


def _moments_checked(kernel: str, exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor]) -> None:
    for position, (m, v) in enumerate(zip(exp_avgs, exp_avg_sqs)):
        if m.dtype != v.dtype or m.dtype not in MOMENT_DTYPES:
            raise KernelCheckFailed(f"{kernel}: First and second moment tensors must both be Float32 or both be"
                                    f" BFloat16, but tensor {position} has first moment dtype={m.dtype} and second"
                                    f" moment dtype={v.dtype}")


def _hyperparameters(kernel: str, lr, beta1, beta2, epsilon, mode, weight_decay) -> AdamWHyperparameters:
    if int(mode) != ADAMW_MODE:
        raise NotEmulated(f"{kernel}: Adam's L2 mode (adam_w_mode=False) is not emulated; the ADAMW mode is")
    return AdamWHyperparameters(lr=float(lr), beta1=float(beta1), beta2=float(beta2), eps=float(epsilon),
                                weight_decay=float(weight_decay))


def _step(grad, start, exp_avg, exp_avg_sq, hyper, step, bias_correction):
    """One ADAMW step on one tensor, in FP32 (fused_adam_arithmetic: the module docstring)."""
    return fused_adam_arithmetic(
        start.float().reshape(-1), grad.float().reshape(-1), exp_avg.float().reshape(-1),
        exp_avg_sq.float().reshape(-1), hyper=hyper, step=int(step), bias_correction=bool(bias_correction),
    )


@contextlib.contextmanager
def _one_launch() -> Iterator[None]:
    """The kernel's body, after its arguments were checked: torch's operators on the CPU memory under the
    GPU tensors, without the emulation's per-operator bookkeeping (its dispatch and function modes), about 4x
    cheaper at the smoke scale; results reach the caller only through the lists' own tensors, written in place."""
    with _disable_current_modes(), torch._C.DisableTorchFunction():
        yield


def _write(target: torch.Tensor, values: torch.Tensor) -> None:
    """`values` (FP32) into `target` in its own dtype, rounded to nearest even as a C cast."""
    target.copy_(values.reshape(target.shape))


@stand_in(name="transformer_engine_torch.multi_tensor_adam",
          stands_for="TE 2.17's multi_tensor_adam CUDA kernel (common/multi_tensor/adam.cu AdamFunctor,"
                     " AdamFunctorMaster)",
          computes="ADAMW per element in FP32 (hyperparameters as C floats, bias corrections in double stored as"
                   " floats: correctness.adam.arithmetic.fused_adam_arithmetic) from the master where a fifth list is"
                   " given, else from the parameter; every list written in place in its own dtype (round to nearest"
                   " even); no FMA contraction. The CPU tiers' model of the kernel by construction: TE FusedAdam"
                   " around it gives bitwise their EagerAdamW, EmulatedFusedAdam and CpuFusedAdam results")
def multi_tensor_adam(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, epsilon, step, mode, bias_correction,
                      weight_decay):
    kernel = "multi_tensor_adam"
    require_on_gpu(kernel, noop_flag=noop_flag)
    lists = _checked_lists(kernel, tensor_lists, (4, 5))
    grads, params, exp_avgs, exp_avg_sqs = lists[:4]
    masters = lists[4] if len(lists) == 5 else None
    _same_dtype(kernel, "Grad", grads, NON_FP8)
    _same_dtype(kernel, "Param", params, NON_FP8)
    _moments_checked(kernel, exp_avgs, exp_avg_sqs)
    if masters is not None:
        _same_dtype(kernel, "Master param", masters, (torch.float32,))
    hyper = _hyperparameters(kernel, lr, beta1, beta2, epsilon, mode, weight_decay)
    with _one_launch():
        for position, (grad, param, exp_avg, exp_avg_sq) in enumerate(zip(grads, params, exp_avgs, exp_avg_sqs)):
            start = masters[position] if masters is not None else param
            p, m, v = _step(grad, start, exp_avg, exp_avg_sq, hyper, step, bias_correction)
            if masters is not None:
                _write(masters[position], p)
            _write(param, p)
            _write(exp_avg, m)
            _write(exp_avg_sq, v)


@stand_in(name="transformer_engine_torch.multi_tensor_adam_param_remainder",
          stands_for="TE 2.17's multi_tensor_adam_param_remainder CUDA kernel (common/multi_tensor/adam.cu"
                     " AdamFunctorMasterParamRemainder)",
          computes="the FP32 master joined from the BF16 parameter and its int16 remainder (the high half one lower"
                   " where the remainder is negative), one ADAMW step in FP32 as multi_tensor_adam, and the master"
                   " split back: the high half rounded up where the new low half is negative as an int16"
                   " (correctness.adam_precision.state join_remainder / split_remainder)")
def multi_tensor_adam_param_remainder(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, epsilon, step, mode,
                                      bias_correction, weight_decay):
    kernel = "multi_tensor_adam_param_remainder"
    require_on_gpu(kernel, noop_flag=noop_flag)
    grads, params, exp_avgs, exp_avg_sqs, remainders = _checked_lists(kernel, tensor_lists, (5,))
    _same_dtype(kernel, "Grad", grads, NON_FP8)
    _same_dtype(kernel, "Param", params, (torch.bfloat16,))
    _moments_checked(kernel, exp_avgs, exp_avg_sqs)
    _same_dtype(kernel, "Param remainder", remainders, (torch.int16,))
    hyper = _hyperparameters(kernel, lr, beta1, beta2, epsilon, mode, weight_decay)
    with _one_launch():
        for grad, param, exp_avg, exp_avg_sq, remainder in zip(grads, params, exp_avgs, exp_avg_sqs, remainders):
            master = join_remainder(param.reshape(-1), remainder.reshape(-1))
            p, m, v = _step(grad, master, exp_avg, exp_avg_sq, hyper, step, bias_correction)
            high, low = split_remainder(p)
            _write(param, high)
            _write(remainder, low)
            _write(exp_avg, m)
            _write(exp_avg_sq, v)


def _declare_refused(kernel: str, *, stands_for: str, computes: str, why: str) -> None:
    """Declares the stand-in for transformer_engine_torch.<kernel> that raises NotEmulated naming it and why."""
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise NotEmulated(f"{kernel} is not emulated: {why}")

    refuse.__name__ = kernel
    stand_in(name=f"transformer_engine_torch.{kernel}", stands_for=stands_for, computes=computes)(refuse)


_declare_refused(
    "multi_tensor_adam_fp8", stands_for="TE 2.17's multi_tensor_adam_fp8 CUDA kernel (FP8 model weights)",
    computes="nothing: refused (NotEmulated); no tier holds FP8 parameters",
    why="FusedAdam's kernel for FP8 model weights (delayed-scaling Float8Tensor parameters), which no tier holds")
_declare_refused(
    "multi_tensor_adam_capturable",
    stands_for="TE 2.17's multi_tensor_adam_capturable CUDA kernel (FusedAdam(capturable=True))",
    computes="nothing: refused (NotEmulated); no tier builds a capturable FusedAdam",
    why="FusedAdam(capturable=True) (lr and step as device tensors, gradients unscaled in place, for CUDA graphs),"
        " which no tier builds")
_declare_refused(
    "multi_tensor_adam_capturable_master", stands_for="TE 2.17's multi_tensor_adam_capturable_master CUDA kernel",
    computes="nothing: refused (NotEmulated); no tier builds a capturable FusedAdam",
    why="FusedAdam(capturable=True, master_weights=True), which no tier builds")
