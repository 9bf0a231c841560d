"""The memory a case may take: what this machine has available, and the bytes of tensors of a shape.

A lever is refused when it is built (pytest's collection, `correctness run`'s preflight) where one
of its CPU cases is estimated to need more than the machine's available memory (Case.memory_bytes),
in one line, rather than failing each case after minutes of swapping or an out-of-memory kill.
`available_bytes()` reads MemAvailable from /proc/meminfo; CORRECTNESS_MEMORY_BYTES overrides it
(tests, and a user who wants a lower ceiling than the machine's).
"""

import ctypes
import math
import os
from pathlib import Path

from correctness.errors import RecipeError

MEMORY_ENV = "CORRECTNESS_MEMORY_BYTES"
MEMINFO = Path("/proc/meminfo")
BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "fp8": 1}


def available_bytes(meminfo: Path = MEMINFO) -> int | None:
    """The memory a case may use: CORRECTNESS_MEMORY_BYTES where set, else /proc/meminfo's
    MemAvailable; None where neither says (not Linux)."""
    given = os.environ.get(MEMORY_ENV)
    if given is not None:
        value = _whole_number(given)
        if value is None or value < 1:
            raise RecipeError(f"environment variable {MEMORY_ENV} must be a positive number of bytes, got {given!r}")
        return value
    try:
        lines = meminfo.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, rest = line.partition(":")
        if name == "MemAvailable":
            return int(rest.split()[0]) * 1024  # kB
    return None


def _whole_number(text: str) -> int | None:
    """An integer written as one ("500000000") or in exponent form ("5e8"); None for anything else
    (a fraction of a byte, inf, nan, words)."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        return None
    return int(value) if math.isfinite(value) and value.is_integer() else None


def available_source() -> str:
    """Where available_bytes' figure comes from, for messages."""
    return f"{MEMORY_ENV}" if os.environ.get(MEMORY_ENV) is not None else f"MemAvailable in {MEMINFO}"


def tensor_bytes(*dims: int, dtype: str = "float32") -> int:
    """The bytes of one tensor of these dimensions."""
    count = 1
    for dim in dims:
        count *= dim
    return count * BYTES[dtype]


def shown(size: int) -> str:
    """Bytes as people read them: "17.2 GB"."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} bytes"


def release_freed_memory() -> None:
    """Hand the C heap's freed memory back to the system (glibc's malloc_trim; nothing elsewhere).
    glibc raises its mmap threshold after a large free, so later tensors of a few MB come from the
    heap, and a streamed lever's resident memory grows with its units though nothing holds them:
    Nemotron's offload at the recipe scale (128 expert slices of 2,048 and 640 rows) reached 24 GB
    and was killed, where trimming after each unit keeps it at 0.35 GB."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _glibc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _glibc()
