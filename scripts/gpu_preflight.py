"""What scripts/gpu-check needs before any test runs, checked without importing the project.

Prints one line per missing requirement and exits 2 where a required module is missing; an optional
one (safetensors: read only by the cases on a model checkpoint) is named and does not stop the run.
"""

import importlib.util
import sys

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


def importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that is missing or broken
        return False


def main() -> int:
    missing = [f"{module} (pip package {package})" for module, package in REQUIRED.items() if not importable(module)]
    for module, meaning in OPTIONAL.items():
        if not importable(module):
            print(f"gpu-check preflight: optional {module} is not installed: {meaning}")
    if missing:
        print(f"gpu-check preflight: cannot run, missing {', '.join(missing)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
