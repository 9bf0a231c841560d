"""The convergence figure (`correctness report --curves CANDIDATE REFERENCE`): both loss curves
above their pointwise difference, as `correctness converge --plot` draws them
(correctness.convergence.picture), in SVG."""

import math
import os
from pathlib import Path
from urllib.parse import quote

import numpy as np

from correctness.convergence import THRESHOLDS, check_convergence, read_curve
from correctness.convergence.picture import ConvergencePicture, convergence_picture
from correctness.report_page.markup import figure, tag
from correctness.report_page.svg import (BLACK, BLUE, GREEN, GREY, LIGHT_GREY, ORANGE, PURPLE, VERMILLION,
                                         LinearScale, Svg, escape, figure_value, padded_range)

WIDTH, LEFT, RIGHT = 1000, 70, 190  # the plot area between LEFT and WIDTH - RIGHT; labels right of it
CURVES = (20, 290)  # the curves' panel, top and bottom
DIFFERENCE = (320, 470)
MAX_LABELLED = 12  # point-wise failures labelled one by one; more are counted in the caption


def _segments(xs: np.ndarray, ys: np.ndarray, x: LinearScale, y: LinearScale) -> list[list[tuple[float, float]]]:
    """The curve as polylines, broken where a loss is not finite."""
    segments: list[list[tuple[float, float]]] = [[]]
    for step, value in zip(xs, ys):
        if math.isfinite(value):
            segments[-1].append((x.at(float(step)), y.at(float(value))))
        elif segments[-1]:
            segments.append([])
    return [segment for segment in segments if segment]


def _axes(svg: Svg, x: LinearScale, y: LinearScale, top: float, bottom: float, name: str) -> None:
    for tick in y.ticks():
        svg.line(LEFT, y.at(tick), WIDTH - RIGHT, y.at(tick), stroke=LIGHT_GREY)
        svg.text(LEFT - 6, y.at(tick) + 4, f"{tick:.4g}", size=10, anchor="end", fill=GREY)
    for tick in x.ticks(8):
        svg.text(x.at(tick), bottom + 14, f"{tick:g}", size=10, anchor="middle", fill=GREY)
    svg.line(LEFT, bottom, WIDTH - RIGHT, bottom, stroke=GREY)
    svg.text(12, (top + bottom) / 2, name, size=11, fill=BLACK, anchor="middle",
             transform=f"rotate(-90 12 {(top + bottom) / 2:.0f})")


def _end_label(svg: Svg, x: LinearScale, y: LinearScale, picture: ConvergencePicture, losses: np.ndarray,
               label: str, colour: str, nudge: float) -> None:
    finite = np.flatnonzero(np.isfinite(losses))
    if len(finite):
        last = finite[-1]
        svg.text(x.at(float(picture.steps[last])) + 6, y.at(float(losses[last])) + nudge,
                 f"{label}: {figure_value(float(losses[last]))} at step {picture.steps[last]}", size=10, fill=colour)


def _curves_panel(svg: Svg, picture: ConvergencePicture, x: LinearScale) -> None:
    top, bottom = CURVES
    y = LinearScale(*padded_range(np.concatenate([picture.reference, picture.candidate])), bottom, top)
    if picture.skipped_until is not None:
        svg.rect(x.at(float(picture.steps[0])), top, x.at(picture.skipped_until) - x.at(float(picture.steps[0])),
                 bottom - top, f"skipped: the first {picture.skipped} points", fill="#F2F2F2")
        svg.text(x.at(float(picture.steps[0])) + 4, top + 12, f"skipped ({picture.skipped})", size=10, fill=GREY)
    _axes(svg, x, y, top, bottom, "loss")
    for losses, colour, label in ((picture.reference, BLUE, picture.reference_label),
                                  (picture.candidate, ORANGE, picture.candidate_label)):
        for segment in _segments(picture.steps, losses, x, y):
            svg.path(segment, label, fill="none", stroke=colour, stroke_width=1.6)
    _end_label(svg, x, y, picture, picture.reference, picture.reference_label, BLUE, -4)
    _end_label(svg, x, y, picture, picture.candidate, picture.candidate_label, ORANGE, 10)
    failed = np.flatnonzero(picture.failed)
    for index in failed:
        step, loss = float(picture.steps[index]), float(picture.candidate[index])
        svg.circle(x.at(step), y.at(loss), 3.5, f"point-wise failure at step {step:g}: {loss:.4g}",
                   fill="none", stroke=VERMILLION, stroke_width=1.5)
        if len(failed) <= MAX_LABELLED:
            svg.text(x.at(step), y.at(loss) - 6, f"{loss:.4g}", size=9, anchor="middle", fill=VERMILLION)
    for step in picture.nonfinite_steps:
        svg.line(x.at(float(step)), top, x.at(float(step)), bottom, stroke=VERMILLION, stroke_dasharray="2 2")
        svg.text(x.at(float(step)) + 2, top + 24, f"non-finite at {step}", size=9, fill=VERMILLION)


