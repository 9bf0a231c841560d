"""Per-tensor comparison of a judged output and the default output against an FP64 reference.

err(x) = ||x - ref||_2 / ||ref||_2, computed in FP64. Where the reference is all zeros the error
is the absolute norm ||x||_2 and `error_kind` says so. The judged output passes where
err(judged) <= rule.bound(err(default)); NaN or Inf anywhere never passes.
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass

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


def nonfinite_report(role: str, name: str, x: torch.Tensor) -> str | None:
    """None where x is all finite, else a one-line count of NaN and Inf with the first index."""
    finite = torch.isfinite(x)
    if bool(finite.all()):
        return None
    nans = int(torch.isnan(x).sum())
    infs = int(torch.isinf(x).sum())
    first = tuple(int(i) for i in torch.nonzero(~finite)[0])
    return f"{role} {name}: {nans} NaN and {infs} Inf of {x.numel()} elements, first at {list(first)}"


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


def worst_element(judged: torch.Tensor, default: torch.Tensor, reference: torch.Tensor) -> WorstElement:
    distance = (judged.to(torch.float64) - reference.to(torch.float64)).abs()
    distance = torch.where(torch.isfinite(distance), distance, torch.full_like(distance, math.inf))
    flat = int(torch.argmax(distance))
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), judged.shape))
    return WorstElement(
        index=index,
        judged=float(judged[index]),
        default=float(default[index]),
        reference=float(reference[index]),
    )


def compare_tensor(
    name: str, judged: torch.Tensor, default: torch.Tensor, reference: torch.Tensor, rule: Rule
) -> TensorComparison:
    check_same_layout(name, judged, default, reference)
    nonfinite = (
        nonfinite_report("reference", name, reference)
        or nonfinite_report("default", name, default)
        or nonfinite_report("judged", name, judged)
    )
    error, kind = relative_l2_error(judged, reference)
    default_error, _ = relative_l2_error(default, reference)
    bound = rule.bound(default_error)
    passes = nonfinite is None and error <= bound
    return TensorComparison(
        tensor=name,
        shape=tuple(judged.shape),
        dtype=str(judged.dtype).removeprefix("torch."),
        error_kind=kind,
        error=error,
        default_error=default_error,
        bound=bound,
        ratio=error / default_error if default_error > 0.0 else None,
        margin=bound - error,
        error_over_bound=error / bound if bound > 0.0 else (0.0 if error == 0.0 else math.inf),
        bias=signed_mean_error(judged, reference),
        default_bias=signed_mean_error(default, reference),
        passes=passes,
        slack_only=passes and error > rule.factor * default_error,
        bitwise_identical=bitwise_equal(judged, default),
        worst=worst_element(judged, default, reference),
        nonfinite=nonfinite,
    )


def compare_outputs(
    judged: Mapping[str, torch.Tensor],
    default: Mapping[str, torch.Tensor],
    reference: Mapping[str, torch.Tensor],
    rule: Rule,
) -> tuple[TensorComparison, ...]:
    """Compare every tensor the reference names; the three must name the same tensors."""
    names = tuple(reference)
    if not names:
        raise ComparisonError("reference output names no tensors, so nothing could fail")
    for role, outputs in (("judged", judged), ("default", default)):
        if set(outputs) != set(names):
            missing = sorted(set(names) - set(outputs))
            extra = sorted(set(outputs) - set(names))
            raise ComparisonError(
                f"{role} output tensors {sorted(outputs)} do not match the reference's {sorted(names)}"
                f" (missing {missing}, unexpected {extra})"
            )
    return tuple(compare_tensor(n, judged[n], default[n], reference[n], rule) for n in names)
