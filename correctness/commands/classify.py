"""Class each training argument a tuned recipe changes against its reference recipe.

    correctness classify CANDIDATE.yaml [--reference REFERENCE.yaml] [--rules RULES.yaml] [--json]

Compares the train.py arguments of the candidate's `run:` script with the reference's and classes
every changed, added or removed argument with the rules file (correctness/rules/arguments.yaml):
placement, numerics, batching, must-match or inert; an argument the rules do not list is unknown.
Each numerics change names the lever (component test) that covers it and the result the candidate
recipe carries for it in correctness.component_tests (matched by an entry's `lever:` key, or by its
`test:` title).

The reference is REFERENCE (any YAML file with a `run:` script, a whole recipe included), by default
fixtures/references/<candidate recipe id>.yaml; where there is none, the recipe's numerics arguments
are classed against Megatron's defaults (the rules' `default`), as `correctness run` judges them, and
the configuration is at best incomplete: the other arguments cannot be judged without a reference.

Configuration verdict: pass (no must-match change, no unknown argument, every numerics change's
lever passed), fail (a must-match change, or a numerics change whose lever failed), or incomplete
(an argument needs review, or a lever has no result).

Exit status: 0 the configuration passes; 1 it fails or is incomplete; 2 bad input (a malformed
recipe, no run script, no correctness block where a lever result is needed, a --reference that is
missing).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from correctness.commands import EXIT_FAIL, EXIT_OK, emit, table_width
from correctness.files import shown_path

if TYPE_CHECKING:  # the library is imported as the command runs: `classify --help` imports no torch
    from correctness.classify import Change, Classification


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("candidate", metavar="CANDIDATE.yaml", help="the tuned recipe")
    parser.add_argument("--reference", metavar="REFERENCE.yaml",
                        help="the reference's run script (default: fixtures/references/<recipe id>.yaml)")
    parser.add_argument("--rules", metavar="RULES.yaml", help="another rules file (default: the package's)")


def _row(change: Change) -> list[str]:
    from correctness.classify import COVERED, ERROR, OK, REVIEW

    if change.levers:
        result = ", ".join(change.result_of(lever) or "no result" for lever in change.levers)
    else:  # a row without a lever
        result = {OK: "-", ERROR: "ERROR", REVIEW: "REVIEW", COVERED: "convergence"}[change.outcome]
    reason = "; ".join([change.reason, *change.notes])
    return [
        change.flag,
        change.transition,
        change.klass,
        ", ".join(change.levers) or ("none" if change.klass == "numerics" else "-"),
        result,
        reason,
    ]


def _need(change: Change) -> str:
    """What a change still asks for before the configuration passes ("" for nothing)."""
    from correctness.classify import COVERED, ERROR, FAILED, MISSING, REVIEW, UNKNOWN
    from correctness.entries import format_limited_sentence
    from correctness.results import FAIL, FORMAT_LIMITED

    if change.outcome == ERROR:
        return "must match the reference (a configuration error)"
    if change.outcome == FAILED:
        failed = [lever for lever in change.levers if change.result_of(lever) == FAIL]
        return f"the {' and '.join(failed)} component test{'s' if len(failed) > 1 else ''} failed"
    if change.outcome == MISSING:
        limited = [lever for lever in change.levers if change.result_of(lever) == FORMAT_LIMITED]
        missing = [lever for lever in change.levers if not change.covers(change.result_of(lever)) and lever not in limited]
        needs = [f"a passing {' and a passing '.join(missing)} component test in correctness.component_tests"] if missing else []
        needs += [f"a passing convergence block: {', '.join(limited)} is format-limited"
                  f" ({format_limited_sentence('its format')})"] if limited else []
        return "needs " + "; and ".join(needs)
    if change.outcome == REVIEW:
        return "needs review (not classed by the rules file)" if change.klass == UNKNOWN else (
            "no lever covers this numerics change: needs a passing convergence block (correctness converge)")
    if change.outcome == COVERED and (not change.levers or FORMAT_LIMITED in change.lever_results.values()):
        return "covered by the recipe's passing convergence block" + (
            " (format-limited: " + format_limited_sentence("its format") + ")" if change.levers else " (no lever)")
    return ""


def report_lines(classification: Classification, width: int | None = None) -> list[str]:
    """The classification as a table (its last column cut to `width`) and what each change still needs."""
    from correctness.report import format_table

    counts = ", ".join(f"{count} {klass}" for klass, count in classification.counts.items() if count)
    lines = [
        f"classify {classification.recipe}: configuration {classification.verdict.upper()}",
        f"  against {shown_path(classification.reference)}",
        f"  {len(classification.changes)} changed arguments" + (f" ({counts})" if counts else ""),
    ]
    if classification.changes:
        header = ["flag", "reference -> candidate", "class", "lever", "result", "reason"]
        lines += ["  " + line for line in format_table(header, map(_row, classification.changes), width)]
    return lines + [f"  - {change.flag}: {need}" for change in classification.changes if (need := _need(change))]


def run(args: argparse.Namespace) -> int:
    from correctness.classify import load_rules
    from correctness.recipe_verdict import recipe_changes
    from correctness.recipes import load_recipe

    rules = load_rules(args.rules)
    candidate = load_recipe(args.candidate)
    classification = recipe_changes(candidate, args.reference, rules)
    emit(args, report_lines(classification, table_width(args)), classification.to_dict())
    return EXIT_OK if classification.verdict == "pass" else EXIT_FAIL
