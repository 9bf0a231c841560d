"""Where each tensor lives on the emulated machine: the GPU the code placed it on, or the CPU.

Every tensor is a CPU tensor underneath; this module remembers which ones the code put on the
emulated GPU, and holds the code to a real device's rules:

- `PlacementTable` keeps, per storage, the emulated device it is on (a CUDA index) or `FREE`;
  a storage it does not know is on the CPU. Views share their base's storage, so they share its
  place. A storage freed and its address reused is recognised (a weak reference to the old one).
- `PlacementMode`, a torch dispatch mode, sees every operator call, the autograd engine's included:
  an operator given tensors on two devices (a GPU tensor and a CPU tensor that is not a 0-dim
  scalar, or two GPUs) raises torch's own "Expected all tensors to be on the same device"; its
  outputs are placed where its inputs were. A factory asked for `device="cuda"` is run on the CPU
  and its result placed on the GPU (torch.cuda._lazy_init is a no-op under the emulation, so such
  calls reach the dispatcher).
- `FREE`: a tensor made inside a composite operator or a backward formula with no tensor input and
  no device of its own (`at::empty(sizes, other.options())`, whose device torch fills from a tensor
  the dispatcher does not show). It takes the place of the first tensor it meets.
- Moves (`.to`, `.cuda()`, `.cpu()`, `torch.tensor(..., device=...)`) are the Tensor attributes of
  correctness.emulated_gpu.tensor_attributes; they copy and place here, and their backward moves the
  gradient back (`Moved`).
"""

import threading
from dataclasses import dataclass
from collections.abc import Iterable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

from correctness.cpu_gemm import product_as_cublas

CPU = -1
FREE = -2
PINNED = -3  # on the CPU, in page-locked memory (pin_memory): a CPU place for every rule

aten = torch.ops.aten


class Placements:
    """Per storage, the emulated place of the tensors on it."""

    def __init__(self) -> None:
        self._places: dict[Any, tuple[Any, int, int]] = {}  # key -> (weak reference, place, bytes)
        self._lock = threading.Lock()
        self._puts = 0
        self.allocated = {}  # device -> bytes of live storages placed there (as last counted)
        self.peak = {}

    @staticmethod
    def _key(tensor: torch.Tensor) -> tuple[Any, Any, int]:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):  # a wrapper subclass: no storage of its own
            import weakref

            return ("object", id(tensor)), weakref.ref(tensor), 0
        return storage._cdata, StorageWeakRef(storage), storage.nbytes()

    def of(self, tensor: torch.Tensor) -> int:
        try:  # the key alone: a weak reference is made only where a place is put
            key = tensor.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError, TypeError):
            key = ("object", id(tensor))
        entry = self._places.get(key)
        if entry is None:
            return CPU
        reference, place, _ = entry
        if _expired(reference):
            with self._lock:
                self._places.pop(key, None)
            return CPU
        return place

    def put(self, tensor: torch.Tensor, place: int) -> None:
        key, reference, size = self._key(tensor)
        with self._lock:
            if place == CPU:
                self._places.pop(key, None)
            else:
                self._places[key] = (reference, place, size)
            self._puts += 1
            if self._puts % 4096 == 0:
                self._forget_expired()

    def _forget_expired(self) -> None:
        for key in [key for key, (reference, _, _) in self._places.items() if _expired(reference)]:
            del self._places[key]

    def bytes_on(self, device: int) -> int:
        """Bytes of the live storages placed on `device` now."""
        with self._lock:
            self._forget_expired()
            return sum(size for _, place, size in self._places.values() if place == device)

    def clear(self) -> None:
        with self._lock:
            self._places.clear()


def _expired(reference: Any) -> bool:
    if isinstance(reference, StorageWeakRef):
        return reference.expired()
    return reference() is None


PLACES = Placements()


def place_of(tensor: torch.Tensor) -> int:
    return PLACES.of(tensor)


def on_gpu(tensor: torch.Tensor) -> bool:
    return PLACES.of(tensor) >= 0


