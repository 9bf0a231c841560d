"""The optimizer-offload lever at both recipes (see correctness/optimizer/lever.py)."""

import pytest

from correctness.optimizer import lever as offload

GEMMA = "gemma-4-31b/h100/attune-tp2-pp4-split13"
NEMOTRON = "nemotron-3-super-120b-a12b/h200/attune-tp4-pp2-ep8-mt16k"


def both_recipes(tier):
    """The tier's levers at both fixture recipes (with --recipe, the plugin keeps one per lever)."""
    return lambda options: [lever for recipe in (GEMMA, NEMOTRON) for lever in tier(recipe, options)]


@pytest.mark.levers(factory=both_recipes(offload.recipe_gpu_tier))
def test_offload_with_te_fused_adam(lever, case, lever_check):
    lever_check(lever, case)


@pytest.mark.levers(factory=both_recipes(offload.megatron_tier))
def test_offload_with_megatron_hybrid_optimizer(lever, case, lever_check):
    lever_check(lever, case)


@pytest.mark.levers(factory=both_recipes(offload.megatron_cpu_tier))
def test_offload_with_megatron_hybrid_optimizer_on_cpu(lever, case, lever_check):
    """Megatron's own HybridDeviceOptimizer makes the split and steps both shares, on the CPU."""
    lever_check(lever, case)


@pytest.mark.levers(factory=both_recipes(offload.cpu_tier))
def test_offload_fraction_cpu(lever, case, lever_check):
    lever_check(lever, case)
