"""What scripts/gpu-check needs before any test runs, checked without importing the project.

Prints one line per missing requirement and exits 2 where a required module is missing; an optional
one (safetensors: read only by the cases on a model checkpoint) is named and does not stop the run.
With --require-cuda it also refuses, in one line and with exit status 2, where torch sees no CUDA
device. With --report FILE it writes the environment report gpu-check returns (FILE's folder made
where needed; nothing is written where it refuses): Python, torch and its CUDA and cuDNN, the
device and its driver, torch's matmul and cuDNN switches that change the numbers, the environment
variables that do, the packages' versions and nvidia-smi's own report.
"""

import argparse
import datetime
import importlib.metadata
import importlib.util
import os
import platform
import subprocess
import sys
from pathlib import Path

REQUIRED = {
    "torch": "torch with CUDA (the training image's own)",
    "pytest": "pytest",
    "yaml": "pyyaml",
    "numpy": "numpy",
}
OPTIONAL = {
    "safetensors": "safetensors: only the cases on captured inputs or a model checkpoint read it",
    "transformer_engine": "Transformer Engine: without it the TE tiers skip and torch's SDPA GPU tiers run",
    "megatron.core": "megatron-core: without it the Megatron tiers skip",
}
REPORTED_PACKAGES = ("torch", "numpy", "pytest", "PyYAML", "safetensors", "megatron-core", "transformer-engine",
                     "transformer-engine-torch", "flash-attn", "flash-attn-3")
# Environment variables that change what runs or its numbers (a name ending in `_` is a prefix).
REPORTED_VARIABLES = ("CUBLAS_WORKSPACE_CONFIG", "NVIDIA_TF32_OVERRIDE", "CUDA_VISIBLE_DEVICES", "CUDA_LAUNCH_BLOCKING",
                      "NVTE_", "TORCH_CUDNN_", "TORCH_BLAS_", "PYTHONPATH", "OMP_NUM_THREADS")
NVIDIA_SMI_SECONDS = 20


def importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that is missing or broken
        return False


def missing_modules() -> list[str]:
    """The required modules that cannot be imported; names each optional one that cannot."""
    for module, meaning in OPTIONAL.items():
        if not importable(module):
            print(f"gpu-check preflight: optional {module} is not installed: {meaning}")
    return [f"{module} (pip package {package})" for module, package in REQUIRED.items() if not importable(module)]


def cuda_refusal() -> str | None:
    """Why no GPU tier can run here (one line), or None where torch sees a CUDA device."""
    import torch

    if torch.cuda.is_available():
        return None
    build = "a build without CUDA" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}, sees no device"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = f"; CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""
    return f"gpu-check: CUDA is not visible here (torch {torch.__version__}, {build}{shown}): no GPU tier can run, nothing was run"


def _guarded(read) -> str:
    try:
        return str(read())
    except Exception as error:  # a report line never stops the run
        return f"unknown ({type(error).__name__}: {error})"


def torch_lines() -> list[str]:
    import torch

    cudnn = torch.backends.cudnn
    matmul = torch.backends.cuda.matmul
    lines = [f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN "
             f"{_guarded(lambda: cudnn.version() if cudnn.is_available() else None)}",
             f"CUDA available: {torch.cuda.is_available()}"]
    for index in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        properties = torch.cuda.get_device_properties(index)
        lines.append(f"device {index}: {properties.name}, capability {properties.major}.{properties.minor},"
                     f" {properties.total_memory / 2**30:.1f} GiB")
    switches = {
        "torch.backends.cuda.matmul.allow_tf32": lambda: matmul.allow_tf32,
        "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction":
            lambda: matmul.allow_bf16_reduced_precision_reduction,
        "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction":
            lambda: matmul.allow_fp16_reduced_precision_reduction,
        "torch.backends.cuda.matmul.fp32_precision": lambda: matmul.fp32_precision,
        "torch.backends.cudnn.allow_tf32": lambda: cudnn.allow_tf32,
        "torch.backends.cudnn.deterministic": lambda: cudnn.deterministic,
        "torch.backends.cudnn.benchmark": lambda: cudnn.benchmark,
        "torch.get_float32_matmul_precision()": torch.get_float32_matmul_precision,
    }
    return lines + [f"{name} = {_guarded(read)}" for name, read in switches.items()]


def variable_lines() -> list[str]:
    names = sorted(name for name in os.environ
                   if any(name.startswith(wanted) if wanted.endswith("_") else name == wanted
                          for wanted in REPORTED_VARIABLES))
    return [f"{name}={os.environ[name]}" for name in names] or ["(none of them set)"]


def package_lines() -> list[str]:
    lines = []
    for package in REPORTED_PACKAGES:
        try:
            lines.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            lines.append(f"{package}: not installed")
    return lines


def nvidia_smi_lines() -> list[str]:
    try:
        found = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=NVIDIA_SMI_SECONDS, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        return [f"nvidia-smi: not run ({type(error).__name__}: {error})"]
    return (found.stdout + found.stderr).rstrip().splitlines()


def report(path: Path) -> None:
    """Write the environment report to `path`."""
    sections = {
        "gpu-check environment": [datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                                  f"python {platform.python_version()} ({sys.executable})", platform.platform()],
        "torch": torch_lines(),
        "environment variables": variable_lines(),
        "packages": package_lines(),
        "nvidia-smi": nvidia_smi_lines(),
    }
    text = "".join(f"== {title}\n" + "".join(f"{line}\n" for line in lines) + "\n" for title, lines in sections.items())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="What scripts/gpu-check needs before any test runs.")
    parser.add_argument("--require-cuda", action="store_true", help="refuse where torch sees no CUDA device")
    parser.add_argument("--report", type=Path, default=None, help="write the environment report to this file")
    args = parser.parse_args(argv)
    missing = missing_modules()
    if missing:
        print(f"gpu-check preflight: cannot run, missing {', '.join(missing)}", file=sys.stderr)
        return 2
    refusal = cuda_refusal() if args.require_cuda else None
    if refusal is not None:
        print(refusal, file=sys.stderr)
        return 2
    if args.report is not None:
        report(args.report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
