"""The suite's levers, the tiers they run in, and how strong the evidence is for each numerics argument.

    correctness levers [--results DIR] [--json]

First the numerics arguments of the rules file (correctness/rules/arguments.yaml) counted by the
strongest evidence the suite has for them (correctness/evidence.py: gpu-run, upstream, stand-in,
bookkeeping, gpu-only), then each argument's evidence, where it ran and its levers, then one row per
lever (its spec, listed in correctness/registry.py) with its evidence and the test that holds a
stand-in equal to upstream, where one does, and last the numerics arguments without a lever, with the reason. An
argument several levers cover takes the strongest of theirs. A change of a numerics argument without
a lever needs review (`correctness classify`).

--results DIR: the lever records under DIR. A GPU record of a lever upgrades its evidence to gpu-run
(the device and the date); a CPU record at the tier a declaration names checks it, and a record that
contradicts one (an `upstream` candidate bitwise its default, a `bookkeeping` one that differs) is
listed, and the exit status is 1.

--json: {"classes": {class: meaning}, "evidence": {class: how many numerics arguments it is the
strongest evidence of}, "numerics_arguments" (how many, with a lever or without), "arguments": [{"argument",
"levers": [evidence of each of its levers, strongest first], and the fields of the first}], "levers":
[{"name", "version", "tiers", "description", "arguments", "evidence", "argument_evidence": {argument:
evidence}}], "uncovered": [{"argument", "reason", "no_lever"}] (`no_lever`: why it has none), "results":
null or {"folder", "gpu_records", "cpu_records", "contradictions": [one line each]}}. Evidence is
{"lever", "class" (gpu-run where a GPU record upgrades it), "declared" (the lever's class), "tier",
"where", "what", "held_equal_by": [{"test", "upstream", "needs_gpu"}], "gpu_run": null or
{"device", "date", "tier", "recipe", "verdict", "record"}}.
"""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from correctness.commands import EXIT_FAIL, EXIT_OK, emit

if TYPE_CHECKING:  # the library is imported as the command runs: `levers --help` imports no torch
    from correctness.evidence import GpuRun, Results, Standing

WIDTH = 160  # the longest line the text form prints


def add_arguments(parser) -> None:
    parser.add_argument("--results", metavar="DIR", type=Path,
                        help="a results folder: its GPU records upgrade a lever's evidence to gpu-run, its CPU records"
                             " check the declarations")


def standing(name: str, argument: str | None, gpu_runs: Sequence[GpuRun]) -> Standing:
    """Lever `name`'s evidence for `argument` (None: the lever's own), upgraded by one of the GPU runs."""
    from correctness.evidence import Standing, gpu_run_for
    from correctness.registry import KNOWN_LEVERS

    lever = KNOWN_LEVERS[name]
    declared = lever.argument_evidence.get(argument, lever.evidence)
    return Standing(lever=name, declared=declared, gpu_run=gpu_run_for(declared, name, lever.version, gpu_runs))


def _gpu_run_json(run: GpuRun | None) -> dict | None:
    if run is None:
        return None
    return {"device": run.device, "date": run.date, "tier": run.tier, "recipe": run.recipe, "verdict": run.verdict,
            "record": run.path}


def standing_json(entry: Standing) -> dict:
    return {
        "lever": entry.lever, "class": entry.klass, "declared": entry.declared.klass, "tier": entry.declared.tier,
        "where": entry.where, "what": entry.declared.what,
        "held_equal_by": [dataclasses.asdict(held) for held in entry.declared.held_equal_by], "gpu_run": _gpu_run_json(entry.gpu_run),
    }


