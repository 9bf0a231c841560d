"""Megatron's own weight-gradient accumulation over a step's microbatches, with and without
gradient-accumulation fusion (megatron-core 0.16.1), as the paths of the gradient-accumulation-
fusion lever.

What runs, per microbatch: megatron-core's `linear_with_grad_accumulation_and_async_allreduce`
(tensor_parallel/layers.py; the autograd Function `LinearWithGradAccumulationAndAsyncCommunication`)
forward and backward, on a BF16 weight that carries an FP32 `main_grad` (the view of the gradient
buffer Megatron's DDP gives every parameter) and `grad_added_to_main_grad`, with DDP's own
backward post-hook (`DistributedDataParallel._make_backward_post_hook`, distributed_data_parallel.py)
on the weight's gradient accumulator, registered as DDP registers it. The buffer starts at zero,
as DDP's `zero_grad_buffer` leaves it at the start of a step.
- Without the fusion (`--no-gradient-accumulation-fusion`): the backward returns
  `grad_output.t().matmul(total_input)` in BF16 (the GEMM accumulates in FP32 and rounds its
  output to BF16 once); autograd puts it in `weight.grad`; DDP's hook adds it into the FP32
  main_grad (`main_grad.add_(grad)`: the BF16 value upcast exactly, one FP32 rounding of the sum)
  and drops `weight.grad`. Each microbatch's gradient is rounded to BF16 once.
- With the fusion (Megatron-LM's default): the backward calls `fused_weight_gradient_mlp_cuda.
  wgrad_gemm_accum_fp32(total_input, grad_output, weight.main_grad)`, apex's cuBLAS GEMM with BF16
  operands, FP32 compute and output, alpha = beta = 1: main_grad += grad_output^T total_input, the
  products summed in FP32 and added to the buffer in FP32, never rounded to BF16. It then sets
  `grad_added_to_main_grad` and returns a dummy gradient, which DDP's hook does not add.
Transformer Engine's linears, which the recipes run (megatron/core/extensions/transformer_engine.py
passes `fuse_wgrad_accumulation=config.gradient_accumulation_fusion`), do the same in TE 2.17
(pytorch/module/linear.py and layernorm_linear.py): with the fusion the wgrad GEMM writes into
main_grad with out_dtype FP32 and accumulate=True; without it its out_dtype is the activation
dtype (BF16) and the result goes to `weight.grad` for DDP's hook.

On a machine without a GPU, `wgrad_on_cpu()` stands in for the CUDA-only pieces, for its duration:
- `fused_weight_gradient_mlp_cuda` (apex's extension, absent here: megatron-core binds the name
  only where the import succeeds) is `Fp32AccumulatingWgrad`: main_grad += the FP32 product of the
  BF16 operands (torch's FP32 CPU GEMM), the arithmetic of the cuBLAS call it stands for;
- `torch.cuda.current_device()` returns "cpu": the fused branch allocates its dummy gradient there
  (without TE, `torch.empty(..., device=torch.cuda.current_device())`);
- BF16 and FP16 matrix products of CPU tensors, forward and backward, are the FP32 product rounded
  once to the inputs' dtype, as cuBLAS computes them (correctness.cpu_gemm: torch's emulated BF16
  CPU GEMM is slow on hosts without BF16 hardware and its rounding is the host's). This is the
  non-fused wgrad GEMM's rounding, the quantity the lever measures: the FP32 accumulation rounded
  once to BF16.
The TP group is a one-rank stand-in (sequence_parallel and allreduce_dgrad are off: no collective
runs; the recipe's sequence-parallel all-gather only assembles the microbatch's tokens, which the
case gives whole). DDP's hook runs on a stand-in of DDP's own state: the weight in its bucket map,
overlap_grad_reduce off (no bucket is reduced: the lever judges the buffer before the reduction).
"""

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch

from correctness.megatron.process_groups import TensorParallelSize
from correctness.cpu_gemm import gemm_as_cublas
from correctness.errors import ImplementationUnavailable
from correctness.grad_accumulation.inputs import AccumulationInputs, tensor_name
from correctness.lever import ImplementationOutput
from correctness.provenance import megatron_core_version
from references.rounding import round_toward_zero

