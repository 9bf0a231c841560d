"""The precision-aware Adam lever at both recipes (see correctness/adam_precision/lever.py).

BF16 and FP8 moments and FP16 masters fail the rule (one BF16 rounding of a stored moment is above
the rule's 1e-3 slack, where the FP32 default's error is about 2e-7), and so does each case's format
floor: the FP64 AdamW reference with the case's state stored in the case's dtypes between steps, as
TE FusedAdam stores it, and otherwise exact. Judged against that floor (2 x the floor's error + 1e-3,
no bias beyond it, every applicable negative control outside it) those cases are `format-limited`;
FP16 moments and FP32 masters kept as remainders pass the rule outright
(docs/levers/precision-aware-adam.md). Both are accepted whether or not the recipe asks for the
dtypes; a state worse than its format allows, biased beyond the floor's rounding, or a control
within the format bound fails the test.
"""

import pytest

from correctness.adam_precision import lever as adam_precision
from correctness.recipe_sets import at_recipes


@pytest.mark.levers(factory=at_recipes(adam_precision.recipe_gpu_tier), lever=adam_precision.NAME)
def test_precision_aware_adam_te(lever, case, lever_check):
    lever_check(lever, case)


@pytest.mark.levers(factory=at_recipes(adam_precision.cpu_tier), lever=adam_precision.NAME)
def test_precision_aware_adam_cpu(lever, case, lever_check):
    """TE FusedAdam's state storage emulated on the CPU (EmulatedFusedAdam), at the smoke scale."""
    lever_check(lever, case)
