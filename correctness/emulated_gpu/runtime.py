"""torch.cuda on the emulated GPUs: the queries answered as the named GPU, and the rest of the
runtime as its CPU equivalent or an honest no-op, each named here.

- Queries: is_available, is_initialized, device_count, current_device, set_device, the
  `torch.cuda.device` context (_exchange_device), get_device_name / capability / properties,
  get_arch_list, is_bf16_supported; `torch.cuda._lazy_init` does nothing, so that a factory asked for
  `device="cuda"` reaches the placement mode (correctness.emulated_gpu.placement) instead of
  raising "Torch not compiled with CUDA enabled".
- synchronize: a no-op, and exactly so: every kernel here has finished when its call returns.
- Streams and events (`EmulatedStream`, `EmulatedEvent`): one default stream per GPU; waits,
  records, queries and synchronisation are no-ops for the same reason; an event's elapsed_time is
  the CPU's wall time between its records. `Tensor.record_stream` is a no-op (no memory is freed
  early here).
- Memory: memory_allocated and memory_reserved are the bytes of the live storages placed on that
  GPU; max_memory_allocated the most of it seen at a query or at the placement table's sweeps (a
  sample, not every allocation); mem_get_info the GPU's total less that; empty_cache a no-op.
- RNG: one CPU generator per GPU stands in for CUDA's default generator (manual_seed, seed,
  get_rng_state, set_rng_state and their `_all` forms, default_generators); random operators on
  GPU tensors draw from it (the placement mode swaps it in), so the CPU's stream is left alone.
  Its numbers are the CPU generator's, not CUDA's Philox. `torch.Generator(device="cuda")` is a
  CPU generator that says its GPU (`EmulatedGenerator`).
- CUDA graphs: capture is refused (`NotEmulated`): replaying recorded kernels is not emulated.
- nvtx ranges: no-ops.
- cuDNN: `torch.backends.cudnn.is_available()` is true and `version()` answers CUDNN_VERSION, the
  version TE's fused-attention gates are asked about (correctness.te_on_cpu).
"""

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

from correctness.emulated_gpu.gpus import Emulated


class NotEmulated(RuntimeError):
    """A CUDA feature the emulation does not model was used."""


class _State:
    emulated: Emulated | None = None
    generators: tuple[torch.Generator, ...] = ()
    streams: dict[int, "EmulatedStream"] = {}
    peak: dict[int, int] = {}


STATE = _State()
_current = threading.local()
CUDNN_VERSION = 91002  # 9.10.2: the first 9.10 that TE 2.17 lets run F16 arbitrary-seqlen attention


def emulated() -> Emulated:
    if STATE.emulated is None:
        raise NotEmulated("no GPU is emulated here")
    return STATE.emulated


def current_device() -> int:
    return getattr(_current, "device", 0)


def _index(device: Any = None) -> int:
    """The GPU index a device argument names (None and "cuda": the current one)."""
    if device is None:
        return current_device()
    if isinstance(device, int) and not isinstance(device, bool):
        index = device
    else:
        named = torch.device(device) if not isinstance(device, torch.device) else device
        if named.type != "cuda":
            raise ValueError(f"Expected a cuda device, but got: {named}")
        index = named.index if named.index is not None else current_device()
    if not 0 <= index < emulated().count:
        raise RuntimeError(f"CUDA error: invalid device ordinal (device {index} of the {emulated().count} emulated"
                           f" {emulated().model.gpu})")
    return index


def set_device(device: Any) -> None:
    _current.device = _index(device)


def _exchange_device(index: int) -> int:
    previous = current_device()
    if index >= 0:
        set_device(index)
    return previous


class DeviceProperties:
    """torch.cuda.get_device_properties's answer for the emulated GPU."""

    def __init__(self, emulation: Emulated):
        model = emulation.model
        self.name = model.name
        self.major, self.minor = model.capability
        self.total_memory = model.total_memory
        self.multi_processor_count = model.multi_processor_count
        self.L2_cache_size = model.l2_cache_bytes
        self.is_integrated = False
        self.is_multi_gpu_board = False
        self.max_threads_per_multi_processor = 2048
        self.warp_size = 32
        self.regs_per_multiprocessor = 65536
        self.shared_memory_per_block = 49152
        self.shared_memory_per_block_optin = 232448
        self.shared_memory_per_multiprocessor = 233472
        self.gcnArchName = "NVIDIA"
        self.uuid = "emulated"

    def __repr__(self) -> str:
        return (f"_CudaDeviceProperties(name='{self.name}', major={self.major}, minor={self.minor},"
                f" total_memory={self.total_memory // 2**20}MB, multi_processor_count={self.multi_processor_count},"
                " emulated on the CPU)")


