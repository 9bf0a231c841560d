"""Plain-text reports: the verdict table of a lever run, and the full report of a failed case."""

import math
from collections.abc import Iterable, Sequence

from correctness.compare import TensorComparison
from correctness.entries import ratio_range
from correctness.results import SKIP, CaseResult, LeverRecord, over_bound


def format_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    """Left-aligned columns, two spaces apart, the header first."""
    rows = [list(header)] + [list(row) for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]


def _worst(tensors: Sequence[TensorComparison]) -> str:
    """The largest error/bound over the tensors and their slices, with where it is."""
    worst = max(tensors, key=over_bound)
    figure = "nan" if math.isnan(worst.error_over_bound) else f"{worst.error_over_bound:.2f}"
    in_slice = worst.slices is not None and worst.error_over_bound == worst.slices.error_over_bound and (
        worst.whole_error_over_bound != worst.slices.error_over_bound)
    return f"{figure} ({worst.tensor}{' slice' if in_slice else ''})"


def _systematic_cell(case: CaseResult) -> str:
    return "FLAGGED " + ",".join(case.systematic) if case.systematic else "-"


def _control_cell(case: CaseResult, name: str) -> str:
    for control in case.controls:
        if control.name == name:
            if control.judgement is None:
                return "n/a"
            power = "nan" if math.isnan(control.power) else f"{control.power:.2f}"
            repeat = " not repeatable" if control.fails_repeatability else ""
            return power + repeat + ("" if control.fails else " PASSES")
    return "-"


def verdict_table(record: LeverRecord) -> list[str]:
    """One line for the lever, then a row per case. Figures are error/bound (over 1 fails): the
    candidate's worst tensor or slice, and each negative control's (which must be over 1)."""
    lever = record.lever
    lines = [
        f"{lever['name']} [{lever['tier']}] {lever['candidate']} vs {lever['default']}"
        f" · recipe {record.recipe.id} · {record.verdict.upper()}"
    ]
    control_names = list(lever["controls"])
    header = ["case", "result", "candidate ran", "err/bound", "err/default", "systematic", "bitwise", "repeat",
              "default x2"]
    header += [f"{name} err/bound" for name in control_names]
    rows = []
    skipped: dict[str, int] = {}
    errors = []
    for case in record.cases:
        if case.candidate is None:  # skipped, or failed with an error before its judgement
            rows.append([case.case_id, case.status if case.required else f"{case.status} (optional)"]
                        + [""] * (len(header) - 2))
            if case.status == SKIP:
                skipped[case.skip_reason or ""] = skipped.get(case.skip_reason or "", 0) + 1
            else:
                errors.append(f"  error in {case.case_id}: {case.failures[0]}")
            continue
        tensors = case.candidate.tensors
        bitwise = [t.bitwise_identical for t in tensors]
        ratios = [t.ratio for t in tensors if t.ratio is not None and not math.isnan(t.ratio)]
        repeat = ("-" if case.deterministic is None else "deterministic" if case.deterministic
                  else "CHANGED " + ",".join(case.nondeterministic_tensors))
        rows.append(
            [
                case.case_id,
                case.status,
                case.candidate.run.backend,
                _worst(tensors),
                ratio_range(ratios),
                _systematic_cell(case),
                "all" if all(bitwise) else ("some" if any(bitwise) else "no"),
                repeat,
                "pass" if case.default_repeat.passes else "FAIL",
            ]
            + [_control_cell(case, name) for name in control_names]
        )
    lines += ["  " + line for line in format_table(header, rows)]
    lines += errors + [f"  skipped ({count}): {reason}" for reason, count in skipped.items()]
    return lines + _completeness_lines(record)


def _completeness_lines(record: LeverRecord) -> list[str]:
    completeness = record.completeness
    lines = []
    if completeness.required_skipped:
        lines.append(f"  INCOMPLETE: {len(completeness.required_skipped)} required case(s) did not run:"
                     f" {', '.join(completeness.required_skipped)}")
    if completeness.missing:
        lines.append(f"  INCOMPLETE: {len(completeness.missing)} declared case(s) not in this run"
                     f" (deselected or interrupted): {', '.join(completeness.missing)}")
    return lines


def case_report(lever_name: str, case: CaseResult) -> str:
    """Everything needed to understand a failed case: what failed and every tensor's figures."""
    lines = [f"{lever_name} · case {case.case_id} (seed {case.seed}, {case.source}): {case.status.upper()}"]
    lines += [f"  - {failure}" for failure in case.failures]
    judged = [("candidate", case.candidate), ("candidate repeat", case.candidate_repeat),
              ("default repeat", case.default_repeat)]
    judged += [(f"control: {c.name}", c.judgement) for c in case.controls if c.judgement is not None]
    header = ["path", "backend", "tensor", "error", "default err", "bound", "err/bound", "worst slice err/bound",
              "slope (default)", "bias", "slack only", "bitwise"]
    rows = []
    for role, judgement in judged:
        if judgement is None:
            continue
        for t in judgement.tensors:
            worst_slice = "-" if t.slices is None else f"{t.slices.error_over_bound:.2f} ({t.slices.worst})"
            rows.append([role, judgement.run.backend, t.tensor, f"{t.error:.3e}", f"{t.default_error:.3e}",
                         f"{t.bound:.3e}", f"{t.whole_error_over_bound:.2f}", worst_slice,
                         f"{t.systematic.slope:+.1e} ({t.systematic.default_slope:+.1e})", f"{t.bias:+.1e}",
                         "yes" if t.slack_only else "", "yes" if t.bitwise_identical else ""])
    return "\n".join(lines + ["  " + line for line in format_table(header, rows)])
