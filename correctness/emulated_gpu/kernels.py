"""The GPU kernels the tiers call, each with a named stand-in on the emulated GPU.

A stand-in is declared once (`KernelStandIn`): what it stands for, what it computes, and where it
is installed: a name of TE's compiled extension (`transformer_engine_torch.<name>`, consulted by
correctness.te_on_cpu's stand-in extension at each call) or an attribute of a module (torch's
SDPA entry, megatron-core's fused kernels, torch.distributed's NCCL). Every call is counted, so that
a record says which stand-ins its cases ran (`stand_ins_called`). A stand-in refuses a tensor the
code never moved to the GPU, as the kernel would (`require_on_gpu`).

Stand-ins prove that the code around a kernel runs: its arguments, layouts, placements and
bookkeeping. What they compute is documented arithmetic done on the CPU, never the GPU kernel's own
numbers, and a record made with them is never evidence (correctness.emulated_gpu.session.provenance).
"""

import contextlib
import importlib
import pkgutil
import sys
import threading
import types
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from correctness.emulated_gpu.gpus import Emulated
from correctness.emulated_gpu.placement import PLACES, place_name

TE_EXTENSION = "transformer_engine_torch"


@dataclass(frozen=True, kw_only=True)
class KernelStandIn:
    name: str  # where it is installed: "transformer_engine_torch.fused_attn_fwd", "torch.nn.functional.x"
    stands_for: str  # the GPU kernel, in its project's words
    computes: str  # what the stand-in computes on the CPU
    function: Callable[..., Any]

    @property
    def owner(self) -> str:
        return self.name.rpartition(".")[0]

    @property
    def attribute(self) -> str:
        return self.name.rpartition(".")[2]


_lock = threading.Lock()
CALLS: Counter = Counter()
_REGISTERED: dict[str, KernelStandIn] = {}
STAND_IN_PACKAGE = "correctness.emulated_gpu.stand_ins"  # its modules declare the stand-ins


def stand_in(*, name: str, stands_for: str, computes: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declares the decorated function the stand-in installed at `name`."""
    def register(function: Callable[..., Any]) -> Callable[..., Any]:
        if name in _REGISTERED:
            raise ValueError(f"two stand-ins for {name}")
        _REGISTERED[name] = KernelStandIn(name=name, stands_for=stands_for, computes=computes, function=function)
        return function
    return register


def registered() -> dict[str, KernelStandIn]:
    """Every stand-in declared by the modules of correctness.emulated_gpu.stand_ins."""
    package = importlib.import_module(STAND_IN_PACKAGE)
    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{STAND_IN_PACKAGE}.{module.name}")
    return dict(_REGISTERED)


def _counted(declared: KernelStandIn) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        with _lock:
            CALLS[declared.name] += 1
        return declared.function(*args, **kwargs)

    call.__name__ = declared.attribute
    call.__doc__ = f"Emulated-GPU stand-in for {declared.stands_for}: {declared.computes}"
    call.stand_in = declared
    return call


def stand_ins_called(since: Counter | None = None) -> dict[str, dict[str, Any]]:
    """Each stand-in called (since the `since` snapshot of CALLS): what it stands for, what it
    computes, and how many calls."""
    with _lock:
        calls = CALLS - since if since is not None else Counter(CALLS)
    return described(calls)


def described(calls: Counter) -> dict[str, dict[str, Any]]:
    """Calls of stand-ins (name -> count) as a record says them."""
    return {name: {"stands_for": _REGISTERED[name].stands_for, "computes": _REGISTERED[name].computes, "calls": count}
            for name, count in sorted(calls.items()) if count > 0}


def snapshot() -> Counter:
    with _lock:
        return Counter(CALLS)


def add_calls(calls: Counter) -> None:
    """Stand-in calls made in another process (a rank, correctness.distributed) counted here too."""
    with _lock:
        CALLS.update(calls)


class NotOnGpu(RuntimeError):
    """A kernel was handed a tensor the code never moved to the GPU."""


def require_on_gpu(kernel: str, **tensors: Any) -> None:
    """Raise as a CUDA kernel's launcher does where an argument is not a GPU tensor (None: absent)."""
    for name, tensor in tensors.items():
        if isinstance(tensor, torch.Tensor) and PLACES.of(tensor) < 0:
            raise NotOnGpu(f"{kernel}: {name} is on {place_name(PLACES.of(tensor))}, not on the GPU"
                           " (Expected all tensors to be on the same device; a CUDA kernel reads GPU memory only)")


@contextlib.contextmanager
def installed(emulation: Emulated) -> Iterator[None]:
    """Every declared stand-in in place for the block (TE's only where TE's Python is installed for
    the CPU: there `transformer_engine` imports for the block)."""
    from correctness import te_on_cpu
    from correctness.environment import attributes_replaced

    declared = registered()
    te_names = {stand.attribute: _counted(stand) for stand in declared.values() if stand.owner == TE_EXTENSION}
    others: dict[str, dict[str, Any]] = {}
    for stand in declared.values():
        if stand.owner != TE_EXTENSION:
            others.setdefault(stand.owner, {})[stand.attribute] = _counted(stand)
    with contextlib.ExitStack() as stack:
        stack.enter_context(attributes_replaced(te_on_cpu, {"COMPILED_STAND_INS": {}}))
        te_on_cpu.COMPILED_STAND_INS.update(te_names)
        # TE first: megatron-core decides HAVE_TE when its modules are imported, below.
        if te_on_cpu.missing_reason() is None and not te_on_cpu.machine_has_own_te():
            stack.enter_context(te_on_cpu.te_modules())
        for owner, attributes in others.items():
            module = _importable(owner)
            if module is None and "." not in owner:  # a compiled extension absent here (Apex's fused softmax)
                module = stack.enter_context(_absent_extension(owner))
            if module is not None:
                stack.enter_context(attributes_replaced(module, attributes))
        yield


@contextlib.contextmanager
def _absent_extension(name: str) -> Iterator[types.ModuleType]:
    """An empty top-level module `name` in sys.modules for the block: a compiled CUDA extension not
    installed here, whose functions are all stand-ins (`import scaled_masked_softmax_cuda` then
    finds them, as on a training image)."""
    module = types.ModuleType(name, f"emulated-GPU stand-in for the compiled extension {name}")
    sys.modules[name] = module
    try:
        yield module
    finally:
        sys.modules.pop(name, None)


def _importable(name: str) -> Any:
    """The module `name`, imported; None where it is not installed (megatron-core's kernels on a
    machine without it)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None