def coverage(results: Results | None = None) -> dict:
    from correctness.classify import load_rules
    from correctness.evidence import MEANINGS, class_counts, contradiction, strongest
    from correctness.lever_spec import RECIPE_GPU
    from correctness.registry import KNOWN_LEVERS
    from correctness.tiers import GPU_MARKERS

    rules = load_rules()
    gpu_runs = results.gpu if results is not None else ()
    numerics = {flag: rule for flag, rule in rules.arguments.items() if rule.klass == "numerics"}
    covered = [flag for flag, rule in numerics.items() if rule.levers]
    gpus = ", ".join(GPU_MARKERS)
    arguments = []
    for flag in covered:
        standings = strongest(standing(name, flag, gpu_runs) for name in numerics[flag].levers)
        arguments.append({"argument": flag, **standing_json(standings[0]),
                          "levers": [standing_json(entry) for entry in standings]})
    levers = [
        {
            "name": name,
            "version": lever.version,
            "tiers": [f"{RECIPE_GPU} ({gpus})" if tier == RECIPE_GPU else tier for tier in lever.tiers],
            "description": rules.levers[name].description if name in rules.levers else "",
            "arguments": [flag for flag in covered if name in numerics[flag].levers],
            "evidence": standing_json(standing(name, None, gpu_runs)),
            "argument_evidence": {flag: standing_json(standing(name, flag, gpu_runs))
                                  for flag in lever.argument_evidence},
        }
        for name, lever in KNOWN_LEVERS.items()
    ]
    return {
        "classes": MEANINGS,
        "evidence": class_counts(entry["class"] for entry in arguments),
        "numerics_arguments": len(numerics),
        "arguments": arguments,
        "levers": levers,
        "uncovered": [{"argument": flag, "reason": rule.reason, "no_lever": rule.no_lever}
                      for flag, rule in numerics.items() if not rule.levers],
        "results": None if results is None else {
            "folder": results.folder, "gpu_records": len(results.gpu), "cpu_records": len(results.cpu),
            "contradictions": [found for name, lever in KNOWN_LEVERS.items()
                               if (found := contradiction(lever.evidence, name, lever.version, results.cpu))],
        },
    }


def wrapped_table(header: Sequence[str], rows: Sequence[Sequence[str]], width: int = WIDTH) -> list[str]:
    """format_table with the last column wrapped so that no line is longer than `width`."""
    from correctness.report import format_table

    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
    room = max(width - sum(widths) - 2 * len(widths), 20)
    lines = []
    for row in rows:
        last = textwrap.wrap(row[-1], room, break_on_hyphens=False) or [""]
        lines += [[*row[:-1], last[0]], *([*([""] * len(widths)), more] for more in last[1:])]
    return format_table(header, lines)


def _evidence_text(entry: dict) -> str:
    """What a lever's evidence is, with the test that holds its stand-in to upstream and its GPU run."""
    text = entry["what"]
    for held in entry["held_equal_by"]:
        text += f"; held equal to {held['upstream']} by {held['test']}"
        text += " (needs a CUDA GPU)" if held["needs_gpu"] else ""
    if not entry["held_equal_by"] and entry["declared"] == "stand-in":
        text += "; no test holds it equal to upstream"
    run = entry["gpu_run"]
    if run is not None:
        text += f"; ran on {run['device']} on {run['date']} ({run['recipe']}): {run['verdict']}"
    return text


def _levers_cell(entry: dict) -> str:
    first, *others = entry["levers"]
    return "; ".join([first["lever"], *(f"{other['lever']} ({other['class']})" for other in others)])


def text_lines(data: dict) -> list[str]:
    counts = ", ".join(f"{klass} {count}" for klass, count in data["evidence"].items())
    lines = [f"numerics arguments by their strongest evidence: {counts}; without a lever {len(data['uncovered'])}"]
    lines += ["  " + line for line in wrapped_table(["class", "meaning"], list(data["classes"].items()), WIDTH - 2)[1:]]
    lines.append("")
    lines += wrapped_table(["argument", "evidence", "where", "levers"],
                           [[entry["argument"], entry["class"], entry["where"], _levers_cell(entry)]
                            for entry in data["arguments"]])
    lines.append("")
    rows = []
    for lever in data["levers"]:
        evidence = lever["evidence"]
        rows.append([lever["name"], evidence["class"], evidence["where"], _evidence_text(evidence)])
        rows += [[f"  {flag}", entry["class"], entry["where"], _evidence_text(entry)]
                 for flag, entry in lever["argument_evidence"].items()]
    lines += wrapped_table(["lever", "evidence", "where", "what runs there"], rows)
    if data["uncovered"]:
        lines.append("")
        lines.append("without a lever:")
        lines += [textwrap.fill(f"{entry['argument']}: {entry['no_lever'] or entry['reason']}", WIDTH,
                                initial_indent="  ", subsequent_indent="    ") for entry in data["uncovered"]]
    results = data["results"]
    if results is not None:
        lines.append("")
        lines.append(f"records in {results['folder']}: {results['gpu_records']} GPU, {results['cpu_records']} CPU")
        lines += [textwrap.fill(f"contradicts its declaration: {found}", WIDTH, subsequent_indent="    ")
                  for found in results["contradictions"]]
    return lines


def run(args) -> int:
    from correctness.evidence import read_results

    results = read_results(args.results) if args.results is not None else None
    data = coverage(results)
    emit(args, text_lines(data), data)
    return EXIT_FAIL if results is not None and data["results"]["contradictions"] else EXIT_OK
