"""Where the suite's own time goes: `make test` (the README's test command: every unit and component
test on every core, then the GPU tiers on an emulated GPU) run once with pytest's durations, and the
time split by phase, by test module, by kind of work and, for the component tests, by the role each
path plays in a case (the records' own seconds: reference, default, candidate, repeats, controls,
format floor).

    python benchmarks/suite_time.py [--avx2] [--json FILE] [--top N]

--avx2 runs with ONEDNN_MAX_CPU_ISA=AVX2, as a CPU without BF16 hardware would (torch's BF16 matmuls
emulated). The figures are wall seconds under pytest-xdist's contention: two workers on two cores
each take about half the machine, so a test's duration here is about twice its time alone. The goals
(issue 39, fresh clones on 2 cores): `make test` within 300 s with BF16 hardware and 480 s without."""

import argparse
import collections
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from cpu_tier import cpu_features

from correctness.errors import CorrectnessError
from correctness.files import output_target, write_output

ROOT = Path(__file__).resolve().parent.parent
GOALS = {"bf16": 300.0, "avx2": 480.0}  # seconds of `make test`
DURATION = re.compile(r"^(\d+\.\d+)s (setup|call|teardown)\s+(\S+)")
# What a unit test module spends its time on, where it is mostly one thing (the others: "in process").
KINDS = {
    "correctness run (subprocess)": ("test_check_and_run", "test_other_architectures", "test_cli_errors",
                                     "test_recipe_scale", "test_installed_package", "test_gpu_stand_in",
                                     "test_example_lever", "test_stopping", "test_require_tiers"),
    "seed reports and browser": ("test_report_page", "test_report_browser"),
    "catalogue mistakes": ("test_evidence_power",),
    "gpu-check rehearsal": ("test_gpu_rehearsal", "test_gpu_check"),
    "gloo ranks": ("test_distributed", "test_emulated_ranks", "test_reduction_lever", "test_determinism_lever"),
}
ROLES = ("reference", "default", "candidate", "candidate_repeat", "default_repeat", "format")
WIDTH = 160  # characters: the longest line printed (a long command or test id is wrapped)


def say(text: str, indent: str = "  ") -> None:
    print(textwrap.fill(text, WIDTH, initial_indent=indent, subsequent_indent=indent + "    ",
                        break_long_words=True, break_on_hyphens=False))


def kind_of(module: str) -> str:
    name = Path(module).stem
    return next((kind for kind, modules in KINDS.items() if name in modules), "in process")


def seconds_of(value) -> float:
    """A path run's seconds in a record (PathRun, a Judgement's run, a control's judgement)."""
    if not isinstance(value, dict):
        return 0.0
    if isinstance(value.get("seconds"), (int, float)):
        return float(value["seconds"])
    return seconds_of(value.get("run") or value.get("judgement"))


