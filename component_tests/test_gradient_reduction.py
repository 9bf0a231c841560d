"""The gradient-reduction-dtype lever at both recipes (see correctness/reduction/lever.py).

BF16 gradient reduction fails the rule at every DP size measured (README, "The gradient-reduction
lever"): rounding a gradient into a BF16 buffer alone is a relative error of about 1.7e-3, above
the rule's 1e-3 slack, where the FP32 default's error is about 3e-8. The record says so (verdict
`fail`). Where the recipe itself reduces in FP32 (both fixture recipes), that failure is evidence
about a change the recipe has not made, so the test is marked xfail with the figures, provided the
only failures are the candidate's tensors outside the bound: a control that passes, a default
repeat that fails, an error or a broken run still fail the test. Where the recipe reduces in BF16
(`--grad-reduce-in-bf16`, e.g. a user's recipe run with --recipe), the failure fails the test.
"""

import pytest

from correctness.reduction import lever as reduction
from correctness.recipe_sets import at_recipes


def check_reduction(lever, case, lever_check):
    lever_check(lever, case, expected_failure=None if case.shape.recipe_reduces_in == "bf16" else (
        "BF16 reduction judged for a recipe that reduces in FP32: evidence about --grad-reduce-in-bf16, not about"
        " the recipe"))


@pytest.mark.levers(factory=at_recipes(reduction.gpu_tier))
def test_gradient_reduction_dtype_nccl(lever, case, lever_check):
    check_reduction(lever, case, lever_check)


@pytest.mark.levers(factory=at_recipes(reduction.cpu_tier))
def test_gradient_reduction_dtype_cpu(lever, case, lever_check):
    """torch.distributed on gloo ranks: DP 2, 4 and 8 (and the recipe's own) in one run of 8 ranks."""
    check_reduction(lever, case, lever_check)
