"""The MoE permute-fusion levers (see correctness/moe/permute_lever.py): the permutation's gathers
bit for bit and its top-k sums under the rule, TE's fused kernels (or their torch stand-in on the
CPU) against megatron-core's torch permute and unpermute and FP64, on the Nemotron-3-Super recipe
and the Qwen3-30B-A3B example recipe (Gemma-4 is dense: not applicable)."""

import pytest

from correctness.moe import permute_lever
from correctness.recipe_sets import NEMOTRON, QWEN3_MOE, at_recipes

MOE_RECIPES = (NEMOTRON, QWEN3_MOE)


@pytest.mark.levers(factory=at_recipes(permute_lever.recipe_gpu_tier, MOE_RECIPES), lever=(permute_lever.EXACT_NAME, permute_lever.SUMS_NAME))
def test_moe_permute_fusion_with_te(lever, case, lever_check):
    lever_check(lever, case)


@pytest.mark.levers(factory=at_recipes(permute_lever.cpu_tier, MOE_RECIPES), lever=(permute_lever.EXACT_NAME, permute_lever.SUMS_NAME))
def test_moe_permute_fusion_on_cpu(lever, case, lever_check):
    """The torch stand-in of TE's permutation arithmetic against Megatron's torch permute and unpermute."""
    lever_check(lever, case)