def record_roles(results: Path) -> dict[str, dict[str, float]]:
    """Seconds by role in the component tests' records ("cpu") and the emulated GPU's ("emulated")."""
    split: dict[str, collections.Counter] = {"cpu": collections.Counter(), "emulated": collections.Counter()}
    for path in results.rglob("*.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if record.get("format") != "correctness.lever-record":
            continue
        roles = split["emulated" if ".emulated" in path.parts else "cpu"]
        for case in record.get("cases", []):
            roles["case"] += case.get("seconds") or 0.0
            for role in ROLES:
                roles[role] += seconds_of(case.get(role))
            roles["controls"] += sum(seconds_of(control) for control in case.get("controls") or [])
            roles["secondary"] += sum(seconds_of(extra) for extra in case.get("secondary") or [])
    for roles in split.values():
        roles["comparisons, inputs and the rest"] = roles["case"] - sum(v for k, v in roles.items() if k != "case")
    return {name: {role: round(value, 1) for role, value in roles.items()} for name, roles in split.items()}


def make_test_commands() -> list[str]:
    """The pytest commands `make test` runs, in order, as make prints them (`make -n`)."""
    printed = subprocess.run(["make", "-n", "--no-print-directory", "test"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.replace("\\\n", " ")
    return [line.strip() for line in printed.splitlines() if " -m pytest " in line]


def durations(output: str) -> list[dict]:
    """Every duration line of a pytest run's output."""
    return [{"seconds": float(m.group(1)), "when": m.group(2), "test": m.group(3)}
            for m in map(DURATION.match, output.splitlines()) if m]


def outcome(output: str) -> str:
    """pytest's last summary line (its counts), without the rules around it."""
    lines = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed)", line)]
    return lines[-1].strip("= ") if lines else ""


def breakdown(items: list[dict], top: int) -> dict:
    modules: collections.Counter = collections.Counter()
    kinds: collections.Counter = collections.Counter()
    phases: collections.Counter = collections.Counter()
    for item in items:
        module = item["test"].split("::")[0]
        modules[module] += item["seconds"]
        if module.startswith("tests/"):
            kinds[kind_of(module)] += item["seconds"]
            phases["unit test " + ("fixture setup" if item["when"] == "setup" else item["when"])] += item["seconds"]
        else:
            phases["component test " + item["when"]] += item["seconds"]
    slowest = sorted(items, key=lambda item: -item["seconds"])[:top]
    return {"modules": [(module, round(s, 1)) for module, s in modules.most_common(top)],
            "unit_test_kinds": {kind: round(s, 1) for kind, s in kinds.most_common()},
            "work": {phase: round(s, 1) for phase, s in phases.most_common()},
            "slowest": [(round(item["seconds"], 1), item["when"], item["test"]) for item in slowest]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--avx2", action="store_true", help="ONEDNN_MAX_CPU_ISA=AVX2: BF16 matmuls without BF16 hardware")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    if args.json:  # refused before the run, not after it (an input, a read-only file, a device: correctness.files)
        try:
            output_target(args.json, "--json")
        except CorrectnessError as refusal:
            print(f"suite_time: {refusal}", file=sys.stderr)
            return 2
    environment = dict(os.environ)
    if args.avx2:
        environment["ONEDNN_MAX_CPU_ISA"] = "AVX2"
    phases, items = [], []
    with tempfile.TemporaryDirectory(prefix="suite-time-") as results:
        # On the command line, not in PYTEST_ADDOPTS, which the pytest runs the tests start would inherit.
        measured = f" --durations=0 --durations-min=0.05 --results-dir={results}"
        for command in (command + measured for command in make_test_commands()):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            start = time.perf_counter()
            finished = subprocess.run(command, shell=True, cwd=ROOT, env=environment, stdin=subprocess.DEVNULL,
                                      capture_output=True, text=True, check=False)
            if finished.returncode not in (0, 1):
                print(f"{command}: exit {finished.returncode}\n{(finished.stdout + finished.stderr)[-3000:]}",
                      file=sys.stderr, flush=True)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            phases.append({"command": command, "exit_status": finished.returncode,
                           "wall_seconds": round(time.perf_counter() - start, 1),
                           "cpu_seconds": round(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime, 1),
                           "outcome": outcome(finished.stdout),
                           **({"output_tail": (finished.stdout + finished.stderr)[-3000:]} if finished.returncode else {})})
            items += durations(finished.stdout)
        roles = record_roles(Path(results))
    cpu = cpu_features()
    goal = GOALS["bf16" if cpu["bf16_hardware"] and not args.avx2 else "avx2"]
    wall = sum(phase["wall_seconds"] for phase in phases)
    failed = max((phase["exit_status"] for phase in phases), default=1)
    figures = {
        "cpu": cpu, "avx2": args.avx2, "exit_status": failed, "wall_seconds": round(wall, 1), "goal_seconds": goal,
        "cpu_seconds": round(sum(phase["cpu_seconds"] for phase in phases), 1),
        "phases": phases, **breakdown(items, args.top), "record_roles": roles,
    }
    if args.json:
        write_output(args.json, (json.dumps(figures, indent=1) + "\n").encode(), "--json")
    say(f"make test{' (ONEDNN_MAX_CPU_ISA=AVX2)' if args.avx2 else ''} on {cpu['model']}"
        f" (BF16 hardware: {'yes' if cpu['bf16_hardware'] else 'no'}): {wall:.0f} s of pytest"
        f" (goal {goal:.0f} s with the install), {figures['cpu_seconds']:.0f} s CPU", "")
    print("phases:")
    for phase in phases:
        say(f"{phase['wall_seconds']:.0f} s wall, {phase['cpu_seconds']:.0f} s CPU, exit {phase['exit_status']}:"
            f" {phase['command']}")
        say(phase["outcome"], "    ")
    print("the duration lines (s, summed over both workers):")
    say("; ".join(f"{phase} {seconds:.0f}" for phase, seconds in figures["work"].items()))
    print("unit tests by kind of work (s):")
    for kind, seconds in figures["unit_test_kinds"].items():
        print(f"  {seconds:7.1f}  {kind}")
    print("component tests' records by role (s of their cases):")
    for name, split in roles.items():
        say(f"{name}: " + ", ".join(f"{role} {seconds:.1f}" for role, seconds in split.items()))
    print(f"modules (s, top {args.top}):")
    for module, seconds in figures["modules"]:
        print(f"  {seconds:7.1f}  {module}")
    print(f"slowest items (s, top {args.top}):")
    for seconds, when, test in figures["slowest"]:
        say(f"{seconds:7.1f}  {when:8} {test}")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
