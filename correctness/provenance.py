"""Where and with what a result was produced: device, library versions, threads, commit, the
switches that change the numbers of GPU kernels, and, where a GPU stood in for the recipe's GPU,
which (correctness.tiers.StandIn).

Optional libraries are looked up by their installed metadata, never imported here.

The numerics switches (`numerics`): torch's reduced-precision reductions in FP16 and BF16 GEMMs
(torch.backends.cuda.matmul.allow_*_reduced_precision_reduction: on by default, so a BF16 GEMM may
reduce in BF16), TF32 for matmuls and cuDNN (allow_tf32, and fp32_precision where this torch has
it), float32_matmul_precision, and the environment variables NVIDIA_TF32_OVERRIDE (the driver's TF32
switch, over torch's) and CUBLAS_WORKSPACE_CONFIG. They are recorded on the CPU too; the CUDA
libraries' versions (cuDNN, cuBLAS) and the driver's are null there.
"""

import ctypes
import ctypes.util
import importlib.metadata
import os
import platform
import re
import subprocess
import warnings
from functools import cache
from pathlib import Path
from typing import Any

import torch

from correctness.emulated_gpu.session import active as emulation_active
from correctness.emulated_gpu.session import provenance as emulated_record
from correctness.tiers import stand_in_between

OPTIONAL_PACKAGES = ("transformer-engine", "transformer-engine-torch", "flash-attn", "flash-attn-3", "megatron-core",
                     "mmaemu")


def package_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def te_cpu_version() -> str | None:
    """The version of Transformer Engine installed for the te-cpu tier (None: none there)."""
    from correctness.te_on_cpu import installed_versions

    return ", ".join(installed_versions()) or None


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
        described = {
            "type": "cuda",
            "name": properties.name,
            "gpu_type": gpu_type(properties.name),
            "capability": f"{properties.major}.{properties.minor}",
            "memory_gb": round(properties.total_memory / 2**30, 1),
            "index": index,
        }
        if emulation_active() is not None:  # the GPU named is emulated: the machine is this CPU
            described.update(emulated=True, host_cpu=cpu_model(), threads=torch.get_num_threads())
        return described
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


NUMERICS_ENVIRONMENT = ("NVIDIA_TF32_OVERRIDE", "CUBLAS_WORKSPACE_CONFIG")
# cuBLAS's wheels, newest first (torch's pip builds load cuBLAS from one of them)
CUBLAS_DISTRIBUTIONS = ("nvidia-cublas", "nvidia-cublas-cu13", "nvidia-cublas-cu12", "nvidia-cublas-cu11")
CUBLAS_PROPERTIES = (0, 1, 2)  # libraryPropertyType: MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL
DRIVER_VERSION_FILE = Path("/proc/driver/nvidia/version")


def _setting(read: Any) -> Any:
    """A torch setting, read without the deprecation warnings of its older API; None where this
    torch lacks it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return read()
        except (AttributeError, RuntimeError):
            return None


def numerics_switches() -> dict[str, Any]:
    """The switches that change what GPU kernels compute (the module's docstring), as set now."""
    matmul = torch.backends.cuda.matmul
    cudnn = torch.backends.cudnn
    return {
        "cuda_matmul_allow_bf16_reduced_precision_reduction":
            _setting(lambda: matmul.allow_bf16_reduced_precision_reduction),
        "cuda_matmul_allow_fp16_reduced_precision_reduction":
            _setting(lambda: matmul.allow_fp16_reduced_precision_reduction),
        "cuda_matmul_allow_tf32": _setting(lambda: matmul.allow_tf32),
        "cuda_matmul_fp32_precision": _setting(lambda: matmul.fp32_precision),
        "cudnn_allow_tf32": _setting(lambda: cudnn.allow_tf32),
        "cudnn_fp32_precision": _setting(lambda: cudnn.fp32_precision),
        "float32_matmul_precision": _setting(torch.get_float32_matmul_precision),
        **{name: os.environ.get(name) for name in NUMERICS_ENVIRONMENT},
    }


@cache
def cublas_version() -> str | None:
    """cuBLAS's version: its wheel's (torch's pip builds), else the loaded library's own
    (cublasGetProperty); None where neither is found."""
    for distribution in CUBLAS_DISTRIBUTIONS:
        version = package_version(distribution)
        if version:
            return version
    name = ctypes.util.find_library("cublas")
    if name is None:
        return None
    try:
        library = ctypes.CDLL(name)
        parts = []
        for prop in CUBLAS_PROPERTIES:
            value = ctypes.c_int()
            if library.cublasGetProperty(prop, ctypes.byref(value)) != 0:
                return None
            parts.append(str(value.value))
        return ".".join(parts)
    except (OSError, AttributeError):
        return None


@cache
def driver_version() -> str | None:
    """The NVIDIA kernel driver's version (/proc/driver/nvidia/version), else the CUDA version the
    driver supports (cuDriverGetVersion: 12080 is "12.8"); None where neither can be read."""
    try:
        found = re.search(r"Kernel Module\s+(?:for \S+\s+)?([0-9][0-9.]+)", DRIVER_VERSION_FILE.read_text())
        if found:
            return found.group(1)
    except OSError:
        pass
    try:
        library = ctypes.CDLL("libcuda.so.1")
        value = ctypes.c_int()
        if library.cuDriverGetVersion(ctypes.byref(value)) == 0:
            return f"CUDA {value.value // 1000}.{value.value % 1000 // 10} (driver API)"
    except (OSError, AttributeError):
        pass
    return None


def cuda_libraries(device: torch.device) -> dict[str, Any]:
    """cuDNN's, cuBLAS's and the driver's versions for a CUDA device; null on the CPU and on an
    emulated GPU (whose libraries are not there)."""
    on_cuda = device.type == "cuda" and torch.cuda.is_available() and emulation_active() is None
    cudnn = torch.backends.cudnn.version() if on_cuda and torch.backends.cudnn.is_available() else None
    return {"cudnn": cudnn, "cublas": cublas_version() if on_cuda else None,
            "driver": driver_version() if on_cuda else None}


def stand_in(description: dict[str, Any], recipe_gpu: str | None) -> dict[str, str] | None:
    """Where the device that ran a recipe GPU's tier (`recipe_gpu`, "H100") is another GPU of its
    architecture, the stand-in (correctness.tiers.StandIn.record); else None."""
    found = stand_in_between(description.get("gpu_type"), recipe_gpu)
    return found.record() if found else None


def provenance(device: torch.device, recipe_gpu: str | None = None,
               emulated_stand_ins: dict[str, Any] | None = None) -> dict[str, Any]:
    """`recipe_gpu`: the GPU a recipe GPU's tier is for ("H100"; None for other tiers): where another
    GPU ran it, `stand_in` says which. Under an emulated GPU, `emulated_gpu` says so, with the
    kernel stand-ins its cases called (`emulated_stand_ins`; None: all this process called)."""
    description = device_description(device)
    emulated = emulated_record(emulated_stand_ins)
    found = {
        "device": description,
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if emulated is None else None,
        **cuda_libraries(device),
        "numerics": numerics_switches(),
        "packages": {name: package_version(name) for name in OPTIONAL_PACKAGES},
        # TE's Python in the te-cpu tier's own folder (correctness.te_on_cpu), never site-packages.
        "transformer_engine_for_cpu": te_cpu_version(),
        "correctness_commit": git_commit(),
    }
    shown = stand_in(description, recipe_gpu)
    if shown is not None:
        found["stand_in"] = shown
    if emulated is not None:
        found["emulated_gpu"] = emulated
    return found
