"""What a picture of a convergence check shows, apart from how it is drawn: both curves, the
skipped start, the point-wise failures and non-finite losses, the difference with its point-wise
tolerance band, and the fitted drift. `correctness converge --plot` draws it with matplotlib (a
PNG), `correctness report --curves` as SVG (correctness.report_page.convergence)."""

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from correctness.convergence.checks import ConvergenceResult, block_text


@dataclass(frozen=True, eq=False)
class ConvergencePicture:
    steps: np.ndarray
    candidate: np.ndarray  # losses at the steps both curves have
    reference: np.ndarray
    candidate_label: str  # `candidate (run.log)`
    reference_label: str
    skipped: int  # points left out of the checks at the start
    skipped_until: float | None  # where the skipped start ends on the step axis (None: nothing skipped)
    failed: np.ndarray  # per step: a point-wise failure (finite losses)
    nonfinite_steps: np.ndarray  # steps where either loss is NaN or Inf
    difference: np.ndarray  # candidate - reference
    band: np.ndarray  # the point-wise tolerance, in loss units, per step
    drift: tuple[tuple[float, float], tuple[float, float]] | None  # the fitted line's two ends (x, y)
    drift_label: str | None
    title: str


def convergence_picture(result: ConvergenceResult) -> ConvergencePicture:
    steps, c, g = result.steps, result.candidate_losses, result.reference_losses
    skipped_until = None
    if result.skipped and len(steps):
        skipped_until = float((steps[result.skipped - 1] + steps[result.skipped]) / 2
                              if result.skipped < len(steps) else steps[-1])
    finite = np.isfinite(c) & np.isfinite(g)
    drift, drift_label = None, None
    if result.drift is not None:
        x = np.array([result.drift.first_step, result.drift.last_step], dtype=np.float64)
        y = result.drift.intercept + result.drift.slope * x
        drift = ((float(x[0]), float(y[0])), (float(x[1]), float(y[1])))
        drift_label = f"fitted drift {result.drift.relative:+.2%} ({result.check('drift').status})"
    return ConvergencePicture(
        steps=steps, candidate=c, reference=g,
        candidate_label=f"candidate ({Path(result.candidate.source).name})",
        reference_label=f"reference ({Path(result.reference.source).name})",
        skipped=result.skipped, skipped_until=skipped_until,
        failed=np.isin(steps, result.pointwise_failure_steps) & finite,
        nonfinite_steps=steps[~finite],
        difference=c - g,
        band=result.thresholds.pointwise_tolerance(g) * np.abs(g),
        drift=drift, drift_label=drift_label,
        title=(f"{result.result.upper()} · {result.thresholds.name} thresholds"
               f" · {block_text(result, leave_out=('result',))}"),
    )