class EmulatedStream:
    """A CUDA stream: every operation here is complete when it returns, so waiting is a no-op."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.device = torch.device("cuda", _index(device))
        self.priority = priority
        self.cuda_stream = id(self)

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: "EmulatedEvent | None" = None) -> "EmulatedEvent":
        event = event or EmulatedEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def __enter__(self) -> "EmulatedStream":
        return self

    def __exit__(self, *exception: Any) -> None:
        pass

    def __repr__(self) -> str:
        return f"<emulated CUDA stream on {self.device}>"


class EmulatedEvent:
    """A CUDA event: recorded at the CPU's wall time; complete as soon as it is recorded."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing = enable_timing
        self.recorded_at: float | None = None

    def record(self, stream: Any = None) -> None:
        self.recorded_at = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "EmulatedEvent") -> float:
        if self.recorded_at is None or end.recorded_at is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return (end.recorded_at - self.recorded_at) * 1000.0


def current_stream(device: Any = None) -> EmulatedStream:
    index = _index(device)
    stream = getattr(_current, "streams", {}).get(index)
    return stream if stream is not None else default_stream(index)


def default_stream(device: Any = None) -> EmulatedStream:
    index = _index(device)
    if index not in STATE.streams:
        STATE.streams[index] = EmulatedStream(index)
    return STATE.streams[index]


def set_stream(stream: EmulatedStream) -> None:
    if not hasattr(_current, "streams"):
        _current.streams = {}
    _current.streams[stream.device.index] = stream


@contextlib.contextmanager
def stream(chosen: EmulatedStream | None) -> Iterator[None]:
    if chosen is None:
        yield
        return
    previous = current_stream(chosen.device)
    set_stream(chosen)
    try:
        yield
    finally:
        set_stream(previous)


# --- memory ------------------------------------------------------------------------------------

def memory_allocated(device: Any = None) -> int:
    from correctness.emulated_gpu.placement import PLACES

    index = _index(device)
    allocated = PLACES.bytes_on(index)
    STATE.peak[index] = max(STATE.peak.get(index, 0), allocated)
    return allocated


def max_memory_allocated(device: Any = None) -> int:
    allocated = memory_allocated(device)
    return max(STATE.peak.get(_index(device), 0), allocated)


def reset_peak_memory_stats(device: Any = None) -> None:
    STATE.peak[_index(device)] = 0


def mem_get_info(device: Any = None) -> tuple[int, int]:
    total = emulated().model.total_memory
    return total - memory_allocated(device), total


def memory_stats(device: Any = None) -> dict[str, int]:
    allocated = memory_allocated(device)
    peak = max_memory_allocated(device)
    return {"allocated_bytes.all.current": allocated, "allocated_bytes.all.peak": peak,
            "reserved_bytes.all.current": allocated, "reserved_bytes.all.peak": peak}


# --- random numbers ----------------------------------------------------------------------------

def generator(device: Any = None) -> torch.Generator:
    return STATE.generators[_index(device)]


class _AnyGenerator(type(torch.Generator)):
    """isinstance(x, torch.Generator) stays true of every generator while EmulatedGenerator is
    torch.Generator."""

    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, torch._C.Generator)


class EmulatedGenerator(torch.Generator, metaclass=_AnyGenerator):
    """`torch.Generator(device=...)` under the emulation: a generator the code makes for a GPU is a
    CPU generator (its numbers the CPU's, not CUDA's Philox) whose `device` says the GPU; one made for
    the CPU is a CPU generator as torch's is."""

    def __new__(cls, device: Any = "cpu") -> "EmulatedGenerator":
        return torch._C.Generator.__new__(cls)

    def __init__(self, device: Any = "cpu") -> None:
        super().__init__()
        named = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        self._emulated_device = torch.device("cuda", _index(named)) if named.type == "cuda" else named

    @property
    def device(self) -> torch.device:
        return self._emulated_device


def manual_seed(seed: int) -> None:
    generator().manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    for each in STATE.generators:
        each.manual_seed(int(seed))


def seed() -> None:
    generator().seed()


def seed_all() -> None:
    chosen = generator().seed()
    for each in STATE.generators:
        each.manual_seed(chosen)


def initial_seed() -> int:
    return generator().initial_seed()


