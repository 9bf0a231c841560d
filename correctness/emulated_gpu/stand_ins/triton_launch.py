"""A Triton kernel's launch on the emulated GPU, where triton is installed: the kernel's own code
in Triton's interpreter (correctness.emulated_gpu.triton_interpreter).

Installed as `triton.runtime.interpreter.GridExecutor`, which an interpreted kernel's launch
(`kernel[grid](...)`: InterpretedFunction.run) builds and calls once per launch. The stand-in
refuses a tensor argument the code never moved to the GPU, as Triton's launcher does on a GPU
("Pointer argument cannot be accessed from Triton (cpu tensor?)"), then runs the interpreter's own
executor with BF16 computed as the GPU computes it. Where triton is not installed nothing is
declared here: the Triton functions TE calls have stand-ins of their own (te_cross_entropy).
"""

import contextlib
from typing import Any

import torch

from correctness.emulated_gpu import triton_interpreter
from correctness.emulated_gpu.kernels import require_on_gpu, stand_in
from correctness.emulated_gpu.runtime import NotEmulated
from correctness.environment import attributes_replaced

if triton_interpreter.present():
    from triton.runtime import interpreter as _interpreter

    _GRID_EXECUTOR = _interpreter.GridExecutor
    COMPILED_LIBRARY = "Cannot call @triton.jit'd outside of the scope of a kernel"  # triton/runtime/jit.py

    class InterpretedLaunch:
        """One launch of an interpreted kernel over its grid."""

        def __init__(self, fn: Any, arg_names: Any, grid: Any, pre_run_hooks: Any = ()):
            self.kernel = getattr(fn, "__name__", "kernel")
            self.arg_names = list(arg_names)
            self.executor = _GRID_EXECUTOR(fn, arg_names, grid, list(pre_run_hooks))

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            named = {**dict(zip(self.arg_names, args)), **kwargs}
            require_on_gpu(f"Triton kernel {self.kernel}",
                           **{name: value for name, value in named.items() if isinstance(value, torch.Tensor)})
            builder = _interpreter.interpreter_builder
            with contextlib.ExitStack() as stack:
                stack.enter_context(attributes_replaced(
                    builder, triton_interpreter.gpu_bf16_builder(builder, _interpreter)))
                stack.enter_context(attributes_replaced(
                    _interpreter.ReduceOps, triton_interpreter.bf16_reductions_refused(_interpreter)))
                try:
                    return self.executor(*args, **kwargs)
                except _interpreter.InterpreterError as error:
                    if COMPILED_LIBRARY in str(error):
                        raise NotEmulated(
                            f"Triton kernel {self.kernel} calls a Triton library kernel that was defined compiled:"
                            f" triton was imported before {triton_interpreter.VARIABLE}=1 was set (start the process"
                            f" with it set, or the emulated GPU before anything imports torch._dynamo)") from error
                    raise

    @stand_in(name="triton.runtime.interpreter.GridExecutor",
              stands_for="a Triton kernel's launch on the GPU (TE 2.17's cross-entropy kernels; any other a tier"
                         " launches)",
              computes="the kernel's own code in Triton's interpreter (TRITON_INTERPRET=1: numpy, one program at a"
                       " time), each tensor argument required on the GPU; BF16 arithmetic and FP32 -> BF16 casts as"
                       " the GPU does them (in FP32, rounded to nearest even), not on the interpreter's bit patterns")
    def interpreted_launch(fn: Any, arg_names: Any, grid: Any, pre_run_hooks: Any = ()) -> InterpretedLaunch:
        return InterpretedLaunch(fn, arg_names, grid, pre_run_hooks)