def place_name(place: int) -> str:
    if place >= 0:
        return f"cuda:{place}"
    return {CPU: "cpu", PINNED: "cpu (pinned)", FREE: "unplaced"}[place]


def device_of_place(place: int) -> torch.device:
    return torch.device("cuda", place) if place >= 0 else torch.device("cpu")


class DeviceMismatch(RuntimeError):
    """torch's own error for tensors on two devices in one operator, as a real GPU raises it."""


# Copies into a destination, which may be on another device, as on a real GPU: the destination
# keeps its place.
_KEEP_PLACE = {
    aten.copy_.default, aten._copy_from.default, aten._copy_from_and_resize.default,
    aten.set_.source_Storage, aten.set_.source_Storage_storage_offset, aten.set_.source_Tensor,
}
# Moves: placed by the caller (correctness.emulated_gpu.tensor_attributes) or, asked for inside
# torch with a device, on that device.
_MOVES = {aten._to_copy.default, aten.to.device, aten.to.dtype_layout, aten.to.other, aten.to.dtype}
_CROSS_DEVICE = {*_KEEP_PLACE, *_MOVES, aten.lift_fresh.default, aten.is_same_size.default,
                 aten._has_compatible_shallow_copy_type.default}
# Advanced indexing takes CPU index tensors with a GPU tensor (torch moves them).
_INDEX_ARGUMENT = {aten.index.Tensor: 1, aten.index_put_.default: 1, aten.index_put.default: 1,
                   aten._index_put_impl_.default: 1, aten._unsafe_index.Tensor: 1,
                   aten._unsafe_index_put.default: 1}


@dataclass(frozen=True)
class _Operator:
    """What the placement rules need to know of an operator, worked out once per operator (an
    OpOverload hashes in Python: a set lookup per call is a measurable share of the mode's cost)."""

    body: Any  # a custom op's Python body (_custom_op_body), or None
    keeps_place: bool
    moves: bool
    cross_device: bool
    index_position: int | None
    pinning: bool
    product: bool  # a GEMM correctness.cpu_gemm may compute as cuBLAS
    seeded: bool  # draws random numbers


_OPERATORS: dict[int, _Operator] = {}
_PRODUCT_OPERATORS = {aten.mm.default, aten.bmm.default, aten.baddbmm.default}


def _operator(func) -> _Operator:
    known = _OPERATORS.get(id(func))
    if known is None:
        known = _OPERATORS[id(func)] = _Operator(
            body=_custom_op_body(func), keeps_place=func in _KEEP_PLACE, moves=func in _MOVES,
            cross_device=func in _CROSS_DEVICE, index_position=_INDEX_ARGUMENT.get(func),
            pinning=func in (aten._pin_memory.default, aten.is_pinned.default), product=func in _PRODUCT_OPERATORS,
            seeded=torch.Tag.nondeterministic_seeded in func.tags)
    return known


def _tensors(values: Iterable[Any]) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(_tensors(value))
        elif isinstance(value, dict):
            found.extend(_tensors(value.values()))
    return found


def _cuda_device(value: Any) -> int | None:
    """The emulated GPU a device argument names (its index), None where it names none."""
    if value is None:
        return None
    if isinstance(value, torch.device):
        device = value
    elif isinstance(value, str):
        device = torch.device(value)
    elif isinstance(value, int) and not isinstance(value, bool):
        device = torch.device("cuda", value)
    else:
        return None
    if device.type != "cuda":
        return None
    from correctness.emulated_gpu.runtime import current_device

    return device.index if device.index is not None else current_device()


class Ambient(threading.local):
    """The place for tensors made with no tensor input and no device, set around a call whose
    place is known (a move, a Python-level factory, a backward started from GPU tensors)."""

    place: int | None = None


AMBIENT = Ambient()


