"""Line coverage of the GPU-facing modules by the CPU tiers and the emulated GPU tiers together.

Runs the component tests twice under coverage.py, each in a pytest process of its own: the CPU
tiers (the markers a GPU tier carries left out), then every GPU tier on an emulated H100
(`--emulate-gpu H100`); combines the two and prints, per module, the lines run by each and by both,
against the goal (85%). The modules are those whose branches only a GPU took before the emulation
(issue 37): TE's FP8 Linear path, TE's wgrad accumulation, the offload and precision-aware paths
(TE FusedAdam), TE's grouped GEMM, the fused RoPE path and Megatron's fused softmax.

    python benchmarks/emulated_coverage.py [--json] [--keep DIR]

Needs coverage.py (`pip install coverage`). Takes a few minutes on 2 cores.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODULES = ("correctness/fp8/te_linear.py", "correctness/grad_accumulation/te_wgrad.py", "correctness/optimizer/paths.py",
           "correctness/adam_precision/paths.py", "correctness/moe/experts.py", "correctness/rope/paths.py",
           "correctness/attention/megatron_softmax.py")
GOAL = 0.85
RUNS = {
    "cpu": ["-m", "not (gpu or h100 or h200 or te)"],
    "emulated": ["-m", "gpu or h100 or h200 or te or megatron", "--emulate-gpu", "H100"],
}


def run(name: str, selection: list[str], folder: Path) -> float:
    """One pytest run of the component tests under coverage, its data in folder/.coverage.NAME."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "coverage", "run", f"--data-file={folder / f'.coverage.{name}'}",
                    "--source=correctness", "-m", "pytest", "component_tests", *selection, "-q", "-p", "no:cacheprovider",
                    f"--results-dir={folder / name}", "--disable-warnings"], cwd=ROOT, check=False,
                   stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def lines(data_file: Path) -> dict[str, tuple[set[int], set[int]]]:
    """Per module: (its executable lines, the lines run) in one coverage data file."""
    import coverage

    covered = coverage.Coverage(data_file=str(data_file))
    covered.load()
    found = {}
    for module in MODULES:
        path = str(ROOT / module)
        _, statements, _, missing, _ = covered.analysis2(path)
        found[module] = (set(statements), set(statements) - set(missing))
    return found


def measure(folder: Path) -> dict:
    seconds = {name: round(run(name, selection, folder), 1) for name, selection in RUNS.items()}
    by_run = {name: lines(folder / f".coverage.{name}") for name in RUNS}
    modules = []
    for module in MODULES:
        statements = by_run["cpu"][module][0]
        ran = {name: by_run[name][module][1] for name in RUNS}
        both = set().union(*ran.values())
        modules.append({"module": module, "lines": len(statements),
                        **{name: round(len(ran[name]) / len(statements), 3) for name in RUNS},
                        "together": round(len(both) / len(statements), 3),
                        "meets_goal": len(both) / len(statements) >= GOAL})
    return {"seconds": seconds, "goal": GOAL, "modules": modules}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--keep", type=Path, default=None, help="keep the coverage data and records here")
    args = parser.parse_args()
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
        result = measure(args.keep)
    else:
        with tempfile.TemporaryDirectory(prefix="emulated-coverage-") as folder:
            result = measure(Path(folder))
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"pytest under coverage: CPU tiers {result['seconds']['cpu']} s, emulated GPU tiers"
          f" {result['seconds']['emulated']} s")
    print(f"{'module':48} {'lines':>5} {'cpu':>6} {'emulated':>9} {'together':>9}")
    for row in result["modules"]:
        mark = "" if row["meets_goal"] else f"  below {GOAL:.0%}"
        print(f"{row['module']:48} {row['lines']:5d} {row['cpu']:6.0%} {row['emulated']:9.0%} {row['together']:9.0%}{mark}")


if __name__ == "__main__":
    main()
