"""The convergence checks of a candidate loss curve against a reference curve, and their results.

`check_convergence` runs Megatron-Bridge's five checks (`validate_convergence`) on two curves, with
what that function lets through closed, plus finiteness, step coverage and a drift check for
longer runs, and returns a `ConvergenceResult` of `Check`s; `convergence_block` gives the fields of
a recipe's `correctness.convergence` block (rounded, as the recipe holds them); `format_report` the
terminal table. `ConvergenceResult.to_dict` (--json) keeps every figure at full precision.

What Megatron-Bridge's function does as read at the source, where these checks differ on purpose
and why (the outlier check cannot fail at 20 steps; the drift check's window and threshold):
docs/convergence.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from correctness.convergence.curves import Curve
from correctness.errors import CorrectnessError
from correctness.report import format_table

# The golden-loss tiers of the point-wise tolerance (Megatron-Bridge: `golden > 2.0`, `golden > 0.5`).
HIGH_LOSS_ABOVE = 2.0
MEDIUM_LOSS_ABOVE = 0.5


@dataclass(frozen=True, kw_only=True)
class Thresholds:
    """The checks' limits. Megatron-Bridge's names in the comments."""

    name: str
    correlation: float = 0.95  # correlation_threshold
    high_loss_tolerance: float = 0.10  # golden > 2.0
    medium_loss_tolerance: float = 0.05  # golden > 0.5
    low_loss_tolerance: float = 0.02  # otherwise
    final_loss_tolerance: float  # final_loss_tolerance
    max_outlier_ratio: float = 0.1  # max_outlier_ratio (point-wise failures and outliers)
    outlier_threshold: float = 3.0  # outlier_threshold, in standard deviations
    skip_first_fraction: float  # skip_first_percent_loss (a fraction, despite its name)
    drift_tolerance: float = 0.02  # ours: |fitted drift| / mean reference loss
    drift_min_steps: int = 50  # ours: the drift check applies from this many steps

    def pointwise_tolerance(self, golden: np.ndarray) -> np.ndarray:
        return np.where(golden > HIGH_LOSS_ABOVE, self.high_loss_tolerance,
                        np.where(golden > MEDIUM_LOSS_ABOVE, self.medium_loss_tolerance, self.low_loss_tolerance))

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


# The defaults Megatron-Bridge's performance pipeline passes (argument_parser.py), and those of
# validate_convergence itself.
PIPELINE = Thresholds(name="pipeline", final_loss_tolerance=0.05, skip_first_fraction=0.20)
FUNCTION = Thresholds(name="function", final_loss_tolerance=0.03, skip_first_fraction=0.0)
THRESHOLDS = {t.name: t for t in (PIPELINE, FUNCTION)}

# The checks


PASS, FAIL, NOT_APPLIED = "pass", "fail", "not applied"


@dataclass(frozen=True, kw_only=True)
class Check:
    """One check: its value (None where not defined), its limit, and what decided it."""

    name: str
    status: str  # PASS, FAIL or NOT_APPLIED
    value: float | int | None  # comparable with threshold: a count, a ratio of points, r, a relative difference
    threshold: float | None
    shown: str  # the value as the table prints it
    limit: str  # the threshold as the table prints it
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "value": self.value, "threshold": self.threshold,
                "shown": self.shown, "limit": self.limit, "detail": self.detail}


@dataclass(frozen=True)
class Drift:
    """The least-squares line d = intercept + slope * step through d = candidate - reference."""

    slope: float
    intercept: float
    first_step: int
    last_step: int
    change: float  # slope * (last_step - first_step), in loss units
    relative: float  # change / mean reference loss over the window
    relative_stderr: float  # its standard error, from the fit's residuals


@dataclass(frozen=True, eq=False, kw_only=True)
class ConvergenceResult:
    candidate: Curve
    reference: Curve
    thresholds: Thresholds
    steps: np.ndarray  # the steps both curves have, which the checks compare
    candidate_losses: np.ndarray  # at those steps
    reference_losses: np.ndarray
    skipped: int  # points dropped from the start before the five checks
    checks: tuple[Check, ...]
    correlation: float | None
    final_loss_difference: float | None
    pointwise_failure_steps: tuple[int, ...]
    drift: Drift | None = field(default=None)

    @property
    def passed(self) -> bool:
        return all(check.status != FAIL for check in self.checks)

    @property
    def result(self) -> str:
        return PASS if self.passed else FAIL

    @property
    def pointwise_failures(self) -> int:
        return len(self.pointwise_failure_steps)

    @property
    def failures(self) -> list[str]:
        return [f"{check.name}: {check.detail}" for check in self.checks if check.status == FAIL]

    def check(self, name: str) -> Check:
        return next(check for check in self.checks if check.name == name)

    def to_dict(self) -> dict[str, Any]:
        """Everything, for --json: the recipe block's fields first, then each check in full. Every
        figure at full precision: rounding is for the recipe block and the terminal."""
        return {
            **_block_fields(self, rounded=False),  # undefined figures as null
            "candidate": self.candidate.source,
            "reference": self.reference.source,
            "thresholds": self.thresholds.to_dict(),
            "compared_steps": len(self.steps) - self.skipped,
            "skipped_steps": self.skipped,
            "pointwise_failure_steps": list(self.pointwise_failure_steps),
            "drift": None if self.drift is None else dict(self.drift.__dict__),
            "checks": [check.to_dict() for check in self.checks],
            "failures": self.failures,
        }


def _few(items: list[str], limit: int = 5) -> str:
    return "; ".join(items[:limit]) + (f"; and {len(items) - limit} more" if len(items) > limit else "")


def _steps_text(steps: np.ndarray | list[int], limit: int = 8, total: int | None = None) -> str:
    """The first `limit` steps, and how many more of `total` (default: all of `steps`)."""
    total = len(steps) if total is None else total
    shown = [int(s) for s in steps[:limit]]
    more = total - len(shown)
    return ", ".join(map(str, shown)) + (f" and {more:,} more" if more > 0 else "")


def _finite_check(candidate: Curve, reference: Curve) -> Check:
    bad = [f"{role} loss is {curve.losses[i]} at step {curve.steps[i]}"
           for role, curve in (("candidate", candidate), ("reference", reference))
           for i in np.flatnonzero(~np.isfinite(curve.losses))]
    return Check(name="finite losses", status=FAIL if bad else PASS, value=len(bad), threshold=0.0,
                 shown=f"{len(bad)} non-finite", limit="none", detail=_few(bad) if bad else "")


def grid_gaps(steps: np.ndarray, stride: int, limit: int = 8) -> tuple[int, list[int]]:
    """The steps of the logging grid (every `stride` from the first step to the last) missing from
    sorted `steps`: their count and the first `limit` of them. Counted gap by gap, never listed in
    full, so the work follows the number of steps, not their span ({1, 2, 2e8}: 199,999,997 missing)."""
    gaps = np.diff(steps) // stride - 1  # missing grid points after each step
    count = int(gaps.sum())  # below 2^63: steps lie in 0..MAX_STEP
    first: list[int] = []
    for index in np.flatnonzero(gaps)[:limit]:
        start = int(steps[index])
        first.extend(start + stride * k for k in range(1, min(int(gaps[index]), limit - len(first)) + 1))
        if len(first) >= limit:
            break
    return count, first


def _coverage_check(candidate: Curve, reference: Curve) -> Check:
    only_candidate = np.setdiff1d(candidate.steps, reference.steps)
    only_reference = np.setdiff1d(reference.steps, candidate.steps)
    union = np.union1d(candidate.steps, reference.steps)
    stride = int(np.gcd.reduce(np.diff(union))) if len(union) > 1 else 1
    n_missing, first_missing = grid_gaps(union, stride)
    problems = []
    if n_missing:
        problems.append(f"steps missing from both curves (logging every {stride}): "
                        f"{_steps_text(first_missing, total=n_missing)}")
    if len(only_candidate):
        problems.append(f"steps only in the candidate: {_steps_text(only_candidate)}")
    if len(only_reference):
        problems.append(f"steps only in the reference: {_steps_text(only_reference)}")
    n_bad = n_missing + len(only_candidate) + len(only_reference)
    shown = f"{union[0]}-{union[-1]}" + (f" every {stride}" if stride != 1 else "")
    return Check(name="step coverage", status=FAIL if problems else PASS, value=n_bad, threshold=0.0, shown=shown,
                 limit="same steps, no gaps", detail="; ".join(problems))


def _correlation_check(c: np.ndarray, g: np.ndarray, limit: float) -> tuple[Check, float | None]:
    why = None
    if len(c) < 2:
        why = f"undefined: {len(c)} compared point(s)"
    elif not (np.all(np.isfinite(c)) and np.all(np.isfinite(g))):
        why = "undefined: non-finite losses"
    else:
        constant = [role for role, v in (("candidate", c), ("reference", g)) if np.ptp(v) == 0]
        if constant:
            why = (f"undefined: the {' and the '.join(constant)} curve{'s are' if len(constant) > 1 else ' is'}"
                   " constant over the compared steps (Megatron-Bridge's check passes this)")
    if why is not None:
        return Check(name="correlation", status=FAIL, value=None, threshold=limit, shown="undefined",
                     limit=f">= {limit}", detail=why), None
    value = float(np.corrcoef(c, g)[0, 1])
    passed = value >= limit
    return Check(name="correlation", status=PASS if passed else FAIL, value=value, threshold=limit,
                 shown=f"{value:.5f}", limit=f">= {limit}",
                 detail="" if passed else f"Pearson correlation {value:.5f} < {limit}"), value


def _relative_difference(c: np.ndarray | float, g: np.ndarray | float) -> np.ndarray:
    c, g = np.asarray(c, dtype=np.float64), np.asarray(g, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(g != 0, np.abs(c - g) / np.abs(g), np.abs(c))


def _pointwise_check(steps: np.ndarray, c: np.ndarray, g: np.ndarray, t: Thresholds) -> tuple[Check, tuple[int, ...]]:
    tolerance = t.pointwise_tolerance(g)
    relative = _relative_difference(c, g)
    failed = ~(relative <= tolerance)  # a NaN difference fails
    count, n = int(failed.sum()), len(c)
    ratio = count / n if n else math.nan
    passed = n > 0 and ratio <= t.max_outlier_ratio
    limit = (f"<= {t.max_outlier_ratio:.0%} of points at tol {t.high_loss_tolerance:g}/"
             f"{t.medium_loss_tolerance:g}/{t.low_loss_tolerance:g}")
    listed = _few([f"step {steps[i]}: {c[i]:.6g} vs {g[i]:.6g} "
                   + (f"({relative[i]:.2%} > {tolerance[i]:.0%})" if np.isfinite(relative[i]) else "(not finite)")
                   for i in np.flatnonzero(failed)])
    if n == 0:
        detail = "no compared points"
    elif not passed:
        detail = f"{count}/{n} points outside tolerance ({ratio:.1%} > {t.max_outlier_ratio:.0%}): {listed}"
    else:
        detail = f"{count} outside tolerance, within the allowed ratio: {listed}" if count else ""
    check = Check(name="point-wise tolerance", status=PASS if passed else FAIL, value=None if n == 0 else ratio,
                  threshold=t.max_outlier_ratio, shown=f"{count}/{n}", limit=limit, detail=detail)
    return check, tuple(int(s) for s in steps[failed])


def _final_check(steps: np.ndarray, c: np.ndarray, g: np.ndarray, limit: float) -> tuple[Check, float | None]:
    if len(c) == 0:
        return Check(name="final loss", status=FAIL, value=None, threshold=limit, shown="undefined",
                     limit=f"<= {limit}", detail="no compared points"), None
    value = float(_relative_difference(c[-1], g[-1]))
    where = f"step {steps[-1]}: {c[-1]:.6g} vs {g[-1]:.6g}"
    if not math.isfinite(value):
        return Check(name="final loss", status=FAIL, value=None, threshold=limit, shown="undefined",
                     limit=f"<= {limit}", detail=f"non-finite at {where}"), None
    passed = value <= limit
    return Check(name="final loss", status=PASS if passed else FAIL, value=value, threshold=limit,
                 shown=f"{value:.4g}", limit=f"<= {limit}",
                 detail=where if passed else f"relative difference {value:.4g} > {limit} at {where}"), value


def _outlier_check(steps: np.ndarray, c: np.ndarray, g: np.ndarray, t: Thresholds) -> Check:
    limit = f"<= {t.max_outlier_ratio:.0%} of points beyond {t.outlier_threshold:g} std"
    residuals = c - g
    if len(residuals) == 0 or not np.all(np.isfinite(residuals)):
        why = "no compared points" if len(residuals) == 0 else "undefined: non-finite losses"
        return Check(name="residual outliers", status=FAIL, value=None, threshold=t.max_outlier_ratio,
                     shown="undefined", limit=limit, detail=why)
    deviation = np.abs(residuals - residuals.mean())
    outliers = deviation > t.outlier_threshold * residuals.std()
    count, n = int(outliers.sum()), len(residuals)
    passed = count / n <= t.max_outlier_ratio
    listed = _steps_text(steps[outliers])
    if not passed:
        detail = (f"{count}/{n} residuals beyond {t.outlier_threshold:g} std ({count / n:.1%} > "
                  f"{t.max_outlier_ratio:.0%}) at steps {listed}")
    else:
        detail = f"{count} within the allowed ratio, at steps {listed}" if count else ""
    return Check(name="residual outliers", status=PASS if passed else FAIL, value=count / n,
                 threshold=t.max_outlier_ratio, shown=f"{count}/{n}", limit=limit, detail=detail)


def fit_drift(steps: np.ndarray, c: np.ndarray, g: np.ndarray) -> Drift:
    """Least squares of d = c - g on the step; its change over the window, relative to mean |g|."""
    x = steps.astype(np.float64)
    d = c - g
    x_mean = x.mean()
    sxx = float(np.sum((x - x_mean) ** 2))
    slope = float(np.sum((x - x_mean) * (d - d.mean())) / sxx)
    intercept = float(d.mean() - slope * x_mean)
    span = float(x[-1] - x[0])
    level = float(np.mean(np.abs(g)))
    scale = level if level > 0 else 1.0
    residual = d - (intercept + slope * x)
    stderr = math.sqrt(float(np.sum(residual**2)) / (len(x) - 2) / sxx) * span
    return Drift(slope, intercept, int(steps[0]), int(steps[-1]), slope * span, slope * span / scale, stderr / scale)


def _drift_check(steps: np.ndarray, c: np.ndarray, g: np.ndarray, n_steps: int,
                 t: Thresholds) -> tuple[Check, Drift | None]:
    limit = f"|drift| <= {t.drift_tolerance:.0%} of the reference loss"
    if n_steps < t.drift_min_steps:
        return Check(name="drift", status=NOT_APPLIED, value=None, threshold=t.drift_tolerance, shown="-", limit=limit,
                     detail=f"needs at least {t.drift_min_steps} steps, these curves have {n_steps}"), None
    if len(c) < 3:
        return Check(name="drift", status=NOT_APPLIED, value=None, threshold=t.drift_tolerance, shown="-", limit=limit,
                     detail=f"{len(c)} compared points, a fit needs 3"), None
    if not (np.all(np.isfinite(c)) and np.all(np.isfinite(g))):
        return Check(name="drift", status=FAIL, value=None, threshold=t.drift_tolerance, shown="undefined",
                     limit=limit, detail="undefined: non-finite losses"), None
    drift = fit_drift(steps, c, g)
    passed = abs(drift.relative) <= t.drift_tolerance
    fitted = (f"fitted candidate - reference changes by {drift.change:+.4g} from step {drift.first_step} to "
              f"{drift.last_step}, {drift.relative:+.2%} of the mean reference loss (standard error "
              f"{drift.relative_stderr:.2%})")
    detail = fitted if passed else f"{fitted}, beyond {t.drift_tolerance:.0%}"
    return Check(name="drift", status=PASS if passed else FAIL, value=drift.relative, threshold=t.drift_tolerance,
                 shown=f"{drift.relative:+.2%}", limit=limit, detail=detail), drift


def check_convergence(candidate: Curve, reference: Curve, thresholds: Thresholds = PIPELINE) -> ConvergenceResult:
    """Megatron-Bridge's five checks with `thresholds`, plus finiteness, step coverage and drift.

    Raises CorrectnessError where the curves have different numbers of steps."""
    if len(candidate) == 0 or len(reference) == 0:
        empty = candidate if len(candidate) == 0 else reference
        raise CorrectnessError(f"{empty.source}: no losses")
    if len(candidate) != len(reference):
        raise CorrectnessError(
            f"the curves have different step counts: candidate {candidate.source} has {len(candidate)} steps, "
            f"reference {reference.source} has {len(reference)}")
    steps, at_candidate, at_reference = np.intersect1d(candidate.steps, reference.steps, return_indices=True)
    c_all, g_all = candidate.losses[at_candidate], reference.losses[at_reference]
    skipped = max(0, int(len(steps) * thresholds.skip_first_fraction))
    window, c, g = steps[skipped:], c_all[skipped:], g_all[skipped:]

    correlation_check, correlation = _correlation_check(c, g, thresholds.correlation)
    pointwise_check, pointwise_steps = _pointwise_check(window, c, g, thresholds)
    final_check, final = _final_check(window, c, g, thresholds.final_loss_tolerance)
    drift_check, drift = _drift_check(window, c, g, len(steps), thresholds)
    checks = (
        _finite_check(candidate, reference),
        _coverage_check(candidate, reference),
        correlation_check,
        pointwise_check,
        final_check,
        _outlier_check(window, c, g, thresholds),
        drift_check,
    )
    return ConvergenceResult(
        candidate=candidate, reference=reference, thresholds=thresholds, steps=steps, candidate_losses=c_all,
        reference_losses=g_all, skipped=skipped, checks=checks, correlation=correlation,
        final_loss_difference=final, pointwise_failure_steps=pointwise_steps, drift=drift)


# The recipe's block and the report


def round_correlation(value: float) -> float:
    """Enough decimals to show two significant digits of 1 - |r|, and at least five (0.98649, 0.9999986)."""
    gap = 1.0 - abs(value)
    decimals = 5 if gap <= 0 else max(5, math.floor(-math.log10(gap)) + 2)
    return round(value, min(decimals, 12))


def round_difference(value: float) -> float:
    """Three significant digits (0.0091, 0.000124)."""
    return float(f"{value:.3g}")


def _block_fields(result: ConvergenceResult, *, rounded: bool = True) -> dict[str, Any]:
    """The block's fields in the recipe's order, undefined figures as None; `rounded` as the recipe
    holds them (round_correlation, round_difference), else at full precision (--json)."""
    correlation, final = result.correlation, result.final_loss_difference
    if rounded:
        correlation = None if correlation is None else round_correlation(correlation)
        final = None if final is None else round_difference(final)
    return {
        "steps": len(result.candidate),
        "result": result.result,
        "correlation": correlation,
        "final_loss_difference": final,
        "pointwise_failures": result.pointwise_failures,
    }


def convergence_block(result: ConvergenceResult) -> dict[str, Any]:
    """The recipe's `correctness.convergence` fields, in its order (its `note` is the author's to
    write). A figure that is not defined (the correlation of a constant curve, a NaN final loss) is
    left out, as the recipe schema wants a number there; `result` is then "fail"."""
    return {key: value for key, value in _block_fields(result).items() if value is not None}


def format_report(result: ConvergenceResult) -> list[str]:
    """A heading, a row per check, then the recipe block's fields."""
    n = len(result.steps)
    compared = n - result.skipped
    skip = f" (first {result.skipped} skipped)" if result.skipped else ""
    lines = [
        f"convergence · {result.result.upper()} · {len(result.candidate)} steps, {compared} compared{skip} ·"
        f" {result.thresholds.name} thresholds",
        f"  candidate {result.candidate.source}",
        f"  reference {result.reference.source}",
    ]
    rows = [[c.name, c.shown, c.limit, c.status, c.detail] for c in result.checks]
    lines += ["  " + line for line in format_table(["check", "value", "threshold", "result", "detail"], rows)]
    return lines + ["recipe block: " + block_text(result)]


def block_text(result: ConvergenceResult, leave_out: tuple[str, ...] = ()) -> str:
    """The block's fields in a line, in the recipe's order, rounded as the recipe holds them."""
    block = _block_fields(result)
    return ", ".join(f"{key} {'undefined' if value is None else value}"
                     for key, value in block.items() if key not in leave_out)

