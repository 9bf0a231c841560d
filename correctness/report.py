"""Plain-text reports: the verdict table of a lever run, and the full report of a failed case."""

import math
import textwrap
from collections.abc import Iterable, Sequence

from correctness.comparisons import TensorComparison
from correctness.entries import format_limited_sentence, ratio_range
from correctness.results import FORMAT_LIMITED, SKIP, CaseResult, LeverRecord, over_bound


def format_table(header: Sequence[str], rows: Iterable[Sequence[str]], width: int | None = None) -> list[str]:
    """Left-aligned columns, two spaces apart, the header first; with `width`, the last column cut
    (clip) so that no line is wider."""
    rows = [list(header)] + [list(row) for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    return lines if width is None else [clip(line, width) for line in lines]


def clip(text: str, width: int) -> str:
    """Text cut to `width` characters, an ellipsis marking the cut (the full text is in the record
    and behind --wide)."""
    return text if len(text) <= width else text[: width - 1] + "…"


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


TABLE_WIDTH = 120  # the widest line of a verdict table; the full figures are in the record and --wide
LINE_WIDTH = 160  # the widest line of any other output of the suite's commands


def fit_lines(lines: Iterable[str], width: int = LINE_WIDTH) -> list[str]:
    """Lines wrapped at `width`, each continuation indented two more than its line."""
    fitted = []
    for line in lines:
        if len(line) <= width:
            fitted.append(line)
            continue
        indent = " " * (len(line) - len(line.lstrip()) + 2)
        fitted += textwrap.wrap(line, width, subsequent_indent=indent, break_on_hyphens=False) or [line[:width]]
    return fitted


def clip_middle(text: str, width: int) -> str:
    """Text cut in the middle to `width` characters (a case id keeps its start and its seed)."""
    if len(text) <= width:
        return text
    head = (width - 1) // 2
    return text[:head] + "…" + text[len(text) - (width - 1 - head):]


def _controls_cell(case: CaseResult) -> str:
    """How the case's applicable controls did: against the format bound for a format-limited case
    (its powers there), else against the rule: `3 fail, least 26.3`, or the ones that pass."""
    if case.status == FORMAT_LIMITED and case.format is not None:
        powers = [(control.power, control.fails, control.name) for control in case.format.controls]
    else:
        powers = [(control.power, control.fails, control.name) for control in case.controls
                  if control.judgement is not None]
    if not powers:
        return "none applies"
    passing = [name for _, fails, name in powers if not fails]
    if passing:
        return clip("PASSES: " + ", ".join(passing), 24)
    least = min(power for power, _, _ in powers)
    figure = "nan" if math.isnan(least) else f"{least:.3g}"
    return f"{len(powers)} fail, least {figure}"


def _format_lines(record: LeverRecord) -> list[str]:
    """For format-limited cases: where the candidate sits against the format bound."""
    limited = [case for case in record.ran_cases() if case.status == FORMAT_LIMITED and case.format is not None]
    if not limited:
        return []
    name = limited[0].format.format
    shares = [t.error_over_bound for case in limited for t in case.format.candidate.tensors]
    rule = record.lever["rule"]
    return [clip(f"  format-limited ({name}), {len(limited)} case(s): candidate {min(shares):.2f}-{max(shares):.2f} of the"
                 f" format bound ({rule['factor']:g} x floor + {rule['slack']:g}); controls: against it", TABLE_WIDTH),
            clip(f"  {format_limited_sentence(name)}", TABLE_WIDTH)]


def _status_cell(case: CaseResult) -> str:
    return case.status if case.required else f"{case.status} (optional)"


def _ratios_cell(case: CaseResult) -> str:
    return ratio_range(t.ratio for t in case.candidate.tensors if t.ratio is not None and not math.isnan(t.ratio))


def _repeat_cell(case: CaseResult, same: str) -> str:
    if case.deterministic is None:
        return "-"
    return same if case.deterministic else "CHANGED " + ",".join(case.nondeterministic_tensors)


def _unjudged_lines(record: LeverRecord, width: int | None) -> list[str]:
    """The cases that were not judged: each error, and the skips counted by reason."""
    skipped: dict[str, int] = {}
    errors = []
    for case in record.cases:
        if case.candidate is not None:
            continue
        if case.status == SKIP:
            skipped[case.skip_reason or ""] = skipped.get(case.skip_reason or "", 0) + 1
        else:
            case_id = case.case_id if width is None else clip_middle(case.case_id, 40)
            errors.append(f"  error in {case_id}: {case.failures[0]}")
    lines = errors + [f"  skipped ({count}): {reason}" for reason, count in skipped.items()]
    return lines if width is None else [clip(line, width) for line in lines]


def verdict_table(record: LeverRecord, wide: bool = False) -> list[str]:
    """The lever's verdict, then each case: its id on a line of its own (cut in the middle where
    too long), its figures beneath. Figures are error/bound (over 1 fails): the candidate's worst
    tensor or slice, its error over the default's, and how its controls did (each must be over 1).
    Every line is at most TABLE_WIDTH; `wide`: the full table (wide_verdict_table)."""
    if wide:
        return wide_verdict_table(record)
    lever = record.lever
    floor = lever.get("format_floor")
    verdict = record.verdict.upper() + (f" ({floor['format']})" if record.verdict == FORMAT_LIMITED and floor else "")
    lines = [clip(f"{lever['name']} [{lever['tier']}] · recipe {record.recipe.id} · {verdict}", TABLE_WIDTH),
             clip(f"  {lever['candidate']} vs {lever['default']}", TABLE_WIDTH)]
    backends = list(dict.fromkeys(case.candidate.run.backend for case in record.ran_cases()))
    if len(backends) == 1:
        lines.append(clip(f"  candidate ran: {backends[0]}", TABLE_WIDTH))
    header = ["case / result", "err/bound", "err/default", "systematic", "repeat", "default", "controls"]
    rows: list[list[str]] = []
    for case in record.cases:
        rows.append([clip_middle(case.case_id, TABLE_WIDTH - 4)])
        if case.candidate is None:
            rows.append(["  " + _status_cell(case)])
            continue
        rows.append(["  " + case.status, clip(_worst(case.candidate.tensors), 26), _ratios_cell(case),
                     clip(_systematic_cell(case), 14), clip(_repeat_cell(case, "same"), 10),
                     "pass" if case.default_repeat.passes else "FAIL", _controls_cell(case)])
    widths = [max(len(row[i]) for row in [header] + [r for r in rows if len(r) > 1]) for i in range(len(header))]
    for row in [header] + rows:
        text = row[0] if len(row) == 1 else "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
        lines.append(clip("  " + text, TABLE_WIDTH))
    lines += _format_lines(record) + _unjudged_lines(record, TABLE_WIDTH)
    return lines + [clip(line, TABLE_WIDTH) for line in _completeness_lines(record)]


def wide_verdict_table(record: LeverRecord) -> list[str]:
    """The full table (`--wide`): one line for the lever, then a row per case with every figure
    uncut. Figures are error/bound (over 1 fails): the candidate's worst tensor or slice, and each
    negative control's (which must be over 1)."""
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
    for case in record.cases:
        if case.candidate is None:  # skipped, or failed with an error before its judgement
            rows.append([case.case_id, _status_cell(case)] + [""] * (len(header) - 2))
            continue
        bitwise = [t.bitwise_identical for t in case.candidate.tensors]
        rows.append(
            [
                case.case_id,
                case.status,
                case.candidate.run.backend,
                _worst(case.candidate.tensors),
                _ratios_cell(case),
                _systematic_cell(case),
                "all" if all(bitwise) else ("some" if any(bitwise) else "no"),
                _repeat_cell(case, "deterministic"),
                "pass" if case.default_repeat.passes else "FAIL",
            ]
            + [_control_cell(case, name) for name in control_names]
        )
    lines += ["  " + line for line in format_table(header, rows)]
    return lines + _format_lines(record) + _unjudged_lines(record, None) + _completeness_lines(record)


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