BUFFER_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DROPPED, STALE = "one microbatch dropped", "main_grad not zeroed (the previous step's gradient left in)"
# A wrong implementation in the candidate's format (correctness.grad_accumulation.wrong): the wgrad
# GEMM's output truncated to BF16 (its FP32 sum's low 16 bits dropped) instead of rounded to nearest.
TRUNCATED = "each microbatch's weight gradient truncated to BF16"
MUTATIONS = (DROPPED, STALE, TRUNCATED)
CPU_SHIMS = ("fused_weight_gradient_mlp_cuda -> FP32 GEMM accumulate", "cuda current_device -> cpu",
             "low-precision matmul as cuBLAS")


class Fp32AccumulatingWgrad:
    """Stands in for apex's fused_weight_gradient_mlp_cuda on the CPU (see the module docstring)."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        if main_grad.dtype != torch.float32:
            raise RuntimeError(f"wgrad_gemm_accum_fp32 takes an FP32 main_grad, got {main_grad.dtype}")
        main_grad.add_(torch.mm(grad_output.float().t(), total_input.float()))

    @staticmethod
    def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        main_grad.add_(torch.mm(grad_output.float().t(), total_input.float()).to(main_grad.dtype))


@contextlib.contextmanager
def wgrad_on_cpu() -> Iterator[None]:
    """The CPU shims of the module docstring, for the duration only."""
    from megatron.core.tensor_parallel import layers

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(layers, "fused_weight_gradient_mlp_cuda", Fp32AccumulatingWgrad,
                                              create=True))
        stack.enter_context(mock.patch.object(torch.cuda, "current_device", lambda: "cpu"))
        stack.enter_context(gemm_as_cublas())
        yield


def fused_extension() -> str | None:
    """Where apex's fused_weight_gradient_mlp_cuda imports: its module file; else None."""
    try:
        import fused_weight_gradient_mlp_cuda
    except ImportError:
        return None
    return getattr(fused_weight_gradient_mlp_cuda, "__file__", "fused_weight_gradient_mlp_cuda")


def register_ddp_hook(weight: torch.nn.Parameter) -> Any:
    """DDP's own backward post-hook on the weight's gradient accumulator, as DistributedDataParallel
    registers it, on a stand-in of DDP's state; returns the accumulator (DDP keeps it alive too)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    state = SimpleNamespace(param_to_bucket_group={weight: None}, force_all_reduce=False,
                            ddp_config=DistributedDataParallelConfig(overlap_grad_reduce=False))
    accumulator = weight.expand_as(weight).grad_fn.next_functions[0][0]
    accumulator.register_hook(DistributedDataParallel._make_backward_post_hook(state, weight))
    return accumulator


def check_hook_ran(weight: torch.nn.Parameter, accumulator: Any, m: int) -> None:
    """DDP's hook took the microbatch's gradient: weight.grad dropped, the hooked accumulator still the weight's."""
    if weight.grad is not None:
        raise RuntimeError(f"microbatch {m}: weight.grad left set after the backward (DDP's hook did not run)")
    if weight.expand_as(weight).grad_fn.next_functions[0][0] is not accumulator:
        raise RuntimeError(f"microbatch {m}: the weight's gradient accumulator changed; DDP's hook is no longer on it")


def previous_step_gradient(inputs: AccumulationInputs) -> torch.Tensor:
    """The buffer a step that was not zeroed starts from: the step before's gradient (its
    microbatches drawn for step -1), accumulated as the fused path does (FP32 products of the BF16
    values, FP32 sums)."""
    total = torch.zeros(inputs.shape.rows, inputs.shape.cols, dtype=torch.float32, device=inputs.device)
    for m in range(inputs.shape.microbatches):
        x, dy = inputs.microbatch(m, step=-1)
        total += dy.reshape(-1, inputs.shape.rows).float().t() @ x.reshape(-1, inputs.shape.cols).float()
    return total


