"""The heatmap of a sliced tensor (attention, THD packing, RoPE): every slice's err/bound over
heads x position blocks, from the candidate's first run of the case whose worst slice is worst,
that slice outlined."""

import math
import re
from collections.abc import Sequence

from correctness.compare import TensorComparison
from correctness.report_page.bars import fit
from correctness.report_page.markup import RecordLink, figure, json_pointer
from correctness.report_page.records import LoadedRecord
from correctness.report_page.svg import BLACK, GREY, Svg, escape, figure_value, ratio_colour
from correctness.results import over_bound

WIDTH = 1000
ROW_LABEL = 130  # "positions 1152-1279"
CELL_HEIGHT = 17
MAX_PANELS = 4  # leading indices (batch rows) drawn one panel each; above, the worst one's alone
KEY = (1e-3, 1e-2, 0.1, 0.5, 1.0, 2.0, 10.0, 100.0)


def _block(slicing: str | None) -> int | None:
    found = re.search(r"per (\d+) positions", slicing or "")
    return int(found[1]) if found else None


def _worst_case(loaded: LoadedRecord, name: str) -> tuple[int, int, TensorComparison] | None:
    """(case index, tensor index, tensor) of the candidate's tensor `name` whose worst slice is worst."""
    found = []
    for case_index, case in enumerate(loaded.record.cases):
        if case.candidate is None:
            continue
        for tensor_index, tensor in enumerate(case.candidate.tensors):
            if tensor.tensor == name and tensor.slices is not None and tensor.slices.grid:
                found.append((over_bound(tensor.slices), case_index, tensor_index, tensor))
    if not found:
        return None
    _, case_index, tensor_index, tensor = max(found, key=lambda item: item[0])
    return case_index, tensor_index, tensor


def sliced_tensors(loaded: LoadedRecord) -> list[str]:
    """The candidate's tensors that carry every slice's figure (a grid), in the record's order."""
    names: dict[str, None] = {}
    for case in loaded.record.ran_cases():
        names.update(dict.fromkeys(t.tensor for t in case.candidate.tensors if t.slices is not None and t.slices.grid))
    return list(names)


def _row_label(block: int, size: int | None, positions: int) -> str:
    if size is None:
        return f"block {block}"
    return f"positions {block * size}-{min((block + 1) * size, positions) - 1}"


def _panel(svg: Svg, top: float, values: Sequence[float], blocks: int, heads: int, labels: list[str],
           worst: tuple[int, int] | None, cell: float, title: str) -> float:
    """One grid of blocks (rows) x heads (columns) from `top`; returns where it ends."""
    svg.text(0, top + 11, title, size=11, font_weight="600", fill=BLACK)
    top += 18
    for head in range(heads):
        svg.text(ROW_LABEL + (head + 0.5) * cell, top + 10, f"h{head}", size=9, anchor="middle", fill=GREY)
    top += 14
    size = max(min(9.5, cell / 4.4), 5)
    for block in range(blocks):
        y = top + block * CELL_HEIGHT
        svg.text(ROW_LABEL - 6, y + 12, labels[block], size=9, anchor="end", fill=BLACK)
        for head in range(heads):
            value = values[block * heads + head]
            fill, ink = ratio_colour(value)
            x = ROW_LABEL + head * cell
            svg.rect(x, y, cell - 1, CELL_HEIGHT - 1, f"{labels[block]}, head {head}: err/bound {figure_value(value)}",
                     fill=fill)
            svg.text(x + cell / 2, y + 12, figure_value(value), size=size, anchor="middle", fill=ink)
    if worst is not None:  # outlined black with a white line inside: seen on a light cell and a dark one
        block, head = worst
        x, y = ROW_LABEL + head * cell - 1.5, top + block * CELL_HEIGHT - 1.5
        svg.rect(x, y, cell + 2, CELL_HEIGHT + 2, "the worst slice", fill="none", stroke=BLACK, stroke_width=3.5,
                 class_="worst")
        svg.rect(x + 2, y + 2, cell - 2, CELL_HEIGHT - 2, fill="none", stroke="#FFFFFF", stroke_width=1.2)
    return top + blocks * CELL_HEIGHT


def _key(svg: Svg, top: float) -> None:
    svg.text(0, top + 12, "err/bound:", size=10, fill=BLACK)
    for index, value in enumerate(KEY):
        fill, ink = ratio_colour(value)
        svg.rect(ROW_LABEL + index * 52, top, 50, 16, f"colour of err/bound {value:g}", fill=fill)
        svg.text(ROW_LABEL + index * 52 + 25, top + 12, f"{value:g}", size=9, anchor="middle", fill=ink)


def _flat_leading(shape: Sequence[int], index: Sequence[int]) -> int:
    """The slice's leading indices (batch rows) as one, row-major."""
    leading = 0
    for size, position in zip(shape[:-2], index[:-2]):
        leading = leading * size + position
    return leading


def _panels(shape: Sequence[int], worst_index: Sequence[int]) -> list[int]:
    """The leading indices drawn: all where few, else the worst slice's alone."""
    count = math.prod(shape[:-2])
    return list(range(count)) if count <= MAX_PANELS else [_flat_leading(shape, worst_index)]


def heatmap_figure(loaded: LoadedRecord, link: RecordLink, name: str) -> str:
    """The heatmap of the candidate's tensor `name` in its worst case; "" where it has no grid."""
    found = _worst_case(loaded, name)
    if found is None:
        return ""
    case_index, tensor_index, tensor = found
    slices, case = tensor.slices, loaded.record.cases[case_index]
    *leading, blocks, heads = slices.grid_shape
    size, positions = _block(loaded.record.lever.get("slicing")), tensor.shape[-3] if len(tensor.shape) >= 3 else 0
    labels = [_row_label(block, size, positions) for block in range(blocks)]
    cell = max(min((WIDTH - ROW_LABEL - 10) / heads, 56.0), 12.0)
    panels = _panels(slices.grid_shape, slices.worst_index)
    height = len(panels) * (32 + blocks * CELL_HEIGHT + 10) + 30
    svg = Svg(max(WIDTH, ROW_LABEL + heads * cell + 10), height, f"err/bound per slice of {name}")
    top, per_panel = 0.0, blocks * heads
    worst_panel = _flat_leading(slices.grid_shape, slices.worst_index)
    for panel in panels:
        values = slices.grid[panel * per_panel:(panel + 1) * per_panel]
        title = fit(f"{name}" + (f", batch row {panel}" if leading else ""), 400)
        top = _panel(svg, top, values, blocks, heads, labels,
                     tuple(slices.worst_index[-2:]) if panel == worst_panel else None, cell, title) + 10
    _key(svg, top)
    blocks_of = f"blocks of {size} positions" if size else "position blocks"
    caption = (
        f"err/bound of every slice of {name} (heads across, {blocks_of} down) in the candidate's first run of case"
        f" {case.case_id}, the case where its worst slice is worst."
        f" Outlined: the worst slice, {slices.worst} ({figure_value(slices.error_over_bound)}); {slices.count} slices,"
        f" {slices.failing} outside their own bound. Blue below the bound, orange to vermillion above."
    )
    if len(panels) < math.prod(slices.grid_shape[:-2]):
        caption += f" Only the worst slice's leading index of {math.prod(slices.grid_shape[:-2])} is drawn."
    pointer = json_pointer("cases", case_index, "candidate", "tensors", tensor_index, "slices")
    return figure("heatmap", svg, f"<b>Slices of {escape(name)}</b>: " + escape(caption), link.anchor(pointer))

