"""Wall and CPU time of the component tests' CPU tier on this machine, with the CPU features that
decide them.

Runs `pytest component_tests` (every test that needs no GPU: the CPU tiers and Megatron's
optimizer on the CPU) in a child process, RUNS times, and prints the median wall and CPU seconds,
the slowest tests of the last run, and what the CPU has: a CPU without BF16 hardware (no
avx512_bf16, no amx_bf16) runs torch's BF16 kernels emulated, several times slower.
Goals on a 2-core CPU without BF16 hardware, idle: under 60 s wall and 150 s of CPU.

    python benchmarks/cpu_tier.py [--runs N] [--json] [-- extra pytest arguments]
"""

import argparse
import json
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from correctness.tiers import CPU_TIER

ROOT = Path(__file__).resolve().parent.parent
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "fma")
GOALS = {"wall_seconds": 60.0, "cpu_seconds": 150.0}


def cpu_features() -> dict:
    """The CPU's model, its flags that matter here, and what torch's kernels dispatch to."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {
        "model": model,
        "flags": {flag: flag in flags for flag in FLAGS},
        "bf16_hardware": bool({"avx512_bf16", "amx_bf16"} & flags),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def one_run(extra: list[str]) -> dict:
    """One child pytest run: its wall and CPU seconds, outcome line and slowest tests."""
    with tempfile.TemporaryDirectory() as results:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        finished = subprocess.run(
            [sys.executable, "-m", "pytest", "component_tests", "-m", CPU_TIER, "-q", "-p", "no:cacheprovider",
             "--durations=8", "--results-dir", results, *extra],
            cwd=ROOT, capture_output=True, text=True, check=False,
        )
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    lines = finished.stdout.splitlines()
    slowest = [line for line in lines if re.match(r"^\d+\.\d+s (call|setup|teardown) ", line)]
    outcome = next((line.strip("= ") for line in reversed(lines) if re.search(r"\d+ (passed|failed|skipped)", line)), "")
    return {
        "wall_seconds": wall,
        "cpu_seconds": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
        "exit_status": finished.returncode,
        "outcome": outcome,
        "slowest": slowest,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("pytest_args", nargs="*")
    args = parser.parse_args()
    runs = [one_run(args.pytest_args) for _ in range(args.runs)]
    figures = {
        "cpu": cpu_features(),
        "runs": len(runs),
        "wall_seconds": statistics.median(run["wall_seconds"] for run in runs),
        "cpu_seconds": statistics.median(run["cpu_seconds"] for run in runs),
        "outcome": runs[-1]["outcome"],
        "exit_status": runs[-1]["exit_status"],
        "slowest": runs[-1]["slowest"],
        "goals": GOALS,
    }
    if args.json:
        print(json.dumps(figures, indent=1))
    else:
        cpu = figures["cpu"]
        flags = ", ".join(flag for flag, present in cpu["flags"].items() if present) or "none of interest"
        print(f"CPU: {cpu['model']}; flags: {flags}; BF16 hardware: {'yes' if cpu['bf16_hardware'] else 'no'};"
              f" torch {cpu['torch']} dispatches to {cpu['torch_cpu_capability']}, {cpu['threads']} threads")
        print(f"pytest component_tests (CPU tier), median of {len(runs)}: {figures['wall_seconds']:.1f} s wall,"
              f" {figures['cpu_seconds']:.1f} s CPU (goals {GOALS['wall_seconds']:.0f} s, {GOALS['cpu_seconds']:.0f} s);"
              f" {figures['outcome']}")
        for line in figures["slowest"]:
            print(f"  {line}")
    return 0 if figures["exit_status"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
