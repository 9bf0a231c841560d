"""torch.Tensor's device attributes and moves on the emulated machine, and the factories that take
data (`torch.tensor`), which a CPU build of torch refuses for CUDA before any operator runs.

Set on `torch.Tensor` (the Python class every tensor is, above the compiled TensorBase), so that
Python code anywhere, TE's backward functions included, reads a tensor's emulated place:
- `device`, `is_cuda`, `is_cpu`, `get_device()`, `type()`: the place the code gave it
  (correctness.emulated_gpu.placement);
- `to`, `cuda`, `cpu`: a copy placed where asked, with a backward that moves the gradient back;
  a tensor already there is returned as it is, as torch does;
- `numpy()` on a GPU tensor raises torch's own TypeError;
- `record_stream`: a no-op (correctness.emulated_gpu.runtime);
- `copy_` into a wrapper subclass made on "cuda" (TE's Float8Tensor) dispatched without the Python
  binding's CUDA device guard;
- `new_tensor`, and `torch.tensor` / `torch.as_tensor` with a device: made on the CPU, then placed.
"""

from typing import Any

import torch

from correctness.emulated_gpu.placement import (AMBIENT, CPU, FREE, PINNED, PLACES, _cuda_device, device_of_place,
                                                moved)

_BASE = torch._C.TensorBase
_TYPE_NAMES = {torch.float32: "FloatTensor", torch.float64: "DoubleTensor", torch.float16: "HalfTensor",
               torch.bfloat16: "BFloat16Tensor", torch.int64: "LongTensor", torch.int32: "IntTensor",
               torch.int16: "ShortTensor", torch.int8: "CharTensor", torch.uint8: "ByteTensor",
               torch.bool: "BoolTensor"}


def _place_of_device(device: Any) -> int:
    index = _cuda_device(device)
    return CPU if index is None else index


def _device(self: torch.Tensor) -> torch.device:
    place = PLACES.of(self)
    return device_of_place(place) if place >= 0 else _BASE.device.__get__(self)


def _is_cuda(self: torch.Tensor) -> bool:
    return PLACES.of(self) >= 0


def _is_cpu(self: torch.Tensor) -> bool:
    return PLACES.of(self) < 0 and _BASE.is_cpu.__get__(self)


def _get_device(self: torch.Tensor) -> int:
    place = PLACES.of(self)
    return place if place >= 0 else -1


