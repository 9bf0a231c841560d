"""The suite's levers, the tiers they run in, and the numerics arguments each covers.

    correctness levers [--json]

One row per lever (correctness/registry.py, with its description from the rules file,
correctness/rules/arguments.yaml), then the count the rules file gives: numerics arguments with a
lever, of all numerics arguments, and those without one. A change of a numerics argument without a
lever needs review (`correctness classify`).

--json: {"levers": [{"name", "version", "tiers", "description", "arguments"}], "numerics_arguments",
"covered", "uncovered": [{"argument", "reason", "no_lever"}]} (`no_lever`: why the argument has no lever).
"""

from correctness.classify import load_rules
from correctness.commands import EXIT_OK, emit
from correctness.registry import KNOWN_LEVERS, RECIPE_GPU
from correctness.report import format_table
from correctness.tiers import GPU_MARKERS


def add_arguments(parser) -> None:
    del parser  # no options beyond --json


def coverage() -> dict:
    rules = load_rules()
    numerics = {flag: rule for flag, rule in rules.arguments.items() if rule.klass == "numerics"}
    covered = [flag for flag, rule in numerics.items() if rule.levers]
    gpus = ", ".join(GPU_MARKERS)
    levers = [
        {
            "name": name,
            "version": lever.version,
            "tiers": [f"{RECIPE_GPU} ({gpus})" if tier == RECIPE_GPU else tier for tier in lever.tiers],
            "description": rules.levers[name].description if name in rules.levers else "",
            "arguments": [flag for flag in covered if name in numerics[flag].levers],
        }
        for name, lever in KNOWN_LEVERS.items()
    ]
    return {
        "levers": levers,
        "numerics_arguments": len(numerics),
        "covered": len(covered),
        "uncovered": [{"argument": flag, "reason": rule.reason, "no_lever": rule.no_lever}
                      for flag, rule in numerics.items() if not rule.levers],
    }


def run(args) -> int:
    data = coverage()
    rows = [[lever["name"], ", ".join(lever["tiers"]), ", ".join(lever["arguments"]) or "-"] for lever in data["levers"]]
    lines = format_table(["lever", "tiers", "numerics arguments"], rows)
    lines.append("")
    lines.append(f"numerics arguments with a lever: {data['covered']} of {data['numerics_arguments']}")
    if data["uncovered"]:
        lines.append("without one:")
        lines += [f"  {entry['argument']}: {entry['no_lever'] or entry['reason']}" for entry in data["uncovered"]]
    emit(args, lines, data)
    return EXIT_OK
