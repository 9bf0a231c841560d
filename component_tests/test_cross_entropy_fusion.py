"""The cross-entropy-fusion lever at both seed recipes (see correctness/cross_entropy/lever.py):
Megatron's fused vocab-parallel cross entropy (impl native) on gloo ranks on the CPU and on a GPU,
and TE's parallel cross entropy (impl te) on the recipe's GPU, each against Megatron's unfused one
and FP64 over the full vocabulary, at TP 1 and TP 2."""

import pytest

from correctness.cross_entropy import lever as cross_entropy
from correctness.recipe_sets import at_recipes


@pytest.mark.levers(factory=at_recipes(cross_entropy.recipe_gpu_tier), lever=cross_entropy.NAME)
def test_cross_entropy_fusion_with_te(lever, case, lever_check):
    lever_check(lever, case)


@pytest.mark.levers(factory=at_recipes(cross_entropy.megatron_gpu_tier), lever=cross_entropy.NAME)
def test_cross_entropy_fusion_native_on_gpu(lever, case, lever_check):
    lever_check(lever, case)


@pytest.mark.levers(factory=at_recipes(cross_entropy.cpu_tier), lever=cross_entropy.NAME)
def test_cross_entropy_fusion_native_on_cpu(lever, case, lever_check):
    """Megatron's own fused and unfused functions on 1 and 2 gloo ranks, on the CPU."""
    lever_check(lever, case)
