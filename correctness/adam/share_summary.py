"""The Adam levers' case summary: per share of Megatron's CPU/GPU split, the pooled errors of each
quantity (correctness.adam.arithmetic.QUANTITIES)."""

import math
from collections.abc import Mapping
from typing import Any

from correctness.adam.arithmetic import QUANTITIES
from correctness.adam.split import CPU, GPU
from correctness.results import CaseResult


def _pooled(judgements: list[Any], names: set[str], quantity: str) -> dict[str, Any]:
    """Errors of several tensors pooled as one: sqrt(sum of squared errors) / sqrt(sum of ||ref||^2)."""
    chosen = [t for t in judgements if t.tensor.split(":")[0] in names and t.tensor.endswith(f":{quantity}")]
    if not chosen:
        return {}
    reference = math.sqrt(sum(t.reference_norm**2 for t in chosen)) or 1.0
    error = math.sqrt(sum((t.error * t.reference_norm) ** 2 for t in chosen)) / reference
    default = math.sqrt(sum((t.default_error * t.reference_norm) ** 2 for t in chosen)) / reference
    ratios = [t.ratio for t in chosen if t.ratio is not None]
    return {
        "error": error,
        "default_error": default,
        "ratio": error / default if default > 0 else None,
        "tensor_ratios": [min(ratios), max(ratios)] if ratios else None,
        "bitwise_identical": all(t.bitwise_identical for t in chosen),
    }


def share_summary(shares: Mapping[str, str], numel: Mapping[str, int]):
    """The lever's summary: per share, the pooled errors of each quantity, the bitwise identity of
    the CPU share with the default, the tensors that pass only on the slack, and the errors against
    the FP64 reference with FP32-rounded hyperparameters."""

    def summarize(case: CaseResult) -> dict[str, Any]:
        summary: dict[str, Any] = {}
        for share in (CPU, GPU):
            names = {name for name, side in shares.items() if side == share}
            if not names:
                continue
            tensors = list(case.candidate.tensors)
            entry: dict[str, Any] = {
                "tensors": len(names),
                "parameters": sum(numel[n] for n in names),
                "quantities": {q: _pooled(tensors, names, q) for q in QUANTITIES},
                "bitwise_identical_to_default": all(
                    t.bitwise_identical for t in tensors if t.tensor.split(":")[0] in names
                ),
                "slack_only": [t.tensor for t in tensors if t.slack_only and t.tensor.split(":")[0] in names],
            }
            for secondary in case.secondary:
                entry[f"against {secondary.run.path}"] = {
                    q: _pooled(list(secondary.tensors), names, q) for q in QUANTITIES
                }
            summary[share] = entry
        return summary

    return summarize
