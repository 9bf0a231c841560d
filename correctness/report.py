"""Plain-text reports: the verdict table of a lever run, and the full report of a failed case."""

from collections.abc import Iterable, Sequence

from correctness.results import CaseResult, Judgement, LeverRecord


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    rows = [list(header)] + [list(row) for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]


def _ratio_range(judgement: Judgement) -> str:
    ratios = [t.ratio for t in judgement.tensors if t.ratio is not None]
    if not ratios:
        return "-"
    return f"{min(ratios):.2f}-{max(ratios):.2f}"


def _worst(judgement: Judgement) -> str:
    worst = judgement.worst
    return f"{worst.error_over_bound:.2f} ({worst.tensor})"


def _control_cell(case: CaseResult, name: str) -> str:
    for control in case.controls:
        if control.name == name:
            if control.judgement is None:
                return "n/a"
            return f"{control.power:.2f}" + ("" if control.fails_bound else " PASSES")
    return "-"


def verdict_table(record: LeverRecord) -> list[str]:
    """One line for the lever, then a row per case. Figures are error/bound (over 1 fails):
    the candidate's worst tensor, and each negative control's (which must be over 1)."""
    lever = record.lever
    lines = [
        f"{lever['name']} [{lever['tier']}] {lever['candidate']} vs {lever['default']}"
        f" · recipe {record.recipe.id} · {record.verdict.upper()}"
    ]
    control_names = list(lever["controls"])
    header = ["case", "result", "candidate ran", "err/bound", "err/default", "bitwise", "repeat", "default x2"]
    header += [f"{name} err/bound" for name in control_names]
    rows = []
    skipped: dict[str, int] = {}
    for case in record.cases:
        if case.status == "skip":
            rows.append([case.case_id, "skip"] + [""] * (len(header) - 2))
            skipped[case.skip_reason or ""] = skipped.get(case.skip_reason or "", 0) + 1
            continue
        bitwise = [t.bitwise_identical for t in case.candidate.tensors]
        rows.append(
            [
                case.case_id,
                case.status,
                case.candidate.run.backend,
                _worst(case.candidate),
                _ratio_range(case.candidate),
                "all" if all(bitwise) else ("some" if any(bitwise) else "no"),
                "deterministic" if case.deterministic else "CHANGED " + ",".join(case.nondeterministic_tensors),
                "pass" if case.default_repeat.passes else "FAIL",
            ]
            + [_control_cell(case, name) for name in control_names]
        )
    lines += ["  " + line for line in _table(header, rows)]
    return lines + [f"  skipped ({count}): {reason}" for reason, count in skipped.items()]


def case_report(lever_name: str, case: CaseResult) -> str:
    """Everything needed to understand a failed case: what failed and every tensor's figures."""
    lines = [f"{lever_name} · case {case.case_id} (seed {case.seed}, {case.source}): {case.status.upper()}"]
    lines += [f"  - {failure}" for failure in case.failures]
    judged = [("candidate", case.candidate), ("candidate repeat", case.candidate_repeat),
              ("default repeat", case.default_repeat)]
    judged += [(f"control: {c.name}", c.judgement) for c in case.controls if c.judgement is not None]
    header = ["path", "backend", "tensor", "error", "default err", "bound", "err/bound", "bias", "slack only", "bitwise"]
    rows = []
    for role, judgement in judged:
        if judgement is None:
            continue
        for t in judgement.tensors:
            rows.append([role, judgement.run.backend, t.tensor, f"{t.error:.3e}", f"{t.default_error:.3e}",
                         f"{t.bound:.3e}", f"{t.error_over_bound:.2f}", f"{t.bias:+.1e}",
                         "yes" if t.slack_only else "", "yes" if t.bitwise_identical else ""])
    return "\n".join(lines + ["  " + line for line in _table(header, rows)])