def _difference_panel(svg: Svg, picture: ConvergencePicture, x: LinearScale) -> None:
    top, bottom = DIFFERENCE
    y = LinearScale(*padded_range(np.concatenate([picture.difference, picture.band, -picture.band])), bottom, top)
    _axes(svg, x, y, top, bottom, "difference")
    steps = [float(step) for step in picture.steps]
    upper = [(x.at(s), y.at(float(b))) for s, b in zip(steps, picture.band) if math.isfinite(b)]
    lower = [(x.at(s), y.at(-float(b))) for s, b in zip(steps, picture.band) if math.isfinite(b)]
    svg.path(upper + lower[::-1], "point-wise tolerance band", closed=True, fill=GREEN, fill_opacity="0.15",
             stroke="none")
    svg.text(WIDTH - RIGHT + 6, y.at(0.0) + 30, "point-wise tolerance (green)", size=10, fill=GREEN)
    svg.line(LEFT, y.at(0.0), WIDTH - RIGHT, y.at(0.0), stroke=GREY)
    for segment in _segments(picture.steps, picture.difference, x, y):
        svg.path(segment, "candidate - reference", fill="none", stroke=PURPLE, stroke_width=1.4)
    finite = np.flatnonzero(np.isfinite(picture.difference))
    if len(finite):
        last = finite[-1]
        svg.text(x.at(steps[last]) + 6, y.at(float(picture.difference[last])) + 4,
                 f"candidate - reference: {figure_value(float(picture.difference[last]))}", size=10, fill=PURPLE)
    if picture.drift is not None:
        (x0, y0), (x1, y1) = picture.drift
        svg.path([(x.at(x0), y.at(y0)), (x.at(x1), y.at(y1))], picture.drift_label, fill="none", stroke=BLACK,
                 stroke_dasharray="5 3")
        svg.text(x.at(x1) + 6, y.at(y1) - 8, picture.drift_label, size=10, fill=BLACK)


def _file_link(path: Path, report: Path, role: str) -> str:
    relative = Path(os.path.relpath(path.resolve(), report.resolve().parent)).as_posix()
    return tag("a", escape(f"{role}: {relative}"), class_="pointer", href=quote(relative))


def convergence_figure(candidate: str | Path, reference: str | Path, report: Path, thresholds: str = "pipeline") -> str:
    """The figure of the check of `candidate` against `reference`, linking both files from `report`."""
    result = check_convergence(read_curve(candidate, f"candidate curve {candidate}"),
                               read_curve(reference, f"reference curve {reference}"), THRESHOLDS[thresholds])
    picture = convergence_picture(result)
    svg = Svg(WIDTH, DIFFERENCE[1] + 30, "loss curves and their point-wise difference")
    if len(picture.steps):
        x = LinearScale(*padded_range(picture.steps.astype(np.float64), 0.0), LEFT, WIDTH - RIGHT)
        _curves_panel(svg, picture, x)
        _difference_panel(svg, picture, x)
        svg.text((LEFT + WIDTH - RIGHT) / 2, DIFFERENCE[1] + 28, "step", size=11, anchor="middle", fill=BLACK)
    failures = int(picture.failed.sum())
    caption = (
        f"{picture.title}. Above: both loss curves (reference blue, candidate orange), the skipped start shaded,"
        f" point-wise failures circled ({failures}). Below: candidate - reference, the point-wise tolerance band"
        " and the fitted drift, as `correctness converge` checks them."
    )
    source = _file_link(Path(candidate), report, "candidate") + " " + _file_link(Path(reference), report, "reference")
    return figure("convergence", svg, "<b>Convergence</b>: " + escape(caption), source)