class PlacementMode(TorchDispatchMode):
    """The dispatch mode that keeps the placement rules (the module's docstring)."""

    def __init__(self, gpu_name: str) -> None:
        super().__init__()
        self.gpu_name = gpu_name

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """No dynamo-disabling wrapper around the handler (a frame-callback swap per operator): torch.compile
        is off under the emulation (TORCH_COMPILE_DISABLE), so nothing traces through it."""
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        operator = _OPERATORS.get(id(func)) or _operator(func)
        if operator.body is not None:
            with self:  # its Python body's operators keep these rules, as its CUDA kernel's would meet them
                return operator.body(*args, **kwargs)
        device = kwargs.get("device")
        target = None if device is None else _cuda_device(device)
        if target is not None:
            kwargs = {**kwargs, "device": torch.device("cpu")}
        if operator.pinning:
            return _pinning(func, args)
        pinned = target is None and kwargs.get("pin_memory") is True  # torch.empty(..., pin_memory=True)
        if pinned:
            kwargs = {**kwargs, "pin_memory": False}  # page-locked memory is ordinary CPU memory here, placed PINNED
        place = target if target is not None else self._place_of_call(func, operator, args, kwargs)
        out = self._run(func, operator, args, kwargs, place)
        if operator.keeps_place:
            return out  # a copy into its destination, which keeps its place
        if operator.moves and target is None and kwargs.get("device") is not None:
            # A move to the CPU asked for inside torch (a backward's), except where torch passes a GPU
            # tensor's own options, whose device is the CPU underneath: a call made with GPU tensors (the
            # backward of a dtype conversion, type_as) keeps their place.
            source = PLACES.of(args[0])
            place = source if source >= 0 and AMBIENT.place == source else CPU
        elif place is None:
            place = AMBIENT.place if AMBIENT.place is not None else FREE
        if pinned:
            place = PINNED
        if isinstance(out, torch.Tensor):
            if (not args or out is not args[0]) and PLACES.of(out) != place:  # an in-place result keeps its place
                PLACES.put(out, place)
            return out
        for tensor in _tensors((out,)):
            if PLACES.of(tensor) != place:
                PLACES.put(tensor, place)
        return out

    @staticmethod
    def _run(func, operator: _Operator, args, kwargs, place):
        if place is not None and place >= 0:
            product = product_as_cublas(func, args, kwargs) if operator.product else None
            if product is not None:
                return product
            if operator.seeded and kwargs.get("generator") is None:
                from correctness.emulated_gpu.runtime import drawing_from

                with drawing_from(place):
                    return func(*args, **kwargs)
        return func(*args, **kwargs)

    def _place_of_call(self, func, operator: _Operator, args, kwargs) -> int | None:
        """The place of an operator's tensor inputs (None: it has none with a place); raises where
        they are on two devices."""
        index_position = operator.index_position
        gpus: dict[int, int] = {}  # place -> the position of its first argument
        cpu: int | None = None  # the position of the first CPU argument that is no scalar
        free: list[torch.Tensor] = []
        for position, value in enumerate((*args, *kwargs.values())):
            for tensor in ((value,) if isinstance(value, torch.Tensor) else _tensors((value,))):
                place = PLACES.of(tensor)
                if place >= 0:
                    gpus.setdefault(place, position)
                elif place == FREE:
                    free.append(tensor)
                elif cpu is None and position != index_position and tensor.dim() > 0:
                    cpu = position
        if operator.cross_device:
            return None
        if len(gpus) > 1 or (gpus and cpu is not None):
            devices = [f"cuda:{index}" for index in gpus] + (["cpu"] if cpu is not None else [])
            named = _argument_name(func, cpu if cpu is not None else list(gpus.values())[-1])
            raise DeviceMismatch(
                f"Expected all tensors to be on the same device, but found at least two devices, {devices[0]} and"
                f" {devices[1]}! ({func} on the emulated {self.gpu_name}: argument {named} is on {devices[-1]})")
        if gpus:
            place = next(iter(gpus))
            for tensor in free:
                PLACES.put(tensor, place)
            return place
        if cpu is not None:
            return CPU
        return None


