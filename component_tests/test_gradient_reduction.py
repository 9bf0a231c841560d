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

import re

import pytest

from correctness.reduction import lever as reduction

GEMMA = "gemma-4-31b/h100/attune-tp2-pp4-split13"
NEMOTRON = "nemotron-3-super-120b-a12b/h200/attune-tp4-pp2-ep8-mt16k"
OUTSIDE_BOUND = re.compile(r"candidate( \(repeat\))? dp\d+/\S+: error \S+ > bound \S+ \(default error \S+\); worst element ")


def both_recipes(tier):
    """The tier's levers at both fixture recipes (with --recipe, the plugin keeps one per lever)."""
    return lambda options: [lever for recipe in (GEMMA, NEMOTRON) for lever in tier(recipe, options)]


def check_reduction(lever, case, lever_check):
    if case.shape.recipe_reduces_in == "bf16":
        lever_check(lever, case)
        return
    try:
        lever_check(lever, case)
    except pytest.fail.Exception as failed:
        failures = [line[4:] for line in str(failed).splitlines() if line.startswith("  - ")]
        if not failures or not all(OUTSIDE_BOUND.match(line) for line in failures):
            raise
        outside = sum(not line.startswith("candidate (repeat)") for line in failures)
        pytest.xfail(
            f"BF16 reduction outside the bound on {outside} tensors (record verdict: fail); the recipe reduces in"
            " FP32, so this is evidence about --grad-reduce-in-bf16, not about the recipe"
        )


@pytest.mark.levers(factory=both_recipes(reduction.gpu_tier))
def test_gradient_reduction_dtype_nccl(lever, case, lever_check):
    check_reduction(lever, case, lever_check)


@pytest.mark.levers(factory=both_recipes(reduction.cpu_tier))
def test_gradient_reduction_dtype_cpu(lever, case, lever_check):
    """torch.distributed on gloo ranks: DP 2, 4 and 8 (and the recipe's own) in one run of 8 ranks."""
    check_reduction(lever, case, lever_check)
