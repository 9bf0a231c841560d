"""Per-tensor comparison of a judged output and the default output against an FP64 reference.

err(x) = ||x - ref||_2 / ||ref||_2, computed in FP64. Where the reference is all zeros the error
is the absolute norm ||x - ref||_2 and `error_kind` says so. The judged output passes where
err(judged) <= rule.bound(err(default)), for the tensor as a whole and, where the lever declares a
`Slicing`, for every slice of it (a block of query rows of one head) on the slice's own errors: an
error confined to 64 of 2,048 rows is diluted in the whole but not in its slice. NaN or Inf
anywhere never passes.

Beside the rule, a diagnostic (rule.py says why): the error's scale slope <e, ref> / <ref, ref>
and its mean offset, for the judged output and the default, whole and per slice; `systematic`
where the judged output's exceed the rule's systematic threshold.

A tensor may arrive in pieces (consecutive blocks along its first dimension, as a streamed lever
delivers them): `TensorAccumulator` keeps running sums, so the figures are those of the whole
tensor; `compare_tensor` is the one-piece case.
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from correctness.comparisons import (  # noqa: F401 (the figure types, made here)
    RunSpread, SliceComparison, Systematic, TensorComparison, WorstElement, judged_figures, over_bound_ratio,
    systematic_flagged,
)
from correctness.errors import ComparisonError
from correctness.rule import Rule


@dataclass(frozen=True, kw_only=True)
class Slicing:
    """Judge a tensor [..., positions, heads, features] by slices as well: each head, and blocks of
    `block` positions (query rows for `out` and `dq`, keys for `dk` and `dv`), each leading index
    (a batch row) apart. A tensor of fewer than three dimensions is judged whole only. A slice's
    errors are relative to the larger of its reference's norm and the norm a slice of its size
    has on average in the tensor."""

    block: int = 128

    def __post_init__(self):
        if self.block < 1:
            raise ValueError(f"slicing: block must be at least 1, got {self.block}")

    def applies(self, x: torch.Tensor) -> bool:
        return x.dim() >= 3

    def sums(self, x: torch.Tensor) -> torch.Tensor:
        """Per-slice sums of x: [..., blocks, heads]."""
        positions = x.shape[-3]
        padded = F.pad(x, (0, 0, 0, 0, 0, -positions % self.block))
        blocks = padded.reshape(*x.shape[:-3], -1, self.block, *x.shape[-2:])
        return blocks.sum(dim=(-1, -3))

    def label(self, index: tuple[int, ...], positions: int) -> str:
        *leading, block, head = index
        first = block * self.block
        where = f"positions {first}-{min(first + self.block, positions) - 1}, head {head}"
        return ", ".join([*(f"batch {i}" for i in leading), where])

    def describe(self) -> str:
        return f"per head and per {self.block} positions"


def _unravel(flat: int, shape: torch.Size) -> tuple[int, ...]:
    """The index of element `flat` of a contiguous tensor of `shape` (torch.unravel_index, without
    its cost per call, which dominates on the optimizer's many small tensors)."""
    index = []
    for size in reversed(shape):
        flat, i = divmod(flat, size)
        index.append(i)
    return tuple(reversed(index))


def nonfinite_report(role: str, name: str, x: torch.Tensor, offset: int = 0) -> str | None:
    """None where x is all finite, else a one-line count of NaN and Inf with the first index
    (its first coordinate shifted by `offset`, the piece's place in the whole tensor)."""
    finite = torch.isfinite(x)
    if bool(finite.all()):
        return None
    nans = int(torch.isnan(x).sum())
    infs = int(torch.isinf(x).sum())
    first = [int(i) for i in torch.nonzero(~finite)[0]]
    if first:
        first[0] += offset
    return f"{role} {name}: {nans} NaN and {infs} Inf of {x.numel()} elements, first at {first}"


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bits (torch.equal compares values: NaN != NaN, -0.0 == 0.0)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@dataclass
class SpreadAccumulator:
    """Collects a path's repeats against its first run, tensor by tensor and unit by unit (a
    streamed lever's tensors arrive in pieces, so the figures of a repeat are summed over its
    pieces before the largest repeat is taken)."""

    runs: int = 1
    # (tensor, repeat) -> [differing elements, sum of squared differences, first run's sum of squares, max_abs]
    _sums: dict[tuple[str, int], list[float]] = field(default_factory=dict)
    _elements: dict[str, int] = field(default_factory=dict)

    def add(self, repeat: int, first: Mapping[str, torch.Tensor], again: Mapping[str, torch.Tensor]) -> None:
        """Repeat number `repeat` (1 for the second run) of the current unit, against its first run."""
        self.runs = max(self.runs, repeat + 1)
        for name, a in first.items():
            b = again[name]
            if repeat == 1:
                self._elements[name] = self._elements.get(name, 0) + a.numel()
            sums = self._sums.setdefault((name, repeat), [0, 0.0, 0.0, 0.0])
            a64 = a.detach().double()
            sums[2] += float(torch.nan_to_num(a64, nan=0.0, posinf=0.0, neginf=0.0).square().sum())
            if bitwise_equal(a, b):
                continue
            if a.shape != b.shape or a.dtype != b.dtype:
                raise ComparisonError(f"tensor {name}: a repeated run gave {tuple(b.shape)} {b.dtype}, the first"
                                      f" {tuple(a.shape)} {a.dtype}")
            same_bits = a.reshape(-1).view(torch.uint8).view(a.numel(), -1).eq(
                b.reshape(-1).view(torch.uint8).view(b.numel(), -1)).all(dim=1)
            difference = (b.detach().double() - a64).reshape(-1).abs()
            difference = torch.where(same_bits, 0.0, torch.nan_to_num(difference, nan=math.inf))
            sums[0] += int((~same_bits).sum())
            finite = difference[torch.isfinite(difference)]
            sums[1] += float(finite.square().sum()) if bool(torch.isfinite(difference).all()) else math.inf
            sums[3] = max(sums[3], float(difference.max()))

    def spreads(self) -> tuple[RunSpread, ...]:
        """The tensors that differed in some repeat, in their first-seen order."""
        found = []
        for name, elements in self._elements.items():
            repeats = [self._sums[(name, r)] for r in range(1, self.runs) if (name, r) in self._sums]
            if not any(s[0] for s in repeats):
                continue
            relative = max(math.sqrt(s[1]) / math.sqrt(s[2]) if s[2] > 0 else math.sqrt(s[1]) for s in repeats)
            found.append(RunSpread(
                tensor=name, runs=self.runs, differing_elements=int(max(s[0] for s in repeats)), elements=elements,
                relative=relative, max_abs=max(s[3] for s in repeats),
            ))
        return tuple(found)


def check_same_layout(name: str, judged: torch.Tensor, default: torch.Tensor, reference: torch.Tensor) -> None:
    """Raise unless judged and default agree in shape and dtype and the reference in shape."""
    if judged.shape != default.shape or judged.dtype != default.dtype:
        raise ComparisonError(
            f"tensor {name}: judged output is {tuple(judged.shape)} {judged.dtype} but the default's is "
            f"{tuple(default.shape)} {default.dtype}; paths must agree in shape and dtype"
        )
    if judged.shape != reference.shape:
        raise ComparisonError(
            f"tensor {name}: outputs are {tuple(judged.shape)} but the reference is {tuple(reference.shape)}"
        )


@dataclass
class Moments:
    """Sums over an error e = x - ref, whole (0-d tensors) or per slice: sum e^2, sum e ref, sum e."""

    sq: torch.Tensor
    dot: torch.Tensor
    total: torch.Tensor

    @staticmethod
    def of(error: torch.Tensor, ref64: torch.Tensor, reduce) -> "Moments":
        return Moments(sq=reduce(error * error), dot=reduce(error * ref64), total=reduce(error))

    def summed(self) -> "Moments":
        """The whole tensor's sums from its slices' (one pass over the elements serves both)."""
        return Moments(sq=self.sq.sum(), dot=self.dot.sum(), total=self.total.sum())

    def add(self, other: "Moments", concatenate: bool) -> None:
        for name in ("sq", "dot", "total"):
            mine, theirs = getattr(self, name), getattr(other, name)
            setattr(self, name, torch.cat((mine, theirs)) if concatenate else mine + theirs)


def _whole(x: torch.Tensor) -> torch.Tensor:
    return x.sum()


@dataclass(frozen=True)
class Baseline:
    """The reference and the default of one piece, reduced once and shared by every output judged
    against them: the reference in FP64, the reference's and the default error's sums, whole and
    per slice."""

    reference: torch.Tensor  # FP64
    default: torch.Tensor
    reference_sq: torch.Tensor
    count: int
    default_moments: Moments
    slice_reference_sq: torch.Tensor | None
    slice_count: torch.Tensor | None
    slice_default: Moments | None
    nonfinite: str | None


def baseline(
    name: str, default: torch.Tensor, reference: torch.Tensor, offset: int = 0, slicing: Slicing | None = None
) -> Baseline:
    if default.shape != reference.shape:
        raise ComparisonError(
            f"tensor {name}: outputs are {tuple(default.shape)} but the reference is {tuple(reference.shape)}"
        )
    ref64 = reference.to(torch.float64)
    default_error = default.to(torch.float64) - ref64
    sliced = slicing is not None and slicing.applies(ref64)
    ref_sq = ref64 * ref64
    slice_default = Moments.of(default_error, ref64, slicing.sums) if sliced else None
    slice_reference_sq = slicing.sums(ref_sq) if sliced else None
    moments = slice_default.summed() if sliced else Moments.of(default_error, ref64, _whole)
    reference_sq = slice_reference_sq.sum() if sliced else ref_sq.sum()
    nonfinite = None
    if not (math.isfinite(reference_sq.item()) and math.isfinite(moments.sq.item())):
        nonfinite = nonfinite_report("reference", name, reference, offset) or nonfinite_report(
            "default", name, default, offset
        )
    return Baseline(
        reference=ref64,
        default=default,
        reference_sq=reference_sq,
        count=reference.numel(),
        default_moments=moments,
        slice_reference_sq=slice_reference_sq,
        slice_count=slicing.sums(torch.ones_like(ref64)) if sliced else None,
        slice_default=slice_default,
        nonfinite=nonfinite,
    )


def _rest(moments: Moments, reference_sq, count):
    """The relative size of an error's rest: what is left of sum e^2 once its projections on the
    reference (the slope) and on the constant (the offset) are taken out."""
    rest_sq = moments.sq - moments.dot**2 / reference_sq - moments.total**2 / count
    return (rest_sq.clamp(min=0.0) / reference_sq).sqrt()


def _systematic(
    rule: Rule, dtype: torch.dtype, judged: tuple[float, float], default: tuple[float, float], rest: float, count: int
) -> Systematic:
    """Slopes and offsets (judged, default) against their thresholds; `rest`: the judged error's
    relative size once its slope and offset are taken out, whose scatter the threshold allows."""
    floating = dtype if dtype.is_floating_point else torch.float32
    rest = rest if math.isfinite(rest) else 0.0
    slope_threshold = rule.systematic_threshold(default[0], floating, rest, count)
    offset_threshold = rule.systematic_threshold(default[1], floating, rest, count)
    flagged = systematic_flagged(judged[0], slope_threshold, judged[1], offset_threshold)
    return Systematic(
        slope=judged[0], default_slope=default[0], slope_threshold=slope_threshold,
        offset=judged[1], default_offset=default[1], offset_threshold=offset_threshold, flagged=flagged,
    )





def _ratio(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """numerator / denominator where the denominator is positive, else the numerator (the absolute
    figure, as for an all-zero reference)."""
    return torch.where(denominator > 0, numerator / torch.where(denominator > 0, denominator, 1.0), numerator)


@dataclass
class SliceAccumulator:
    """Running FP64 sums per slice of one tensor, and its judgement slice by slice. Its pieces arrive
    along leading dimensions (a batch row each), so each piece's slices follow the last's."""

    slicing: Slicing
    reference_sq: torch.Tensor | None = None
    count: torch.Tensor | None = None
    judged: Moments | None = None
    default: Moments | None = None

    def add(self, judged: Moments, base: Baseline) -> None:
        """Add the next piece's slices: the judged error's sums, the reference's and the default's from `base`."""
        if self.judged is None:
            self.judged, self.default = judged, Moments(**vars(base.slice_default))
            self.reference_sq, self.count = base.slice_reference_sq, base.slice_count
        else:
            self.judged.add(judged, concatenate=True)
            self.default.add(base.slice_default, concatenate=True)
            self.reference_sq = torch.cat((self.reference_sq, base.slice_reference_sq))
            self.count = torch.cat((self.count, base.slice_count))

    def result(
        self, rule: Rule, dtype: torch.dtype, whole_reference_sq: float, whole_count: int, positions: int
    ) -> SliceComparison:
        """The slices judged; `whole_reference_sq` and `whole_count` are the whole tensor's sums, `positions`
        its length along the positions dimension."""
        # A slice's errors are relative to its reference's norm, or to the norm a slice of its size
        # has on average where its own is smaller: a slice whose reference is nearly zero (dq of
        # queries whose softmax is one-hot) would otherwise turn rounding noise into a huge error.
        typical_sq = whole_reference_sq * self.count / max(whole_count, 1)
        reference_sq = torch.maximum(self.reference_sq, typical_sq)
        ref_norm = reference_sq.sqrt()
        error = _ratio(self.judged.sq.sqrt(), ref_norm)
        default_error = _ratio(self.default.sq.sqrt(), ref_norm)
        bound = rule.factor * default_error + rule.slack
        over = torch.where(bound > 0, error / torch.where(bound > 0, bound, 1.0), torch.where(error > 0, math.inf, 0.0))
        over = torch.where(torch.isnan(over), math.inf, over)
        worst = _unravel(int(torch.argmax(over)), over.shape)
        systematic, systematic_over = self._systematic(rule, dtype, reference_sq)
        s_worst = _unravel(int(torch.argmax(systematic_over)), systematic_over.shape)
        return SliceComparison(
            scheme=self.slicing.describe(),
            count=over.numel(),
            failing=int((over > 1.0).sum()),
            worst_index=worst,
            worst=self.slicing.label(worst, positions),
            error=float(error[worst]),
            default_error=float(default_error[worst]),
            bound=float(bound[worst]),
            error_over_bound=float(over[worst]),
            systematic_flagged=int((systematic_over > 1.0).sum()),
            systematic_worst=self.slicing.label(s_worst, positions),
            systematic=Systematic(
                **{figure: float(values[s_worst]) for figure, values in systematic.items()},
                flagged=bool(systematic_over[s_worst] > 1.0),
            ),
            grid_shape=tuple(over.shape),
            grid=tuple(float(f"{value:.3g}") for value in over.flatten().tolist()),
        )

    def _systematic(
        self, rule: Rule, dtype: torch.dtype, reference_sq: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Every slice's Systematic figures (by field name) and the larger of its slope's and its
        offset's ratio to their thresholds (NaN as infinite)."""
        slope = _ratio(self.judged.dot, reference_sq)
        default_slope = _ratio(self.default.dot, reference_sq)
        rms_count = (reference_sq * self.count).sqrt()
        offset = _ratio(self.judged.total, rms_count)
        default_offset = _ratio(self.default.total, rms_count)
        floating = dtype if dtype.is_floating_point else torch.float32
        rest = torch.nan_to_num(_rest(self.judged, reference_sq, self.count), nan=0.0, posinf=0.0)
        slope_threshold = rule.systematic_threshold(default_slope, floating, rest, self.count)
        offset_threshold = rule.systematic_threshold(default_offset, floating, rest, self.count)
        over = torch.maximum(slope.abs() / slope_threshold, offset.abs() / offset_threshold)
        figures = {
            "slope": slope, "default_slope": default_slope, "slope_threshold": slope_threshold,
            "offset": offset, "default_offset": default_offset, "offset_threshold": offset_threshold,
        }
        return figures, torch.where(torch.isnan(over), math.inf, over)


@dataclass
class TensorAccumulator:
    """Running FP64 sums for one tensor whose pieces arrive in order along its first dimension: the
    whole tensor's layout, error sums and worst element; where the lever slices it, its slices' sums
    in a SliceAccumulator."""

    name: str
    rule: Rule
    slicing: Slicing | None = None
    pieces: int = 0
    rows: int = 0
    trailing: tuple[int, ...] = ()
    scalar: bool = False
    dtype: torch.dtype | None = None
    reference_sq: float = 0.0
    count: int = 0
    judged: Moments | None = None
    default: Moments | None = None
    slices: SliceAccumulator | None = None
    bitwise: bool = True
    nonfinite: str | None = None
    worst_distance: float = -1.0
    worst: WorstElement | None = None

    def add(
        self, judged: torch.Tensor, default: torch.Tensor, reference: torch.Tensor, base: Baseline | None = None
    ) -> None:
        """Add the next piece; `base` is baseline(name, default, reference, ...) where the caller shares it."""
        check_same_layout(self.name, judged, default, reference)
        sliced = self._check_piece(judged)
        offset = self.rows
        base = base or baseline(self.name, default, reference, offset, self.slicing)
        judged_error = judged.to(torch.float64) - base.reference
        slice_judged = Moments.of(judged_error, base.reference, self.slicing.sums) if sliced else None
        judged_moments = slice_judged.summed() if sliced else Moments.of(judged_error, base.reference, _whole)
        judged_finite = math.isfinite(judged_moments.sq.item())
        self.nonfinite = self.nonfinite or base.nonfinite
        if not judged_finite:
            self.nonfinite = self.nonfinite or nonfinite_report("judged", self.name, judged, offset)
        if self.pieces:
            self.judged.add(judged_moments, concatenate=False)
            self.default.add(base.default_moments, concatenate=False)
        else:
            self.judged, self.default = judged_moments, Moments(**vars(base.default_moments))
        if sliced:
            if self.slices is None:
                self.slices = SliceAccumulator(slicing=self.slicing)
            self.slices.add(slice_judged, base)
        self.reference_sq += base.reference_sq.item()
        self.count += judged.numel()
        self.bitwise = self.bitwise and bitwise_equal(judged, default)
        finite = judged_finite and base.nonfinite is None
        self._track_worst(judged_error.abs_(), finite, judged, default, reference, offset)
        self.pieces += 1
        self.rows += judged.shape[0] if judged.dim() else 0
        self.trailing, self.dtype, self.scalar = tuple(judged.shape[1:]), judged.dtype, judged.dim() == 0

    def _check_piece(self, judged: torch.Tensor) -> bool:
        """Raise unless a piece continues the pieces before it; whether it is judged by slices too."""
        continues = tuple(judged.shape[1:]) == self.trailing and judged.dtype == self.dtype and judged.dim() > 0
        if self.pieces and not continues:
            raise ComparisonError(
                f"tensor {self.name}: piece {self.pieces} is {tuple(judged.shape)} {judged.dtype}, which does not"
                f" continue [*, {', '.join(map(str, self.trailing))}] {self.dtype}"
            )
        sliced = self.slicing is not None and self.slicing.applies(judged)
        if sliced and self.pieces and judged.dim() == 3:
            raise ComparisonError(
                f"tensor {self.name}: sliced by positions along its first dimension, so it cannot arrive in pieces"
            )
        return sliced

    def _track_worst(
        self, distance: torch.Tensor, finite: bool, judged: torch.Tensor, default: torch.Tensor,
        reference: torch.Tensor, offset: int,
    ) -> None:
        """Keep the element farthest from the reference so far (`distance`: |judged - reference| of
        this piece; where anything is not `finite`, a non-finite distance counts as infinite)."""
        if not finite:
            distance = torch.where(torch.isfinite(distance), distance, math.inf)
        index = _unravel(int(torch.argmax(distance)), judged.shape)
        if float(distance[index]) > self.worst_distance:
            self.worst_distance = float(distance[index])
            self.worst = WorstElement(
                index=(index[0] + offset, *index[1:]) if index else (),
                judged=float(judged[index]),
                default=float(default[index]),
                reference=float(reference[index]),
            )

    def result(self) -> TensorComparison:
        if not self.pieces:
            raise ComparisonError(f"tensor {self.name}: no values were compared")
        scale = math.sqrt(self.reference_sq)
        kind = "relative" if scale > 0.0 else "absolute"
        error = math.sqrt(self.judged.sq.item()) / (scale if scale > 0.0 else 1.0)
        default_error = math.sqrt(self.default.sq.item()) / (scale if scale > 0.0 else 1.0)
        rms_count = math.sqrt(self.reference_sq * self.count) if scale > 0.0 else self.count
        bias, default_bias = self.judged.total.item() / rms_count, self.default.total.item() / rms_count
        slope_scale = self.reference_sq if scale > 0.0 else 1.0
        systematic = _systematic(
            self.rule, self.dtype,
            (self.judged.dot.item() / slope_scale, bias), (self.default.dot.item() / slope_scale, default_bias),
            float(_rest(self.judged, self.reference_sq, self.count)) if scale > 0.0 else error, self.count,
        )
        slices = None
        if self.slices is not None:
            positions = self.rows if len(self.trailing) == 2 else self.trailing[-3]
            slices = self.slices.result(self.rule, self.dtype, self.reference_sq, self.count, positions)
        return TensorComparison(
            tensor=self.name,
            shape=() if self.scalar else (self.rows, *self.trailing),
            dtype=str(self.dtype).removeprefix("torch."),
            error_kind=kind,
            error=error,
            default_error=default_error,
            reference_norm=scale,
            bias=bias,
            default_bias=default_bias,
            systematic=systematic,
            slices=slices,
            bitwise_identical=self.bitwise,
            worst=self.worst,
            nonfinite=self.nonfinite,
            **judged_figures(self.rule, error, default_error, slices, self.nonfinite),
        )


def compare_tensor(
    name: str, judged: torch.Tensor, default: torch.Tensor, reference: torch.Tensor, rule: Rule,
    slicing: Slicing | None = None,
) -> TensorComparison:
    accumulator = TensorAccumulator(name=name, rule=rule, slicing=slicing)
    accumulator.add(judged, default, reference)
    return accumulator.result()


@dataclass
class OutputsAccumulator:
    """Accumulators for every tensor a reference names, fed one set of outputs (or pieces) at a time."""

    rule: Rule
    slicing: Slicing | None = None
    tensors: dict[str, TensorAccumulator] = field(default_factory=dict)

    def add(
        self,
        judged: Mapping[str, torch.Tensor],
        default: Mapping[str, torch.Tensor],
        reference: Mapping[str, torch.Tensor],
        baselines: Mapping[str, Baseline] | None = None,
    ) -> None:
        """Add one set of outputs (or pieces); `baselines` from outputs_baselines(default, reference)
        saves reducing the same reference and default again for every judged output."""
        names = tuple(reference)
        if not names:
            raise ComparisonError("the reference produced no tensors, so nothing would be compared")
        for role, outputs in (("judged", judged), ("default", default)):
            if set(outputs) != set(names):
                missing = sorted(set(names) - set(outputs))
                extra = sorted(set(outputs) - set(names))
                raise ComparisonError(
                    f"{role} output tensors {sorted(outputs)} do not match the reference's {sorted(names)}"
                    f" (missing {missing}, unexpected {extra})"
                )
        for name in names:
            accumulator = self.tensors.setdefault(
                name, TensorAccumulator(name=name, rule=self.rule, slicing=self.slicing)
            )
            accumulator.add(judged[name], default[name], reference[name], baselines[name] if baselines else None)

    def offsets(self) -> dict[str, int]:
        """Where the next piece of each tensor starts."""
        return {name: accumulator.rows for name, accumulator in self.tensors.items()}

    def results(self) -> tuple[TensorComparison, ...]:
        return tuple(accumulator.result() for accumulator in self.tensors.values())


def outputs_baselines(
    default: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor], offsets: Mapping[str, int],
    slicing: Slicing | None = None,
) -> dict[str, Baseline]:
    """Every tensor's baseline for one set of pieces (offsets: where each piece starts in its tensor)."""
    return {
        name: baseline(name, default[name], reference[name], offsets.get(name, 0), slicing) for name in reference
    }
