"""The figures every lever record has: err/bound per tensor for each role (the candidate, its
repeat, the positive control, each negative control, the format floor), and the candidate's
systematic slope against its threshold. The sliced and optimizer figures are in their own modules."""

import math

from correctness.compare import TensorComparison
from correctness.report_page.bars import Bar, bar_chart
from correctness.report_page.markup import RecordLink, figure, json_pointer
from correctness.report_page.records import LoadedRecord
from correctness.report_page.roles import MAX_ROWS, Mark, roles, tensor_groups, tensor_names, worst_marks
from correctness.report_page.svg import BLUE, ORANGE, VERMILLION, escape, figure_value
from correctness.results import LeverRecord


def _cases_sentence(record: LeverRecord) -> str:
    ran = len(record.ran_cases())
    if ran == 1:
        return "One case ran."
    return (f"{ran} cases ran: each bar is the worst of them for its role and tensor (the case is in its tooltip;"
            " every case's figures are in the table below).")


def _pointer_to_cases(record: LeverRecord) -> str:
    ran = [index for index, case in enumerate(record.cases) if case.candidate is not None]
    return json_pointer("cases", ran[0]) if len(ran) == 1 else json_pointer("cases")


def _shown_groups(order: list[str], candidate: dict[str, Mark]) -> tuple[list[str], str | None]:
    """The groups a figure shows: all, or where there are too many, those whose candidate is
    nearest the bound."""
    if len(order) <= MAX_ROWS:
        return order, None
    kept = set(sorted(order, key=lambda group: -candidate[group].value if group in candidate else 0)[:MAX_ROWS])
    return [group for group in order if group in kept], f"the {MAX_ROWS} of {len(order)} nearest the bound shown"


def _tooltip(label: str, mark: Mark, what: str) -> str:
    return f"{label} · {mark.tensor} · case {mark.case_id}: {what} {figure_value(mark.value)} ({mark.pointer})"


def err_bound_figure(loaded: LoadedRecord, link: RecordLink) -> str:
    """err/bound per tensor (or group of tensors) for every role, log scale, the bound at 1."""
    record = loaded.record
    names = tensor_names(record)
    group_of, grouped = tensor_groups(names)
    found = [(role, worst_marks(record, role, group_of)) for role in roles(record)]
    order = list(dict.fromkeys(group_of(name) for name in names))
    shown, cut = _shown_groups(order, found[0][1])
    bars = [Bar(group=group, label=role.label, value=marks[group].value, colour=role.colour,
                text=figure_value(marks[group].value), title=_tooltip(role.label, marks[group], "err/bound"))
            for group in shown for role, marks in found if group in marks]
    svg = bar_chart(bars, f"err/bound per tensor and role for {record.lever['record_id']}")
    notes = " ".join(f"{note.capitalize()}." for note in (grouped, cut) if note)
    caption = (
        "log scale, the bound at 1: the candidate, its repeat and the default repeated (the positive control) must"
        f" lie left of it, every negative control right of it. {_cases_sentence(record)} {notes}"
    )
    if record.lever.get("format_floor"):
        caption += (" The format floor is the FP64 reference passed through the format's roundings alone: a candidate"
                    " outside the bound only as far as the floor is format-limited.")
    return figure("err-bound", svg, "<b>err/bound per tensor</b>, " + escape(caption),
                  link.anchor(_pointer_to_cases(record)))


def slope_over_threshold(tensor: TensorComparison) -> float:
    """|slope| / the slope threshold of a tensor's systematic diagnostic."""
    slope, threshold = tensor.systematic.slope, tensor.systematic.slope_threshold
    if math.isnan(slope) or math.isnan(threshold):
        return math.inf
    return abs(slope) / threshold if threshold > 0 else (math.inf if slope else 0.0)


def _systematic_bar(record: LeverRecord, group: str, mark: Mark, grouped: bool) -> Bar:
    case = record.cases[mark.case_index]
    tensor = next(t for t in case.candidate.tensors if t.tensor == mark.tensor)
    counted = mark.tensor in case.systematic
    text = (f"{figure_value(mark.value)} ({figure_value(abs(tensor.systematic.slope))}"
            f" / {figure_value(tensor.systematic.slope_threshold)})")
    if mark.value > 1 and not counted:
        text += " explained"
    colour = VERMILLION if mark.value > 1 and counted else ORANGE if mark.value > 1 else BLUE
    return Bar(group=group, label=mark.tensor if grouped else "candidate", value=mark.value, colour=colour,
               text=text, title=_tooltip("candidate", mark, "|slope| / threshold"))


def systematic_figure(loaded: LoadedRecord, link: RecordLink) -> str:
    """The candidate's scale slope against its threshold per tensor (above 1: flagged)."""
    record = loaded.record
    names = tensor_names(record)
    group_of, grouped = tensor_groups(names)
    marks = worst_marks(record, roles(record)[0], group_of, slope_over_threshold, "systematic")
    order = list(dict.fromkeys(group_of(name) for name in names))
    shown, cut = _shown_groups(order, marks)
    bars = [_systematic_bar(record, group, marks[group], bool(grouped)) for group in shown]
    svg = bar_chart(bars, f"systematic slope over its threshold per tensor for {record.lever['record_id']}",
                    bound_label="threshold", keep_label_end=True)
    notes = " ".join(f"{note.capitalize()}." for note in (grouped, cut) if note)
    caption = (
        "the candidate's scale slope ⟨e, ref⟩ / ⟨ref, ref⟩ against the FP64 reference over its threshold per tensor"
        " (the threshold grows with the default's own slope and with the error's noise), log scale, the label"
        " |slope| / threshold; above 1 the tensor is flagged (vermillion), unless a secondary reference explains the"
        " slope (orange, `explained`: e.g. FP32-rounded hyperparameters; not the candidate's own)."
        f" {_cases_sentence(record)} {notes}"
    )
    return figure("systematic", svg, "<b>Systematic error</b>: " + escape(caption),
                  link.anchor(_pointer_to_cases(record)))
