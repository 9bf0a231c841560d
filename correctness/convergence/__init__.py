"""Loss-curve convergence: a candidate run's per-step losses against a reference run's.

`curves` reads a curve from a Megatron/miles training log, a CSV or a JSON file (`read_curve`, a
`Curve`); `checks` runs Megatron-Bridge's five `validate_convergence` checks on two curves, with
what that function lets through closed, plus a drift check for longer runs (`check_convergence`, a
`ConvergenceResult`), and gives the recipe's `correctness.convergence` block (`convergence_block`)
and the terminal table (`format_report`); `picture` says what a plot of a check shows, which
`correctness converge --plot` draws as a PNG and `correctness report --curves` as SVG. The names
below are those other modules use; the rest is imported from the module that defines it.
"""

from correctness.convergence.checks import (
    THRESHOLDS,
    ConvergenceResult,
    check_convergence,
    convergence_block,
    format_report,
)
from correctness.convergence.curves import Curve, read_curve

__all__ = [
    "THRESHOLDS",
    "ConvergenceResult",
    "Curve",
    "check_convergence",
    "convergence_block",
    "format_report",
    "read_curve",
]
