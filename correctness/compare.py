"""Per-tensor comparison of a judged output and the default output against an FP64 reference.

err(x) = ||x - ref||_2 / ||ref||_2, computed in FP64. Where the reference is all zeros the error
is the absolute norm ||x - ref||_2 and `error_kind` says so. The judged output passes where
err(judged) <= rule.bound(err(default)); NaN or Inf anywhere never passes.

A tensor may arrive in pieces (consecutive blocks along its first dimension, as a streamed lever
delivers them): `TensorAccumulator` keeps running sums, so the figures are those of the whole
tensor; `compare_tensor` is the one-piece case.
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from correctness.errors import ComparisonError
from correctness.rule import Rule


@dataclass(frozen=True, kw_only=True)
class WorstElement:
    """The element where the judged output is farthest from the reference, with all three values."""

    index: tuple[int, ...]
    judged: float
    default: float
    reference: float


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
    error_over_bound: float  # error / bound: above 1 outside the bound
    bias: float  # signed mean error, mean(x - ref) / rms(ref) (absolute where ref is zero)
    default_bias: float
    passes: bool
    slack_only: bool  # passes, but only thanks to the rule's slack
    bitwise_identical: bool  # judged and default outputs are equal bit for bit
    worst: WorstElement
    nonfinite: str | None  # where NaN or Inf was found, if anywhere


def _sum_sq(x: torch.Tensor) -> float:
    return torch.linalg.vector_norm(x).item() ** 2


def _unravel(flat: int, shape: torch.Size) -> tuple[int, ...]:
    """The index of element `flat` of a contiguous tensor of `shape` (torch.unravel_index, without
    its cost per call, which dominates on the optimizer's many small tensors)."""
    index = []
    for size in reversed(shape):
        flat, i = divmod(flat, size)
        index.append(i)
    return tuple(reversed(index))


def relative_l2_error(x: torch.Tensor, ref: torch.Tensor) -> tuple[float, str]:
    """||x - ref|| / ||ref|| in FP64, or ||x - ref|| with kind "absolute" where ref is all zeros."""
    ref64 = ref.to(torch.float64)
    diff = torch.linalg.vector_norm(x.to(torch.float64) - ref64).item()
    scale = torch.linalg.vector_norm(ref64).item()
    if scale == 0.0:
        return diff, "absolute"
    return diff / scale, "relative"


def signed_mean_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """mean(x - ref) / rms(ref): the bias of x, in units of the reference's size."""
    ref64 = ref.to(torch.float64)
    mean = (x.to(torch.float64) - ref64).mean().item()
    rms = ref64.square().mean().sqrt().item()
    return mean / rms if rms > 0.0 else mean


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


@dataclass(frozen=True)
class Baseline:
    """The reference and the default of one piece, reduced once and shared by every output judged
    against them: the reference in FP64, and the sums the bound needs."""

    reference: torch.Tensor  # FP64
    default: torch.Tensor
    reference_sq: float
    default_sq: float
    default_sum: float
    nonfinite: str | None


def _sum_sq_checked(x: torch.Tensor) -> tuple[float, bool]:
    """Sum of squares in FP64, and whether every element was finite (NaN and Inf reach the sum)."""
    total = _sum_sq(x)
    return total, math.isfinite(total)


def baseline(name: str, default: torch.Tensor, reference: torch.Tensor, offset: int = 0) -> Baseline:
    if default.shape != reference.shape:
        raise ComparisonError(
            f"tensor {name}: outputs are {tuple(default.shape)} but the reference is {tuple(reference.shape)}"
        )
    ref64 = reference.to(torch.float64)
    reference_sq, reference_finite = _sum_sq_checked(ref64)
    default_diff = default.to(torch.float64) - ref64
    default_sq, default_finite = _sum_sq_checked(default_diff)
    nonfinite = None
    if not (reference_finite and default_finite):
        nonfinite = nonfinite_report("reference", name, reference, offset) or nonfinite_report(
            "default", name, default, offset
        )
    return Baseline(
        reference=ref64,
        default=default,
        reference_sq=reference_sq,
        default_sq=default_sq,
        default_sum=default_diff.sum().item(),
        nonfinite=nonfinite,
    )


@dataclass
class TensorAccumulator:
    """Running FP64 sums for one tensor whose pieces arrive in order along its first dimension."""

    name: str
    rule: Rule
    pieces: int = 0
    rows: int = 0
    trailing: tuple[int, ...] = ()
    scalar: bool = False
    dtype: torch.dtype | None = None
    judged_sq: float = 0.0
    default_sq: float = 0.0
    reference_sq: float = 0.0
    judged_sum: float = 0.0
    default_sum: float = 0.0
    count: int = 0
    bitwise: bool = True
    nonfinite: str | None = None
    worst_distance: float = -1.0
    worst: WorstElement | None = None

    def add(
        self, judged: torch.Tensor, default: torch.Tensor, reference: torch.Tensor, base: Baseline | None = None
    ) -> None:
        """Add the next piece; `base` is baseline(name, default, reference) where the caller shares it."""
        check_same_layout(self.name, judged, default, reference)
        trailing = tuple(judged.shape[1:])
        if self.pieces and (trailing != self.trailing or judged.dtype != self.dtype or judged.dim() == 0):
            raise ComparisonError(
                f"tensor {self.name}: piece {self.pieces} is {tuple(judged.shape)} {judged.dtype}, which does not"
                f" continue [*, {', '.join(map(str, self.trailing))}] {self.dtype}"
            )
        offset = self.rows
        base = base or baseline(self.name, default, reference, offset)
        judged_diff = judged.to(torch.float64) - base.reference
        judged_sq, judged_finite = _sum_sq_checked(judged_diff)
        self.nonfinite = self.nonfinite or base.nonfinite
        if not judged_finite:
            self.nonfinite = self.nonfinite or nonfinite_report("judged", self.name, judged, offset)
        self.judged_sq += judged_sq
        self.default_sq += base.default_sq
        self.reference_sq += base.reference_sq
        self.judged_sum += judged_diff.sum().item()
        self.default_sum += base.default_sum
        self.count += judged.numel()
        self.bitwise = self.bitwise and bitwise_equal(judged, default)
        distance = judged_diff.abs_()
        if not (judged_finite and base.nonfinite is None):
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
        self.pieces += 1
        self.rows += judged.shape[0] if judged.dim() else 0
        self.trailing, self.dtype, self.scalar = trailing, judged.dtype, judged.dim() == 0

    def result(self) -> TensorComparison:
        if not self.pieces:
            raise ComparisonError(f"tensor {self.name}: no values were compared")
        scale = math.sqrt(self.reference_sq)
        kind = "relative" if scale > 0.0 else "absolute"
        error = math.sqrt(self.judged_sq) / (scale if scale > 0.0 else 1.0)
        default_error = math.sqrt(self.default_sq) / (scale if scale > 0.0 else 1.0)
        rms_count = math.sqrt(self.reference_sq * self.count) if scale > 0.0 else self.count
        bound = self.rule.bound(default_error)
        passes = self.nonfinite is None and error <= bound
        return TensorComparison(
            tensor=self.name,
            shape=() if self.scalar else (self.rows, *self.trailing),
            dtype=str(self.dtype).removeprefix("torch."),
            error_kind=kind,
            error=error,
            default_error=default_error,
            reference_norm=scale,
            bound=bound,
            ratio=error / default_error if default_error > 0.0 else None,
            margin=bound - error,
            error_over_bound=error / bound if bound > 0.0 else (0.0 if error == 0.0 else math.inf),
            bias=self.judged_sum / rms_count,
            default_bias=self.default_sum / rms_count,
            passes=passes,
            slack_only=passes and error > self.rule.factor * default_error,
            bitwise_identical=self.bitwise,
            worst=self.worst,
            nonfinite=self.nonfinite,
        )

def compare_tensor(
    name: str, judged: torch.Tensor, default: torch.Tensor, reference: torch.Tensor, rule: Rule
) -> TensorComparison:
    accumulator = TensorAccumulator(name=name, rule=rule)
    accumulator.add(judged, default, reference)
    return accumulator.result()


@dataclass
class OutputsAccumulator:
    """Accumulators for every tensor a reference names, fed one set of outputs (or pieces) at a time."""

    rule: Rule
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
            accumulator = self.tensors.setdefault(name, TensorAccumulator(name=name, rule=self.rule))
            accumulator.add(judged[name], default[name], reference[name], baselines[name] if baselines else None)

    def offsets(self) -> dict[str, int]:
        """Where the next piece of each tensor starts."""
        return {name: accumulator.rows for name, accumulator in self.tensors.items()}

    def results(self) -> tuple[TensorComparison, ...]:
        return tuple(accumulator.result() for accumulator in self.tensors.values())


def outputs_baselines(
    default: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor], offsets: Mapping[str, int]
) -> dict[str, Baseline]:
    """Every tensor's baseline for one set of pieces (offsets: where each piece starts in its tensor)."""
    return {name: baseline(name, default[name], reference[name], offsets.get(name, 0)) for name in reference}


def compare_outputs(
    judged: Mapping[str, torch.Tensor],
    default: Mapping[str, torch.Tensor],
    reference: Mapping[str, torch.Tensor],
    rule: Rule,
) -> tuple[TensorComparison, ...]:
    """Compare every tensor the reference names; the three must name the same tensors."""
    accumulator = OutputsAccumulator(rule=rule)
    accumulator.add(judged, default, reference)
    return accumulator.results()
