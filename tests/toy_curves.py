"""Hand-built loss curves for the convergence tests (test_convergence_checks, _curves, _command),
and the recipe block's fields in their order."""

from pathlib import Path

import numpy as np

from correctness.convergence import Curve

DATA = Path(__file__).parent / "data" / "convergence"
BLOCK_FIELDS = ["steps", "result", "correlation", "final_loss_difference", "pointwise_failures"]


def curve(losses, steps=None, source="candidate") -> Curve:
    losses = np.asarray(losses, dtype=np.float64)
    steps = np.arange(1, len(losses) + 1) if steps is None else np.asarray(steps)
    return Curve(source, "json", steps.astype(np.int64), losses)


def decaying(n: int, start: float = 3.5, end: float = 2.5) -> np.ndarray:
    """A smooth decreasing loss, every point above 2.0 (the 10% point-wise tier)."""
    return end + (start - end) * np.exp(-np.arange(n) / (n / 4))


def upward_drift(n: int, end: float) -> tuple[np.ndarray, np.ndarray]:
    """A reference and a candidate that rises linearly to `end` (relative) above it, with step noise."""
    reference = decaying(n)
    noise = np.random.default_rng(0).normal(0.0, 0.005, n)
    return reference * (1 + end * np.arange(n) / (n - 1)) + noise, reference
