"""The optimizer levers' figure (optimizer-offload, precision-aware-adam): err/bound per parameter
tensor, grouped by layer, the GPU share apart from the CPU share, and the share's pooled figures.

Tensors are named `<Megatron parameter name>:<quantity>` (docs/record-format.md); a case's `shape`
says which share holds each parameter (`inventory`, else `gpu_tensors`), and its `summary` pools
each share's quantities (correctness.wording.optimizer_offload reads them the same way)."""

import re
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from correctness.report_page.bars import Bar, bar_chart
from correctness.report_page.markup import RecordLink, figure, json_pointer, table, tag
from correctness.report_page.records import LoadedRecord
from correctness.report_page.roles import Mark, roles, worst_marks
from correctness.report_page.svg import BLUE, ORANGE, escape, figure_value
from correctness.wording.optimizer_offload import EXPERT, number_ranges

OPTIMIZER_LEVERS = ("optimizer-offload", "precision-aware-adam")
QUANTITIES = ("master", "update", "bf16", "exp_avg", "exp_avg_sq")
SHARE_COLOURS = {"gpu": BLUE, "cpu": ORANGE}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def is_optimizer_record(loaded: LoadedRecord) -> bool:
    ran = loaded.record.ran_cases()
    return loaded.record.lever["name"] in OPTIMIZER_LEVERS and bool(ran) and all(
        ":" in t.tensor for t in ran[0].candidate.tensors)


def _share_of(shape: Mapping[str, Any]) -> Callable[[str], str]:
    inventory = {entry["name"]: entry["share"] for entry in shape.get("inventory", ())}
    gpu = set(shape.get("gpu_tensors", ()))
    return lambda name: inventory.get(name) or ("gpu" if name in gpu else "cpu" if gpu else "?")


def _where(name: str, shape: Mapping[str, Any]) -> tuple[int, str, str]:
    """(order, layer, the parameter's name within it) of a parameter."""
    kinds = dict(zip(shape.get("layers", ()), shape.get("layer_kinds", ())))
    if name.startswith("embedding."):
        return -1, "embedding", name.removeprefix("embedding.")
    layer = _LAYER.match(name)
    if layer:
        number = int(layer[1])
        kind = f" ({kinds[number]})" if number in kinds else ""
        return number, f"layer {number}{kind}", layer[2]
    head, _, rest = name.partition(".")
    return 10**9, head, rest or name


class ParameterRow(NamedTuple):
    group: str  # `layer 1 (moe) · GPU share`
    share: str  # gpu, cpu, or ? where the shape does not say
    label: str  # the parameter's name within its layer
    mark: Mark  # its worst quantity
    count: int  # parameters in the row (experts of one layer, weight and share are one row)


def _rows(marks: dict[str, Mark], shape: Mapping[str, Any]) -> list[ParameterRow]:
    """A row per parameter (the experts of one layer, weight and share as one, their worst), by
    layer, the GPU share first."""
    share_of = _share_of(shape)
    rows: dict[tuple, list] = {}
    for parameter, mark in marks.items():
        order, layer, label = _where(parameter, shape)
        share = share_of(parameter)
        expert = EXPERT.match(parameter)
        key = (order, share != "gpu", layer, share, f"experts.{expert[2]}" if expert else label)
        entry = rows.setdefault(key, [mark, []])
        entry[1].append(int(expert[3]) if expert else 0)
        if mark.value > entry[0].value:
            entry[0] = mark
    found = []
    for (_, _, layer, share, label), (mark, experts) in sorted(rows.items(), key=lambda item: item[0][:2]):
        if label.startswith("experts."):
            label = f"mlp.{label}.weight{number_ranges(experts).replace(' and ', ', ')}"
        found.append(ParameterRow(f"{layer} · {share.upper()}", share, label, mark, len(experts)))
    return found


def _summary_table(loaded: LoadedRecord, link: RecordLink, case_index: int) -> str:
    summary = loaded.record.cases[case_index].summary
    shares = [share for share in ("gpu", "cpu") if share in summary]
    if not shares:
        return ""
    rows = []
    for share in shares:
        part = summary[share]
        quantities = part.get("quantities", {})
        ratios = [figure_value(quantities[q]["ratio"]) if q in quantities and quantities[q]["ratio"] is not None
                  else "-" for q in QUANTITIES]
        rows.append([escape(share.upper()), escape(part.get("tensors", "-")), escape(f"{part.get('parameters', 0):,}"),
                     *map(escape, ratios), escape("yes" if part.get("bitwise_identical_to_default") else "no")])
    header = ["share", "tensors", "parameters", *(f"{q} error ratio" for q in QUANTITIES), "bitwise the default"]
    source = link.anchor(json_pointer("cases", case_index, "summary"))
    note = tag("p", "Each share's tensors pooled as one, per quantity: the candidate's error over the default's"
                    f" (1: as accurate as the default), from {source}", class_="note")
    return table(header, rows) + note


def optimizer_figure(loaded: LoadedRecord, link: RecordLink) -> str:
    """err/bound per parameter tensor (worst of its quantities and of the cases), by layer and share."""
    record = loaded.record
    ran = [index for index, case in enumerate(record.cases) if case.candidate is not None]
    shape = record.cases[ran[0]].shape
    marks = worst_marks(record, roles(record)[0], lambda tensor: tensor.rsplit(":", 1)[0])
    bars = []
    for row in _rows(marks, shape):
        mark, value = row.mark, figure_value(row.mark.value)
        worst_of = f", worst of {row.count}" if row.count > 1 else ""
        bars.append(Bar(group=row.group, label=row.label, value=mark.value, colour=SHARE_COLOURS.get(row.share, BLUE),
                        text=f"{value} ({mark.tensor.rsplit(':', 1)[1]}{worst_of})",
                        title=f"{mark.tensor} · case {mark.case_id}: err/bound {value} ({mark.pointer})",
                        css=f"share-{row.share}"))
    svg = bar_chart(bars, f"err/bound per parameter tensor by layer and share for {record.lever['record_id']}",
                    keep_label_end=True)
    cases = "" if len(ran) == 1 else f" Each row is the worst of the {len(ran)} cases that ran."
    if record.lever.get("format_floor"):
        cases += (" The bound is the rule's: a format-limited case lies outside it as far as its format floor does"
                  " (the err/bound figure above draws the floor).")
    caption = (
        f"the candidate's err/bound per parameter tensor, the worst of its quantities ({', '.join(QUANTITIES)}; the"
        f" one in brackets), grouped by layer, the GPU share (blue) apart from the CPU share (orange), log scale, the"
        f" bound at 1. The experts of one layer, weight and share are one row, their worst.{cases}"
    )
    pointer = json_pointer("cases", ran[0], "candidate", "tensors") if len(ran) == 1 else json_pointer("cases")
    return figure("offload", svg, "<b>Per parameter tensor</b>: " + escape(caption), link.anchor(pointer),
                  after=_summary_table(loaded, link, ran[0]))
