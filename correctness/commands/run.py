"""Run a recipe's component tests (pytest underneath, the same markers) and write their records.

    correctness run RECIPE.yaml [--tier auto|cpu|gpu] [--results-dir DIR] [--workers N]
                    [--checkpoint-cases DIR] [--model-checkpoint DIR] [-- PYTEST ARGS...]

Selects the levers for the recipe's model and GPU, with shapes taken from RECIPE.yaml. `auto` runs
the GPU tiers where a CUDA device is present (the recipe's GPU marker, and `gpu`) and the CPU tiers
otherwise (those without a GPU marker, Megatron's optimizer on the CPU included). With several GPUs the cases are spread over them, one GPU per pytest-xdist worker
(install the `parallel` extra); the workers' records are merged into one per lever. pytest prints
its progress and, at the end, a verdict table per lever.

Exit status: 0 every test passed or skipped; 1 a component test failed; 2 bad input or nothing ran.
"""

import importlib.util

import pytest
import torch

from correctness.cli import EXIT_BAD_INPUT, EXIT_FAIL, EXIT_OK
from correctness.errors import CorrectnessError
from correctness.fixtures import FIXTURES_DIR
from correctness.pytest_plugin import GPU_MARKERS
from correctness.recipes import load_recipe

COMPONENT_TESTS = FIXTURES_DIR.parent / "component_tests"
# Everything that runs without a GPU: the CPU tiers, and Megatron's own optimizer on the CPU (marked
# `megatron` alone; it skips with the reason where megatron-core is not installed).
CPU_TIER = "not gpu and not te and not " + " and not ".join(GPU_MARKERS)


def add_arguments(parser) -> None:
    parser.add_argument("recipe", metavar="RECIPE.yaml")
    parser.add_argument("--tier", choices=("auto", "cpu", "gpu"), default="auto")
    parser.add_argument("--results-dir", help="where the records go (default: results/ beside the tests)")
    parser.add_argument("--workers", type=int, default=None,
                        help="pytest-xdist workers (default: one per GPU where there are several)")
    parser.add_argument("--checkpoint-cases", help="folder of captured attention inputs")
    parser.add_argument("--model-checkpoint", help="the model's Hugging Face checkpoint folder")


def markers(recipe, tier: str) -> str:
    if tier == "auto":
        tier = "gpu" if torch.cuda.is_available() else "cpu"
    if tier == "cpu":
        return CPU_TIER
    own = recipe.gpu.lower()
    return f"gpu or {own}" if own in GPU_MARKERS else "gpu"


def run(args) -> int:
    recipe = load_recipe(args.recipe)
    command = [str(COMPONENT_TESTS), "--recipe", str(args.recipe), "-m", markers(recipe, args.tier), "-rs"]
    for option in ("results_dir", "checkpoint_cases", "model_checkpoint"):
        value = getattr(args, option)
        if value:
            command += [f"--{option.replace('_', '-')}", value]
    workers = args.workers if args.workers is not None else (torch.cuda.device_count() if args.tier != "cpu" else 0)
    if workers and workers > 1:
        if importlib.util.find_spec("xdist") is None:
            raise CorrectnessError(f"{workers} workers need pytest-xdist: pip install -e '.[parallel]'")
        command += ["-n", str(workers)]
    print(f"correctness run {recipe.id}: pytest {' '.join(command)}", flush=True)
    status = pytest.main(command + list(args.passthrough))
    if status == pytest.ExitCode.OK:
        return EXIT_OK
    if status == pytest.ExitCode.TESTS_FAILED:
        return EXIT_FAIL
    if status == pytest.ExitCode.NO_TESTS_COLLECTED:
        print(f"correctness run: no component test selected for {recipe.model} on {recipe.gpu}")
    return EXIT_BAD_INPUT
