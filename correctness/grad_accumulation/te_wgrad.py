"""Transformer Engine's Linear (TE 2.17, pytorch/module/linear.py) accumulating a step's weight
gradients into an FP32 main_grad, the GPU tier's fused default where apex's
fused_weight_gradient_mlp_cuda (Megatron's own fused branch) is not installed.

`te.Linear(cols, rows, bias=False, params_dtype=BF16, fuse_wgrad_accumulation=...)` is what
Megatron's TE linears build (megatron/core/extensions/transformer_engine.py passes
`fuse_wgrad_accumulation=config.gradient_accumulation_fusion`). With the fusion, TE's backward reads
`weight.main_grad` and runs its wgrad GEMM (general_gemm, layout "NT") with `out=main_grad`,
`out_dtype=main_grad.dtype` (FP32) and `accumulate=True` (is_first_microbatch is None), then sets
`grad_added_to_main_grad` and returns a dummy gradient; without it the GEMM's out_dtype is the
activation dtype (BF16) and the result goes to `weight.grad`. DDP's own hook (registered as in
megatron_wgrad.py) does the rest either way.
"""

import time
from dataclasses import dataclass
from typing import Any

import torch

from correctness.errors import ImplementationUnavailable
from correctness.grad_accumulation.inputs import DTYPES, AccumulationInputs, tensor_name
from correctness.grad_accumulation.megatron_wgrad import check_hook_ran, register_ddp_hook
from correctness.lever import ImplementationOutput


@dataclass(frozen=True)
class TeWgrad:
    fused: bool

    @property
    def name(self) -> str:
        return f"te-linear-wgrad-{'fused' if self.fused else 'unfused'}-fp32-main-grad"

    def run(self, inputs: AccumulationInputs) -> ImplementationOutput:
        if inputs.device.type != "cuda":
            raise ImplementationUnavailable("Transformer Engine's Linear runs on a CUDA GPU only")
        try:
            import transformer_engine
            import transformer_engine.pytorch as te
        except Exception as error:  # noqa: BLE001 - any import failure makes the path unavailable
            raise ImplementationUnavailable(
                f"Transformer Engine is not usable here: {type(error).__name__}: {error}") from None
        shape = inputs.shape
        clock = time.perf_counter()
        linear = te.Linear(shape.cols, shape.rows, bias=False, params_dtype=DTYPES[shape.dtype], device=inputs.device,
                           fuse_wgrad_accumulation=self.fused)
        weight = linear.weight
        with torch.no_grad():
            weight.copy_(inputs.weight)
        weight.main_grad = torch.zeros(shape.rows, shape.cols, dtype=torch.float32, device=inputs.device)
        weight.grad_added_to_main_grad = False
        accumulator = register_ddp_hook(weight)  # held for the step, as DDP holds its grad_accs
        counts, tensors = set(shape.counts), {}
        for m in range(shape.microbatches):
            x, dy = inputs.microbatch(m)
            linear(x).backward(dy)
            check_hook_ran(weight, accumulator, m)
            if m + 1 in counts:
                tensors[tensor_name(m + 1)] = weight.main_grad.detach().float().clone()
        torch.cuda.synchronize(inputs.device)
        details: dict[str, Any] = {
            "module": "transformer_engine.pytorch.Linear",
            "transformer_engine": getattr(transformer_engine, "__version__", "unknown"),
            "fuse_wgrad_accumulation": self.fused,
            "main_grad_dtype": "fp32",
            "microbatches": shape.microbatches,
            "seconds": time.perf_counter() - clock,
            "shims": ["DDP state stand-in for its hook"],
        }
        return ImplementationOutput(tensors=tensors, backend=self.name, details=details)
