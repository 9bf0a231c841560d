"""A horizontal bar chart on a log scale with the bound at 1: the form of the err/bound, systematic
and optimizer figures. One row per bar, its value written beside it, rows in labelled groups."""

import math
from collections.abc import Sequence
from dataclasses import dataclass

from correctness.report_page.svg import BLACK, GREY, LIGHT_GREY, LogScale, Svg, draw_log_axis

WIDTH = 1000
GROUP_WIDTH = (50, 220)  # the group's label (a tensor, a layer): the least and the most room
LABEL_WIDTH = (120, 380)  # the row's label (a role, a parameter)
TEXT_WIDTH = 160  # room for the value right of the bar
ROW, BAR = 15, 10  # a row's height and its bar's
GAP = 7  # between groups
TOP, BOTTOM = 22, 20  # the axis labels above, the bound's label below
CHARACTER = 0.58  # a character's width in ems, roughly, for cutting labels to fit


@dataclass(frozen=True)
class Bar:
    group: str  # written on the group's first row
    label: str  # the row's own label
    value: float | None  # err/bound (or a figure over its threshold); None or infinite: non-finite
    colour: str
    text: str  # the value as written beside the bar
    title: str  # the tooltip: which case, role and record field
    css: str | None = None  # a class for the bar (e.g. the offload share)


def fit(text: str, width: float, size: float = 11, keep_end: bool = False) -> str:
    """Text cut with an ellipsis to about `width` pixels at font `size` (its start kept, or its end)."""
    room = max(int(width / (size * CHARACTER)) - 1, 1)
    if len(text) <= room + 1:
        return text
    return "…" + text[-room:] if keep_end else text[:room] + "…"


def _room(texts: Sequence[str], size: float, limits: tuple[int, int], bold: bool = False) -> float:
    """Pixels for a column of labels: the longest one's, within `limits`."""
    longest = (max((len(text) for text in texts), default=0) + 2) * size * (CHARACTER + 0.08 * bold) + 14
    return min(max(longest, limits[0]), limits[1])


def bar_chart(bars: Sequence[Bar], label: str, bound_label: str = "bound", keep_label_end: bool = False) -> Svg:
    """The bars, grouped as they come (a group is consecutive bars with one `group`), on a log
    scale of the values with 1 (the bound) drawn bold; a label too long is cut at its end, or at
    its start where `keep_label_end` (a tensor's name says most at its end)."""
    groups = [bar.group for index, bar in enumerate(bars) if index == 0 or bars[index - 1].group != bar.group]
    height = TOP + len(bars) * ROW + (len(groups) - 1) * GAP + BOTTOM + 6
    svg = Svg(WIDTH, height, label)
    group_width = _room(groups, 11, GROUP_WIDTH, bold=True)
    label_width = _room([bar.label for bar in bars], 10, LABEL_WIDTH)
    left = group_width + label_width
    scale = LogScale.around([bar.value for bar in bars], left, WIDTH - TEXT_WIDTH)
    draw_log_axis(svg, scale, TOP, height - BOTTOM, bound_label)
    y = TOP
    for index, bar in enumerate(bars):
        if index and bars[index - 1].group != bar.group:
            y += GAP
            svg.line(0, y - GAP / 2, WIDTH - TEXT_WIDTH, y - GAP / 2, stroke=LIGHT_GREY, stroke_width=1)
        if index == 0 or bars[index - 1].group != bar.group:
            svg.text(0, y + BAR, fit(bar.group, group_width - 14, 11 * (1 + 0.08 / CHARACTER)), size=11,
                     font_weight="600", fill=BLACK)
        svg.text(group_width, y + BAR, fit(bar.label, label_width - 8, 10, keep_label_end), size=10, fill=BLACK)
        _draw_bar(svg, scale, bar, y, left)
        y += ROW
    return svg


def _draw_bar(svg: Svg, scale: LogScale, bar: Bar, y: float, left: float) -> None:
    finite = bar.value is not None and math.isfinite(bar.value)
    end = scale.x(bar.value if finite else math.inf)
    if finite and bar.value <= 0:  # exactly zero: a dot at the scale's low end, no bar
        svg.circle(left + 3, y + BAR / 2, 3, bar.title, fill=bar.colour, stroke=GREY, class_=bar.css)
    else:
        svg.rect(left, y, max(end - left, 2.0), BAR, bar.title, fill=bar.colour, stroke=GREY, stroke_width=0.5,
                 class_=bar.css, **({} if finite else {"stroke_dasharray": "3 2"}))
    x, width = max(end, left + 6) + 4, len(bar.text) * 10 * CHARACTER
    if x - 2 <= scale.x(1.0) <= x + width:  # the label lies over the bound's line: a white ground under it
        svg.rect(x - 1, y - 1, width + 2, BAR + 2, fill="#FFFFFF", opacity="0.9")
    svg.text(x, y + BAR - 1, bar.text, size=10, fill=BLACK, class_="value")
