"""Check a candidate loss curve against a reference curve.

    correctness converge CANDIDATE REFERENCE [--thresholds pipeline|function] [--plot PATH]
                        [--attach RECIPE.yaml] [--json]

CANDIDATE and REFERENCE are per-step losses, the format told by the extension, else by the content:
  - a Megatron/miles training log (.log, .txt, .out, .err): lines with `iteration N/` and
    `lm loss: X`; a repeated iteration keeps its last loss;
  - CSV (.csv): a header with columns step,loss, then a row per step;
  - JSON (.json): a list of losses (steps 1..N), {"step": loss}, or [{"step": .., "loss": ..}].

Checks (Megatron-Bridge's validate_convergence, then ours), each printed with its value, threshold
and result:
  finite losses        no NaN or Inf in either curve (the step is named)
  step coverage        both curves have the same steps, no gaps
  correlation          Pearson r >= 0.95 (undefined, and failing, for a constant curve)
  point-wise tolerance at most 10% of points off by more than 10% / 5% / 2% (golden loss > 2 / > 0.5 / else)
  final loss           relative difference at the last step <= 0.05 (function thresholds: 0.03)
  residual outliers    at most 10% of points with c - g beyond 3 std of its mean
  drift                least-squares trend of c - g over the compared steps, as a share of the mean
                       reference loss: |drift| <= 2%; only for curves of 50 steps or more
The five middle checks skip the first 20% of points (pipeline thresholds; function thresholds: 0).
The last line gives the recipe's `correctness.convergence` fields, rounded as the recipe holds them
(--json: everything, every figure at full precision); --attach writes them into RECIPE.yaml's
correctness.convergence (the rest of the file keeps every byte).

Exit status: 0 every check passes; 1 a check fails; 2 bad input (an unreadable or unrecognised file,
no losses, a non-numeric loss, curves of different lengths), with a one-line message naming the file.
"""

import argparse
import io
from collections.abc import Sequence
from pathlib import Path

from correctness.attach import attach_convergence
from correctness.commands import EXIT_FAIL, EXIT_OK, emit
from correctness.convergence import (
    THRESHOLDS,
    ConvergenceResult,
    check_convergence,
    convergence_block,
    format_report,
    read_curve,
)
from correctness.convergence.picture import convergence_picture
from correctness.files import output_target, write_output


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("candidate", metavar="CANDIDATE", help="the candidate run's losses (log, CSV or JSON)")
    parser.add_argument("reference", metavar="REFERENCE", help="the reference run's losses (log, CSV or JSON)")
    parser.add_argument(
        "--thresholds", choices=sorted(THRESHOLDS), default="pipeline",
        help="Megatron-Bridge's pipeline thresholds (final 0.05, skip 20%%; the default) or "
             "validate_convergence's own defaults (final 0.03, skip 0)")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG of both curves and their difference")
    parser.add_argument("--attach", metavar="RECIPE.yaml", help="write the block into this recipe")


def run(args: argparse.Namespace) -> int:
    candidate = read_curve(args.candidate, f"candidate curve {args.candidate}")
    reference = read_curve(args.reference, f"reference curve {args.reference}")
    result = check_convergence(candidate, reference, THRESHOLDS[args.thresholds])
    lines = format_report(result)
    data = result.to_dict()
    if args.plot:
        write_plot(result, args.plot, [args.candidate, args.reference, *([args.attach] if args.attach else [])])
        lines.append(f"plot: {args.plot}")
        data["plot"] = str(args.plot)
    if args.attach:
        note = (
            f"candidate arm: {args.candidate}; reference arm: {args.reference}; checked by correctness converge"
            f" with {args.thresholds} thresholds"
        )
        attach_convergence(args.attach, convergence_block(result), note)
        lines.append(f"attached to {args.attach}")
        data["attached"] = str(args.attach)
    emit(args, lines, data)
    return EXIT_OK if result.passed else EXIT_FAIL


def write_plot(result: ConvergenceResult, path: str | Path, inputs: Sequence[str | Path] = ()) -> None:
    """PNG: both curves (skipped steps shaded, point-wise failures marked) above their difference
    (the point-wise tolerance band and the fitted drift), as correctness.convergence.picture says;
    drawn in memory, then written as a command's output (correctness.files.write_output: never over
    one of `inputs`, a read-only file, a device). matplotlib is imported only here, Agg only."""
    label = f"plot {path}"
    output_target(path, label, inputs)  # before the drawing: a refusal costs nothing
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    picture = convergence_picture(result)
    steps = picture.steps
    figure = Figure(figsize=(9, 6.5), layout="constrained")
    FigureCanvasAgg(figure)
    top, bottom = figure.subplots(2, 1, sharex=True, height_ratios=(2, 1))
    top.plot(steps, picture.reference, label=picture.reference_label, color="tab:blue", lw=1.5)
    top.plot(steps, picture.candidate, label=picture.candidate_label, color="tab:orange", lw=1.2)
    if picture.skipped_until is not None:
        for axis in (top, bottom):
            axis.axvspan(steps[0], picture.skipped_until, color="0.9", zorder=0)
        top.text(steps[0], 1.0, f" skipped ({picture.skipped})", transform=top.get_xaxis_transform(),
                 va="top", fontsize=8, color="0.4")
    if picture.failed.any():
        top.plot(steps[picture.failed], picture.candidate[picture.failed], "x", color="tab:red",
                 label="point-wise failure")
    for index, step in enumerate(picture.nonfinite_steps):
        top.axvline(step, color="tab:red", lw=0.8, ls=":", label=None if index else "non-finite loss")
    top.set_ylabel("loss")
    top.set_title(picture.title, fontsize=9)
    top.xaxis.set_major_locator(MaxNLocator(integer=True))
    top.legend(fontsize=8)

    bottom.fill_between(steps, -picture.band, picture.band, color="tab:green", alpha=0.15, label="point-wise tolerance")
    bottom.axhline(0.0, color="0.5", lw=0.8)
    bottom.plot(steps, picture.difference, color="tab:purple", lw=1.2, label="candidate - reference")
    if picture.drift is not None:
        (x0, y0), (x1, y1) = picture.drift
        bottom.plot([x0, x1], [y0, y1], color="black", ls="--", lw=1.0, label=picture.drift_label)
    bottom.set_xlabel("step")
    bottom.set_ylabel("difference")
    bottom.legend(fontsize=8)
    png = io.BytesIO()
    figure.savefig(png, format="png", dpi=110)
    write_output(path, png.getvalue(), label, inputs)