@dataclass(frozen=True)
class MegatronWgrad:
    """A step's microbatches through Megatron's linear and DDP's hook, with or without the fusion,
    into a main_grad of `buffer` dtype; `mutation` (a negative control or a wrong implementation)
    one of MUTATIONS. TRUNCATED replaces the unfused backward's BF16 weight gradient, before autograd
    accumulates it (a hook on the weight), by the FP32 product truncated to BF16."""

    fused: bool
    buffer: str = "fp32"
    mutation: str | None = None

    def __post_init__(self):
        if self.buffer not in BUFFER_DTYPES:
            raise ValueError(f"wgrad path: buffer {self.buffer!r} is not one of {', '.join(BUFFER_DTYPES)}")
        if self.mutation is not None and self.mutation not in MUTATIONS:
            raise ValueError(f"wgrad path: unknown mutation {self.mutation!r} (one of {', '.join(MUTATIONS)})")
        if self.mutation == TRUNCATED and self.fused:
            raise ValueError(f"wgrad path: {TRUNCATED} is a mistake of the unfused path (the fused one never rounds)")

    @property
    def label(self) -> str:
        return f"megatron-wgrad-{'fused' if self.fused else 'unfused'}-{self.buffer}-main-grad"

    @property
    def name(self) -> str:
        return self.label if self.mutation is None else f"{self.label} ({self.mutation})"

    def run(self, inputs: AccumulationInputs) -> ImplementationOutput:
        try:
            from megatron.core.tensor_parallel.layers import linear_with_grad_accumulation_and_async_allreduce
        except Exception as error:  # noqa: BLE001 - any import failure makes the path unavailable
            raise ImplementationUnavailable(
                f"megatron-core is not usable here: {type(error).__name__}: {error}") from None
        on_cpu = inputs.device.type == "cpu"
        extension = None if on_cpu else fused_extension()
        if self.fused and not on_cpu and extension is None:
            raise ImplementationUnavailable(
                "apex's fused_weight_gradient_mlp_cuda is not installed: Megatron's fused wgrad"
                                  " branch cannot run on this GPU")
        clock = time.perf_counter()
        with wgrad_on_cpu() if on_cpu else contextlib.nullcontext():
            tensors, dropped = self._accumulate(inputs, linear_with_grad_accumulation_and_async_allreduce)
        details: dict[str, Any] = {
            "function": "megatron.core.tensor_parallel.layers.linear_with_grad_accumulation_and_async_allreduce",
            "megatron_core": megatron_core_version(),
            "gradient_accumulation_fusion": self.fused,
            "main_grad_dtype": self.buffer,
            "wgrad": ("fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32 into main_grad" if self.fused
                      else "BF16 GEMM output into weight.grad, added by DDP's backward post-hook"),
            "microbatches": inputs.shape.microbatches,
            "seconds": time.perf_counter() - clock,
            "shims": [*(CPU_SHIMS if on_cpu else ()), "DDP state stand-in for its hook", "TP group stand-in (size 1)"],
        }
        if extension is not None and self.fused:
            details["extension"] = extension
        if not on_cpu:  # where on (torch's default), cuBLAS may reduce a BF16 GEMM's split-K partial sums in BF16
            matmul = torch.backends.cuda.matmul
            details["bf16_reduced_precision_reduction"] = matmul.allow_bf16_reduced_precision_reduction
        backend = self.label
        if self.mutation:
            backend = f"{backend} (mutated: {self.mutation})"
            details["mutation"] = self.mutation
            if dropped is not None:
                details["dropped_microbatch"] = dropped
        return ImplementationOutput(tensors=tensors, backend=backend, details=details)

    def _accumulate(self, inputs: AccumulationInputs, linear) -> tuple[dict[str, torch.Tensor], int | None]:
        shape = inputs.shape
        weight = torch.nn.Parameter(inputs.weight.detach().clone())
        if self.mutation == STALE:
            weight.main_grad = previous_step_gradient(inputs).to(BUFFER_DTYPES[self.buffer])
        else:
            weight.main_grad = torch.zeros(shape.rows, shape.cols, dtype=BUFFER_DTYPES[self.buffer],
                                           device=inputs.device)
        weight.grad_added_to_main_grad = False
        accumulator = register_ddp_hook(weight)  # held for the step, as DDP holds its grad_accs
        dropped = inputs.smallest_microbatch if self.mutation == DROPPED else None
        counts, snapshots = set(shape.counts), {}
        tp_group = TensorParallelSize(1)
        current: dict[str, torch.Tensor] = {}
        if self.mutation == TRUNCATED:
            def truncated_product(grad: torch.Tensor) -> torch.Tensor:
                x, dy = current["x"], current["dy"]
                product = torch.mm(dy.reshape(-1, shape.rows).float().t(), x.reshape(-1, shape.cols).float())
                return round_toward_zero(product, torch.bfloat16).to(grad.dtype)

            weight.register_hook(truncated_product)
        for m in range(shape.microbatches):
            if m != dropped:
                x, dy = inputs.microbatch(m)
                current.update(x=x, dy=dy)
                out = linear(x, weight, None, gradient_accumulation_fusion=self.fused, allreduce_dgrad=False,
                             sequence_parallel=False, tp_group=tp_group)
                out.backward(dy)
                check_hook_ran(weight, accumulator, m)
            if m + 1 in counts:
                snapshots[tensor_name(m + 1)] = weight.main_grad.detach().float().clone()
        return snapshots, dropped
