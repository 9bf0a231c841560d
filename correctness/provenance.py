"""Where and with what a result was produced: device, library versions, threads, commit.

Optional libraries are looked up by their installed metadata, never imported here.
"""

import importlib.metadata
import platform
import re
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import torch

OPTIONAL_PACKAGES = ("transformer-engine", "transformer-engine-torch", "flash-attn", "flash-attn-3", "megatron-core")


def package_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def megatron_core_version() -> str:
    """megatron-core's installed version, "unknown" where it is not installed (a path records it)."""
    return package_version("megatron-core") or "unknown"


@cache
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


GPU_TYPES = ("H100", "H200", "GH200", "B200", "B300", "GB200", "GB300", "A100", "L40S", "MI300X", "MI325X", "MI355X")


def gpu_type(name: str | None) -> str | None:
    """The GPU type in a device name, matched as a whole word: "NVIDIA H100 80GB HBM3" is an H100;
    "NVIDIA GH200 480GB" is a GH200, not an H200. None where no known type is named."""
    words = re.split(r"[^A-Z0-9]+", (name or "").upper())
    return next((word for word in words if word in GPU_TYPES), None)


def device_description(device: torch.device) -> dict[str, Any]:
    if device.type == "cuda" and not torch.cuda.is_available():
        return {"type": "cuda", "name": None, "available": False}
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        properties = torch.cuda.get_device_properties(index)
        return {
            "type": "cuda",
            "name": properties.name,
            "gpu_type": gpu_type(properties.name),
            "capability": f"{properties.major}.{properties.minor}",
            "memory_gb": round(properties.total_memory / 2**30, 1),
            "index": index,
        }
    return {"type": device.type, "name": cpu_model(), "threads": torch.get_num_threads()}


@cache
def git_commit() -> str | None:
    try:
        result = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def provenance(device: torch.device) -> dict[str, Any]:
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "device": device_description(device),
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": cudnn,
        "packages": {name: package_version(name) for name in OPTIONAL_PACKAGES},
        "correctness_commit": git_commit(),
    }
