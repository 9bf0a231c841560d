"""What a comparison states: the figures a record holds for a judged tensor (its error, the
default's, the bound, the systematic diagnostic, the worst slice and element, a path's run-to-run
spread) and the figures that follow from others (`judged_figures`, `systematic_flagged`), the one
place they are computed. No torch here: the readers of records (attach, check, classify, levers,
report) work on these without it; correctness.compare makes them from tensors."""

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from correctness.rule import Rule


@dataclass(frozen=True, kw_only=True)
class WorstElement:
    """The element where the judged output is farthest from the reference, with all three values."""

    index: tuple[int, ...]
    judged: float
    default: float
    reference: float


@dataclass(frozen=True, kw_only=True)
class Systematic:
    """The scale slope <e, ref> / <ref, ref> and the mean offset mean(e) / rms(ref) of the judged
    output's error and of the default's, the thresholds they are held to (rule.py), and the flag."""

    slope: float
    default_slope: float
    slope_threshold: float  # the smallest |slope| flagged: the scale bias this case resolves
    offset: float
    default_offset: float
    offset_threshold: float
    flagged: bool

    @property
    def over_threshold(self) -> float:
        """The larger of |slope| / its threshold and |offset| / its threshold (above 1: flagged)."""
        return max(abs(self.slope) / self.slope_threshold, abs(self.offset) / self.offset_threshold)


@dataclass(frozen=True, kw_only=True)
class SliceComparison:
    """A tensor judged slice by slice: how many slices, how many fail, the worst by error/bound and
    the worst by systematic error, each with its index and label."""

    scheme: str
    count: int
    failing: int
    worst_index: tuple[int, ...]
    worst: str
    error: float
    default_error: float
    bound: float
    error_over_bound: float
    systematic_flagged: int
    systematic_worst: str
    systematic: Systematic
    # Every slice's error/bound, row-major over grid_shape ([*leading, position blocks, heads]), to
    # three significant digits: the heatmap of a report (correctness report).
    grid_shape: tuple[int, ...]
    grid: tuple[float, ...]


@dataclass(frozen=True, kw_only=True)
class TensorComparison:
    tensor: str
    shape: tuple[int, ...]
    dtype: str
    error_kind: str  # "relative", or "absolute" where the reference is all zeros
    error: float  # the judged output's error against the reference
    default_error: float
    reference_norm: float  # ||ref||_2, so that errors of several tensors can be pooled
    bound: float  # rule.bound(default_error)
    ratio: float | None  # error / default_error; None where the default is exact
    margin: float  # bound - error: positive within the bound
    whole_error_over_bound: float  # error / bound: above 1 outside the bound
    error_over_bound: float  # the larger of the whole tensor's and its worst slice's error / bound
    bias: float  # signed mean error, mean(x - ref) / rms(ref) (absolute where ref is zero)
    default_bias: float
    systematic: Systematic  # of the whole tensor
    slices: SliceComparison | None  # where the lever slices this tensor
    passes: bool  # whole and every slice within the bound, and all finite
    slack_only: bool  # passes, but only thanks to the rule's slack
    bitwise_identical: bool  # judged and default outputs are equal bit for bit
    worst: WorstElement
    nonfinite: str | None  # where NaN or Inf was found, if anywhere

    @property
    def systematic_flagged(self) -> bool:
        return self.systematic.flagged or (self.slices is not None and self.slices.systematic_flagged > 0)


@dataclass(frozen=True, kw_only=True)
class RunSpread:
    """How a path's repeated runs on the same inputs differ from its first run, for one tensor
    that differed: elements whose bits differ in some repeat, and the size of the differences."""

    tensor: str
    runs: int  # the path's runs compared (its first and every repeat)
    differing_elements: int  # the most in any one repeat
    elements: int
    relative: float  # ||x_k - x_1||_2 / ||x_1||_2, the largest over the repeats (absolute where x_1 is zero)
    max_abs: float  # the largest |x_k - x_1| over the repeats (Inf where a NaN or Inf moved)


def systematic_flagged(slope: float, slope_threshold: float, offset: float, offset_threshold: float) -> bool:
    """Whether a slope or an offset is beyond its threshold (NaN counts as beyond)."""
    return not (abs(slope) <= slope_threshold and abs(offset) <= offset_threshold)


def over_bound_ratio(error: float, bound: float) -> float:
    """error / bound: above 1 outside the bound (a zero bound: 0 for no error, else infinite)."""
    return error / bound if bound > 0.0 else (0.0 if error == 0.0 else math.inf)


def judged_figures(rule: "Rule", error: float, default_error: float, slices: SliceComparison | None,
                   nonfinite: str | None) -> dict[str, Any]:
    """A tensor's figures that follow from its error, the default's, its slices and the rule: the
    bound, ratio, margin, error over bound, and whether it passes. The one place they are computed:
    a comparison makes them so, and a record read back is held to them (correctness.recheck)."""
    bound = rule.bound(default_error)
    whole_over = over_bound_ratio(error, bound)
    over = whole_over if slices is None else max(whole_over, slices.error_over_bound)
    finite = nonfinite is None
    passes = finite and error <= bound and (slices is None or slices.failing == 0)
    return {
        "bound": bound,
        "ratio": error / default_error if default_error > 0.0 else None,
        "margin": bound - error,
        "whole_error_over_bound": whole_over,
        "error_over_bound": over if finite else math.inf,
        "passes": passes,
        "slack_only": passes and error > rule.factor * default_error,
    }
