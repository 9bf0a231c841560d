"""Each CPU tier at the recipe's scale on this machine: time and peak memory per lever and recipe.

For every component test of a CPU tier (cpu, megatron-cpu, te-cpu: the lever specs' TierTests)
and each seed recipe (Gemma 4 31B, Nemotron 3 Super), builds the tier's levers as
`--scale recipe` does (LeverOptions(scale="recipe")) and runs every case, each lever and recipe
in a process of its own. Prints per lever and recipe: the verdict and its cases by status, the
wall time, and the peak resident memory of the process (ru_maxrss; and of the largest rank
process, for the levers that start gloo ranks); a lever whose case would need more memory than this
machine has available is refused when it is built, and the line says how much
(correctness.memory); one that does not apply to the recipe says why. `--plan` builds the levers
only: their cases and the largest estimated peak. The README's "The recipe's scale on a CPU" holds
these figures.

    python benchmarks/recipe_scale.py [--levers NAME,...] [--recipes gemma,nemotron] [--plan]
                                      [--timeout SECONDS] [--results-dir DIR] [--json]
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from correctness import memory  # noqa: E402
from correctness.errors import OverMemory  # noqa: E402
from correctness.lever import LeverOptions, NotApplicable  # noqa: E402
from correctness.recipe_sets import GEMMA, NEMOTRON  # noqa: E402
from correctness.registry import LEVER_SPECS  # noqa: E402

CPU_TIERS = ("cpu", "megatron-cpu", "te-cpu")
RECIPES = {"gemma": GEMMA, "nemotron": NEMOTRON}


def cpu_tests(levers: set[str] | None):
    """(lever name, test name, tier, factory) of every CPU tier test, in the registry's order."""
    for spec in LEVER_SPECS:
        if levers is not None and spec.name not in levers:
            continue
        for test in spec.tests:
            if test.tier in CPU_TIERS:
                yield spec.name, test.test, test.tier, test.factory


def one(lever_name: str, test_name: str, recipe: str, plan: bool, results_dir: str | None) -> dict:
    """Build (and unless `plan`, run) one test's levers at the recipe scale, in this process."""
    from correctness.harness import run_lever
    from correctness.results import write_record

    (name, _, tier, factory), = [t for t in cpu_tests({lever_name}) if t[1] == test_name]
    found = {"lever": name, "test": test_name, "tier": tier, "recipe": recipe}
    options = LeverOptions(scale="recipe")
    try:
        levers = options.recorded(factory(recipe, options))
    except NotApplicable as reason:
        return {**found, "status": "not applicable", "why": str(reason)}
    except OverMemory as refusal:
        return {**found, "status": "refused", "why": str(refusal)}
    runs = []
    for lever in levers:
        estimated = [case.memory_bytes for case in lever.cases if case.memory_bytes and case.skip_reason is None]
        run = {"candidate": lever.candidate.name, "cases": len(lever.cases),
               "largest_estimate_gb": round(max(estimated) / 1e9, 2) if estimated else None}
        if not plan:
            start = time.perf_counter()
            record = run_lever(lever)
            run["seconds"] = round(time.perf_counter() - start, 1)
            run["verdict"] = record.verdict
            statuses: dict[str, int] = {}
            for case in record.cases:
                statuses[case.status] = statuses.get(case.status, 0) + 1
            run["statuses"] = statuses
            run["shapes"] = sorted({case.case_id for case in record.cases})
            if results_dir:
                write_record(record, Path(results_dir))
        runs.append(run)
    own, ranks = (resource.getrusage(who).ru_maxrss / 2**20 for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return {**found, "status": "planned" if plan else "ran", "levers": runs, "peak_gb": round(own, 2),
            "rank_peak_gb": round(ranks, 2)}


def measured(lever_name: str, test_name: str, recipe: str, args) -> dict:
    """One test and recipe in a child process: its figures, wall time and peak memory."""
    command = [sys.executable, __file__, "--one", lever_name, test_name, recipe]
    command += ["--plan"] * args.plan + (["--results-dir", str(args.results_dir)] if args.results_dir else [])
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        out, _ = child.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        return {"lever": lever_name, "test": test_name, "recipe": recipe, "status": f"stopped after {args.timeout} s",
                "seconds": round(time.perf_counter() - start, 1)}
    try:
        figures = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        figures = {"lever": lever_name, "test": test_name, "recipe": recipe,
                   "status": f"failed (exit status {child.returncode})"}
    figures["seconds"] = round(time.perf_counter() - start, 1)
    return figures


def line(figures: dict) -> str:
    where = f"{figures.get('lever', '?')} ({figures.get('tier', '?')}) at {figures['recipe'].split('/')[0]}"
    status = figures["status"]
    if status in ("refused", "not applicable"):
        return f"{where}: {status}: {figures['why']}"
    if status not in ("ran", "planned"):
        return f"{where}: {status} ({figures['seconds']} s)"
    parts = []
    for run in figures["levers"]:
        text = f"{run['candidate']}: {run['cases']} cases, largest estimate {run['largest_estimate_gb']} GB"
        if "verdict" in run:
            counts = ", ".join(f"{count} {status}" for status, count in sorted(run["statuses"].items()))
            text += f", {run['verdict']} ({counts}) in {run['seconds']} s"
        parts.append(text)
    ranks = f", ranks' {figures['rank_peak_gb']} GB" if figures.get("rank_peak_gb") else ""
    return f"{where}: {'; '.join(parts)}; process {figures['seconds']} s, peak {figures['peak_gb']} GB{ranks}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levers", help="comma-separated lever names (default: every lever with a CPU tier)")
    parser.add_argument("--recipes", default="gemma,nemotron", help="comma-separated: gemma, nemotron")
    parser.add_argument("--plan", action="store_true", help="build the levers and print their estimates; run nothing")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per lever and recipe")
    parser.add_argument("--results-dir", type=Path, help="write each lever's record there too")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--one", nargs=3, metavar=("LEVER", "TEST", "RECIPE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(*args.one, plan=args.plan, results_dir=args.results_dir)))
        return 0
    levers = set(args.levers.split(",")) if args.levers else None
    recipes = [RECIPES[name] for name in args.recipes.split(",")]
    available = memory.available_bytes()
    print(f"memory available here: {memory.shown(available) if available else 'unknown'}"
          f" ({memory.available_source()}); {os.cpu_count()} cores", flush=True)
    rows = []
    for name, test_name, _, _ in cpu_tests(levers):
        for recipe in recipes:
            figures = measured(name, test_name, recipe, args)
            rows.append(figures)
            if not args.json:
                print(textwrap.fill(line(figures), width=160, subsequent_indent="    ", break_long_words=False,
                                    break_on_hyphens=False), flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))
    failed = [row for row in rows if row["status"] not in ("ran", "planned", "refused", "not applicable")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
