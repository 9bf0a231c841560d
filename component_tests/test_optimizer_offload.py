"""The optimizer-offload lever at both recipes (see correctness/optimizer/lever.py)."""

import pytest

from correctness.optimizer import lever as offload
from correctness.recipe_sets import at_recipes


@pytest.mark.levers(factory=at_recipes(offload.recipe_gpu_tier), lever=offload.NAME)
def test_offload_with_te_fused_adam(lever, case, lever_check):
    lever_check(lever, case)


@pytest.mark.levers(factory=at_recipes(offload.megatron_tier), lever=offload.NAME)
def test_offload_with_megatron_hybrid_optimizer(lever, case, lever_check):
    lever_check(lever, case)


@pytest.mark.levers(factory=at_recipes(offload.megatron_cpu_tier), lever=offload.NAME)
def test_offload_with_megatron_hybrid_optimizer_on_cpu(lever, case, lever_check):
    """Megatron's own HybridDeviceOptimizer makes the split and steps both shares, on the CPU."""
    lever_check(lever, case)


@pytest.mark.levers(factory=at_recipes(offload.cpu_tier), lever=offload.NAME)
def test_offload_fraction_cpu(lever, case, lever_check):
    lever_check(lever, case)