def _custom_op_body(func) -> Any:
    """The Python function a torch.library custom op (TE's te_moe permutation) runs, its CUDA kernel's
    where it registers one; None for torch's own operators and for ops without a Python body."""
    if getattr(func, "namespace", "aten") in ("aten", "prims"):
        return None
    from torch._library.custom_ops import OPDEFS

    definition = OPDEFS.get(func._schema.name)
    if definition is None:
        return None
    return definition._backend_fns.get("cuda") or definition._backend_fns.get(None)


def _argument_name(func, position: int) -> str:
    try:
        return func._schema.arguments[position].name
    except (AttributeError, IndexError):
        return f"#{position}"


def _pinning(func, args):
    """`pin_memory()` is a copy in ordinary CPU memory, placed PINNED; `is_pinned()` reads that place."""
    tensor = args[0]
    if func is aten.is_pinned.default:
        return PLACES.of(tensor) == PINNED
    if PLACES.of(tensor) >= 0:
        raise RuntimeError(f"cannot pin '{torch.Tensor.type(tensor)}' only dense CPU tensors can be pinned"
                           " (a tensor on the emulated GPU)")
    copy = tensor.clone()
    PLACES.put(copy, PINNED)
    return copy


class AmbientMode(TorchFunctionMode):
    """Sets AMBIENT around each Python-level torch call to that call's place: its device argument,
    else the GPU of a tensor argument on one, else the CPU. A factory inside a composite operator
    called with GPU tensors then lands on that GPU, and `torch.zeros(3)` written in Python on the
    CPU, as on a real machine."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) == "__get__":  # a property (shape, dtype, grad, data): it makes no tensor of its own
            return func(*args)
        kwargs = kwargs or {}
        if isinstance(kwargs.get("device"), int) and not isinstance(kwargs["device"], bool):
            # A bare index names the current accelerator's device (TE: torch.empty(..., device=0)); torch's
            # argument parser would look for a CUDA build first.
            kwargs = {**kwargs, "device": torch.device("cuda", kwargs["device"])}
        saved = AMBIENT.place
        AMBIENT.place = _call_place(args, kwargs)
        try:
            return func(*args, **kwargs)
        finally:
            AMBIENT.place = saved


def _call_place(args, kwargs) -> int:
    named = _cuda_device(kwargs.get("device")) if "device" in kwargs else None
    if named is not None:
        return named
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            place = PLACES.of(value)
            if place >= 0:
                return place
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, torch.Tensor):
                    place = PLACES.of(item)
                    if place >= 0:
                        return place
    return CPU


class Moved(torch.autograd.Function):
    """A copy to another place, whose backward moves the gradient back to where the input was."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, place: int, dtype: torch.dtype | None, memory_format: Any):
        ctx.source = PLACES.of(tensor)
        ctx.dtype = tensor.dtype
        options = {"dtype": dtype or tensor.dtype, "copy": True}
        if memory_format is not None:
            options["memory_format"] = memory_format
        out = torch._C.TensorBase.to(tensor, **options)
        PLACES.put(out, place)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = torch._C.TensorBase.to(grad, dtype=ctx.dtype, copy=True)
        PLACES.put(back, CPU if ctx.source in (FREE, PINNED) else ctx.source)
        return back, None, None, None


def moved(tensor: torch.Tensor, place: int, dtype: torch.dtype | None = None, memory_format: Any = None) -> torch.Tensor:
    """A copy of `tensor` at `place` (and `dtype`), with a gradient that goes back."""
    if tensor.requires_grad and torch.is_grad_enabled():
        return Moved.apply(tensor, place, dtype, memory_format)
    with torch.no_grad():
        return Moved.forward(_Context(), tensor, place, dtype, memory_format)


class _Context:
    """Moved.forward's ctx where no graph is built."""


def place_all(value: Any, place: int) -> Any:
    """Put every tensor in `value` (a tensor, or a structure of them) at `place`; returns `value`."""
    tree_map_only(torch.Tensor, lambda tensor: PLACES.put(tensor, place), value)
    return value
