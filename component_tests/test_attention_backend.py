"""The attention-backend lever at the Gemma-4-31B recipe (see correctness/attention/lever.py)."""

from functools import partial

import pytest

from correctness.attention import lever as attention

RECIPE = "gemma-4-31b/h100/attune-tp2-pp4-split13"


@pytest.mark.levers(factory=partial(attention.recipe_gpu_tier, RECIPE), lever=attention.NAME)
def test_te_auto_against_te_unfused(lever, case, lever_check):
    lever_check(lever, case)


@pytest.mark.levers(factory=partial(attention.gpu_sdpa_tier, RECIPE), lever=attention.NAME)
def test_sdpa_fused_against_eager_unfused(lever, case, lever_check):
    lever_check(lever, case)


@pytest.mark.levers(factory=partial(attention.cpu_tier, RECIPE), lever=attention.NAME)
def test_sdpa_flash_cpu_against_eager_unfused(lever, case, lever_check):
    lever_check(lever, case)


@pytest.mark.levers(factory=partial(attention.te_cpu_tier, RECIPE), lever=attention.NAME)
def test_sdpa_flash_cpu_against_te_unfused_on_cpu(lever, case, lever_check):
    lever_check(lever, case)