def _type(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
    if dtype is None and not kwargs and PLACES.of(self) >= 0:
        return f"torch.cuda.{_TYPE_NAMES.get(self.dtype, 'Tensor')}"
    return _BASE.type(self, dtype, non_blocking, **kwargs) if dtype is not None else _BASE.type(self)


def _same_place(current: int, target: int) -> bool:
    if current == FREE:
        return True
    if current == PINNED:
        return target == CPU
    return current == target


def _to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    copy = kwargs.pop("copy", False)
    if len(args) >= 4 and isinstance(args[3], bool):
        copy, args = args[3], args[:3]
    if args and isinstance(args[0], torch.Tensor):
        other = args[0]
        device, dtype = _device(other), other.dtype
        non_blocking = args[1] if len(args) > 1 else kwargs.get("non_blocking", False)
        memory_format = kwargs.get("memory_format")
    else:
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(
            *[_cpu_if_cuda(arg) for arg in args], **{key: _cpu_if_cuda(value) if key == "device" else value
                                                    for key, value in kwargs.items()})
        device = _named_device(args, kwargs, device)
    options = {"copy": copy, "non_blocking": non_blocking}
    if dtype is not None:
        options["dtype"] = dtype
    if memory_format is not None:
        options["memory_format"] = memory_format
    if device is None:
        return _BASE.to(self, **options)
    target = _place_of_device(device)
    current = PLACES.of(self)
    if _same_place(current, target):
        if current == FREE and target != CPU:
            PLACES.put(self, target)
        return _BASE.to(self, **options)
    return _with_ambient(target, lambda: moved(self, target, dtype, memory_format))


def _cpu_if_cuda(value: Any) -> Any:
    """A device argument for torch's own parser, which would initialise CUDA for a CUDA device."""
    if _cuda_device(value) is not None:
        return torch.device("cpu")
    return value


def _named_device(args: tuple, kwargs: dict, parsed: torch.device | None) -> Any:
    """The device a `.to` call names, read before the parser's CPU stand-in replaced it."""
    for value in (kwargs.get("device"), *args):
        if isinstance(value, (str, torch.device)) or (isinstance(value, int) and not isinstance(value, bool)):
            try:
                return torch.device(value) if not isinstance(value, int) else torch.device("cuda", value)
            except (RuntimeError, TypeError):
                continue
    return parsed


def _cuda(self: torch.Tensor, device: Any = None, non_blocking: bool = False,
          memory_format: Any = torch.preserve_format) -> torch.Tensor:
    target = _cuda_device("cuda" if device is None else device)
    if _same_place(PLACES.of(self), target):
        if PLACES.of(self) == FREE:
            PLACES.put(self, target)
        return self
    return _with_ambient(target, lambda: moved(self, target))


def _cpu(self: torch.Tensor, memory_format: Any = torch.preserve_format) -> torch.Tensor:
    if PLACES.of(self) < 0:
        return self
    return _with_ambient(CPU, lambda: moved(self, CPU))


def _numpy(self: torch.Tensor, *, force: bool = False) -> Any:
    place = PLACES.of(self)
    if place >= 0:
        raise TypeError(f"can't convert cuda:{place} device type tensor to numpy. Use Tensor.cpu() to copy the tensor"
                        " to host memory first.")
    return _BASE.numpy(self, force=force)


def _record_stream(self: torch.Tensor, stream: Any) -> None:
    return None


def _copy_(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """`copy_` into a wrapper subclass made on "cuda" (TE's Float8Tensor: no storage of its own, its
    __torch_dispatch__ quantizes into its buffers): torch's Python binding guards the call with a CUDA
    device guard, which a CPU build cannot make; the operator itself, dispatched to the subclass, needs none."""
    if _BASE.device.__get__(self).type == "cuda":
        torch.ops.aten.copy_.default(self, src, non_blocking)
        return self
    return _BASE.copy_(self, src, non_blocking)


def _with_ambient(place: int, make):
    saved = AMBIENT.place
    AMBIENT.place = place
    try:
        return make()
    finally:
        AMBIENT.place = saved


def _placed(make, device: Any, requires_grad: bool = False):
    """A tensor made on the CPU by `make()`, placed on `device`'s GPU where it names one."""
    place = _place_of_device(device)
    if place == CPU:
        return make(device)
    tensor = _with_ambient(place, lambda: make(None))
    PLACES.put(tensor, place)
    if requires_grad:
        tensor.requires_grad_(True)
    return tensor


_torch_tensor = torch.tensor
_torch_as_tensor = torch.as_tensor


def tensor(data: Any, *, dtype: Any = None, device: Any = None, requires_grad: bool = False,
           pin_memory: bool = False) -> torch.Tensor:
    return _placed(lambda chosen: _torch_tensor(data, dtype=dtype, device=chosen,
                                                requires_grad=requires_grad if chosen is not None else False,
                                                pin_memory=pin_memory),
                   device, requires_grad)


def as_tensor(data: Any, dtype: Any = None, device: Any = None) -> torch.Tensor:
    if isinstance(data, torch.Tensor):
        return data.to(device=device, dtype=dtype) if device is not None else data.to(dtype=dtype or data.dtype)
    return _placed(lambda chosen: _torch_as_tensor(data, dtype=dtype, device=chosen), device)


def _new_tensor(self: torch.Tensor, data: Any, dtype: Any = None, device: Any = None,
                requires_grad: bool = False, layout: Any = None, pin_memory: bool = False) -> torch.Tensor:
    chosen = device if device is not None else _device(self)
    return tensor(data, dtype=dtype or self.dtype, device=chosen, requires_grad=requires_grad)


TENSOR_ATTRIBUTES = {
    "device": property(_device),
    "is_cuda": property(_is_cuda),
    "is_cpu": property(_is_cpu),
    "get_device": _get_device,
    "type": _type,
    "to": _to,
    "cuda": _cuda,
    "cpu": _cpu,
    "numpy": _numpy,
    "record_stream": _record_stream,
    "copy_": _copy_,
    "new_tensor": _new_tensor,
}
TORCH_ATTRIBUTES = {"tensor": tensor, "as_tensor": as_tensor}
