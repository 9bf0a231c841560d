"""Triton's own interpreter as the emulated GPU's Triton compiler, where triton is installed.

With TRITON_INTERPRET=1 set when a module's kernels are defined (`@triton.jit` reads it then:
triton/runtime/jit.py, `jit`), each kernel becomes an InterpretedFunction, and a launch runs the
kernel's own code program by program on numpy arrays that alias the tensors' memory
(runtime/interpreter.py, `GridExecutor`). correctness.te_on_cpu imports TE (and, through
torch._dynamo, triton) with it set, and the emulated GPU's session enters `in_force()`, which sets
it for the session's launches (a `triton.constexpr_function` reads it at each call), so TE 2.17's
Triton kernels (transformer_engine/common/triton/: cross entropy, MoE permutation) are the upstream
code, interpreted, on the CPU tensors under the emulated GPU's. Triton's own library kernels
(`tl.cumsum`...) are interpreted only where triton itself was first imported with it set; a
kernel calling one that was not is refused (stand_ins/triton_launch).

`in_force()` also makes Triton's active driver an `EmulatedDriver`: the emulated GPU answers
torch.cuda.is_available(), so Triton would otherwise pick its CUDA driver, which needs libcuda, when
an autotuned kernel (`triton.autotune`: TE's permutation kernels) benchmarks its configs. The
emulated driver's benchmark times every config alike, so the autotuner keeps its first config:
every config computes the same, and no GPU time exists to choose by.

The interpreter keeps BF16 as its uint16 bit patterns and does not do BF16 arithmetic (Triton's
debugging guide says so; triton-lang/triton#10945, #11584, #11604): an add or multiply of two
BF16 values adds the bit patterns as integers, and an FP32 -> BF16 cast truncates where the GPU
rounds to nearest even. `gpu_bf16_builder` gives the interpreter's builder methods that do BF16 as
the GPU does: the operands' values in FP32, the op, the result rounded to nearest even; FP32 ->
BF16 casts rounded to nearest even; a BF16 constant (`get_bf16`, which triton 3.7's interpreter lacks).
A BF16 `tl.dot` or min/max/sum reduction on BF16 values is refused (NotEmulated): the
interpreter would compute it on bit patterns, and no kernel the tiers reach does one.
"""

import contextlib
import importlib.util
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from correctness.emulated_gpu.runtime import NotEmulated
from correctness.environment import attributes_replaced, environment_set

VARIABLE = "TRITON_INTERPRET"


def present() -> bool:
    """Whether triton (and so its interpreter) is installed here."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


class EmulatedDriver:
    """Triton's active driver on the emulated GPU: only the autotuner's benchmark is answered."""

    def get_benchmarker(self) -> Callable[..., list[float]]:
        def benchmark(kernel_call: Callable[[], Any], quantiles: tuple[float, ...] = (0.5,)) -> list[float]:
            return [1.0] * len(quantiles)  # every config alike: the autotuner keeps its first
        return benchmark

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise NotEmulated(f"Triton's driver.{name} on the emulated GPU (only the autotuner's benchmark is answered)")


@contextlib.contextmanager
def in_force() -> Iterator[None]:
    """TRITON_INTERPRET=1 for the block; where triton is installed, the EmulatedDriver active."""
    with environment_set({VARIABLE: "1"}):
        if not present():
            yield
            return
        from triton.runtime.driver import driver

        with attributes_replaced(driver, {"_active": EmulatedDriver()}):
            yield


def bf16_to_fp32(bits: np.ndarray) -> np.ndarray:
    """BF16 bit patterns (uint16, as the interpreter holds them) as their FP32 values (exact)."""
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def fp32_to_bf16(values: np.ndarray) -> np.ndarray:
    """FP32 values rounded to nearest even BF16, as uint16 bit patterns; NaN stays a quiet NaN."""
    values = np.asarray(values, dtype=np.float32)
    bits = values.view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    quiet_nan = ((bits >> 16) | np.uint32(0x0040)).astype(np.uint16)
    return np.where(np.isnan(values), quiet_nan, rounded)


def gpu_bf16_builder(builder: Any, interpreter: Any) -> dict[str, Callable[..., Any]]:
    """Methods for the interpreter's builder instance (`interpreter.interpreter_builder`) that
    compute BF16 as the GPU does; every other dtype goes to the builder's own methods."""
    tl = interpreter.tl
    handle = interpreter.TensorHandle
    bf16 = tl.bfloat16
    own = type(builder)

    def values(operand: Any) -> np.ndarray:
        return bf16_to_fp32(operand.data) if operand.dtype.scalar == bf16 else operand.data

    def cast_impl(src, dst_type):
        if bf16 not in (src.dtype.scalar, dst_type.scalar):
            return own.cast_impl(builder, src, dst_type)
        if dst_type.scalar == bf16:
            return handle(fp32_to_bf16(values(src).astype(np.float32)), bf16)
        return handle(values(src).astype(interpreter._get_np_dtype(dst_type)), dst_type.scalar)

    def binary_op(lhs, rhs, op):
        if lhs.dtype.scalar != bf16:
            return own.binary_op(builder, lhs, rhs, op)
        out = op(values(lhs), values(rhs))
        if out.dtype == np.bool_:  # a comparison: packed as the builder packs its own
            return own.binary_op(builder, lhs, rhs, lambda _a, _b: out)
        return handle(fp32_to_bf16(out.astype(np.float32)), bf16)

    def unary_op(arg, op):
        if arg.dtype.scalar != bf16:
            return own.unary_op(builder, arg, op)
        return handle(fp32_to_bf16(op(values(arg)).astype(np.float32)), bf16)

    def create_fma(x, y, z):
        if z.dtype.scalar != bf16:
            return own.create_fma(builder, x, y, z)
        exact = np.multiply(values(x), values(y), dtype=np.float64) + values(z)
        return handle(fp32_to_bf16(exact.astype(np.float32)), bf16)

    def get_bf16(value):
        return handle(fp32_to_bf16(np.array([value], dtype=np.float32)), bf16)

    def create_dot(a, b, *args):
        if bf16 in (a.dtype.scalar, b.dtype.scalar):
            raise NotEmulated("a BF16 tl.dot in Triton's interpreter (it multiplies the bit patterns:"
                              " triton-lang/triton#11584)")
        return own.create_dot(builder, a, b, *args)

    return {"cast_impl": cast_impl, "binary_op": binary_op, "unary_op": unary_op, "create_fma": create_fma,
            "get_bf16": get_bf16, "create_dot": create_dot}


def bf16_reductions_refused(interpreter: Any) -> dict[str, Callable[..., Any]]:
    """ReduceOps methods that refuse BF16 values (the interpreter reduces their bit patterns)."""
    reduce_ops = interpreter.ReduceOps
    bf16 = interpreter.tl.bfloat16

    def refused(input: Any, what: str) -> None:
        value = input[0] if isinstance(input, tuple) else input
        if value.dtype.scalar == bf16:
            raise NotEmulated(f"a BF16 {what} reduction in Triton's interpreter (it reduces the bit patterns:"
                              " triton-lang/triton#11604)")

    def min_max(self, input, val_reduce_op, idx_reduce_op=None):
        refused(input, "min/max")
        return own_min_max(self, input, val_reduce_op, idx_reduce_op)

    def sum(self, input):  # noqa: A001 - the method's name in ReduceOps
        refused(input, "sum")
        return own_sum(self, input)

    own_min_max, own_sum = reduce_ops.min_max, reduce_ops.sum
    return {"min_max": min_max, "sum": sum}
