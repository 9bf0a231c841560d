"""The optimizer-offload lever at the Gemma-4-31B recipe (see correctness/optimizer/lever.py)."""

from functools import partial

import pytest

from correctness.optimizer import lever as offload

RECIPE = "gemma-4-31b/h100/attune-tp2-pp4-split13"


@pytest.mark.h100
@pytest.mark.te
@pytest.mark.levers(factory=partial(offload.recipe_gpu_tier, RECIPE))
def test_offload_fraction_with_te_fused_adam(lever, case, lever_check):
    lever_check(lever, case)


@pytest.mark.levers(factory=partial(offload.cpu_tier, RECIPE))
def test_offload_fraction_cpu(lever, case, lever_check):
    lever_check(lever, case)


@pytest.mark.gpu
@pytest.mark.te
@pytest.mark.megatron
@pytest.mark.levers(factory=partial(offload.megatron_tier, RECIPE))
def test_offload_fraction_with_megatron_hybrid_optimizer(lever, case, lever_check):
    lever_check(lever, case)