def get_rng_state(device: Any = "cuda") -> torch.Tensor:
    return generator(device).get_state()


def set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
    generator(device).set_state(new_state)


def get_rng_state_all() -> list[torch.Tensor]:
    return [each.get_state() for each in STATE.generators]


def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
    for each, state in zip(STATE.generators, new_states):
        each.set_state(state)


@contextlib.contextmanager
def drawing_from(device: int) -> Iterator[None]:
    """Random operators on GPU `device` draw from its generator: swapped into torch's default CPU
    generator for the call, and the CPU's own state put back after it."""
    cpu_state = torch.default_generator.get_state()
    torch.default_generator.set_state(STATE.generators[device].get_state())
    try:
        yield
    finally:
        STATE.generators[device].set_state(torch.default_generator.get_state())
        torch.default_generator.set_state(cpu_state)


# --- what is not emulated ---------------------------------------------------------------------

class CUDAGraph:
    """torch.cuda.CUDAGraph: capturing is refused (NotEmulated)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def capture_begin(self, *args: Any, **kwargs: Any) -> None:
        raise NotEmulated("CUDA graph capture is not emulated (correctness.emulated_gpu.runtime)")

    def replay(self) -> None:
        raise NotEmulated("CUDA graph replay is not emulated (correctness.emulated_gpu.runtime)")


def graph(*args: Any, **kwargs: Any):
    raise NotEmulated("CUDA graph capture (torch.cuda.graph) is not emulated (correctness.emulated_gpu.runtime)")


def _no_op(*args: Any, **kwargs: Any) -> None:
    return None


def cuda_attributes(emulation: Emulated) -> dict[str, Any]:
    """torch.cuda's attributes under the emulation of `emulation`."""
    properties = DeviceProperties(emulation)
    return {
        "is_available": lambda: True,
        "is_initialized": lambda: True,
        "_lazy_init": _no_op,
        "init": _no_op,
        "device_count": lambda: emulation.count,
        "current_device": current_device,
        "set_device": set_device,
        "_exchange_device": _exchange_device,
        "_maybe_exchange_device": _exchange_device,
        "get_device_name": lambda device=None: (_index(device), properties.name)[1],
        "get_device_capability": lambda device=None: (_index(device), (properties.major, properties.minor))[1],
        "get_device_properties": lambda device=None: (_index(device), properties)[1],
        "get_arch_list": lambda: [f"sm_{properties.major}{properties.minor}"],
        "is_bf16_supported": lambda including_emulation=True: True,
        "is_tf32_supported": lambda: True,
        "synchronize": _no_op,
        "empty_cache": _no_op,
        "ipc_collect": _no_op,
        "is_current_stream_capturing": lambda: False,
        "Stream": EmulatedStream,
        "Event": EmulatedEvent,
        "current_stream": current_stream,
        "default_stream": default_stream,
        "set_stream": set_stream,
        "stream": stream,
        "memory_allocated": memory_allocated,
        "max_memory_allocated": max_memory_allocated,
        "memory_reserved": memory_allocated,
        "max_memory_reserved": max_memory_allocated,
        "reset_peak_memory_stats": reset_peak_memory_stats,
        "reset_max_memory_allocated": reset_peak_memory_stats,
        "mem_get_info": mem_get_info,
        "memory_stats": memory_stats,
        "manual_seed": manual_seed,
        "manual_seed_all": manual_seed_all,
        "seed": seed,
        "seed_all": seed_all,
        "initial_seed": initial_seed,
        "get_rng_state": get_rng_state,
        "set_rng_state": set_rng_state,
        "get_rng_state_all": get_rng_state_all,
        "set_rng_state_all": set_rng_state_all,
        "CUDAGraph": CUDAGraph,
        "graph": graph,
    }


NVTX_ATTRIBUTES = {"range_push": _no_op, "range_pop": _no_op, "mark": _no_op}
CUDNN_ATTRIBUTES = {"is_available": lambda: True, "version": lambda: CUDNN_VERSION}


def start(emulation: Emulated) -> None:
    STATE.emulated = emulation
    STATE.generators = tuple(torch.Generator() for _ in range(emulation.count))
    for each in STATE.generators:
        each.manual_seed(torch.initial_seed())
    STATE.streams = {}
    STATE.peak = {}
    _current.device = 0
    _current.streams = {}  # each emulation starts on its own default streams, not a past one's


def stop() -> None:
    STATE.emulated = None
    STATE.generators = ()
    STATE.streams = {}
