"""The MoE grouped-GEMM lever (see correctness/moe/grouped_gemm_lever.py): the experts' GEMMs
grouped against megatron-core's SequentialMLP (one GEMM per expert) and FP64, on the Nemotron-3-Super
recipe and the Qwen3-30B-A3B example recipe (Gemma-4 is dense: not applicable)."""

import pytest

from correctness.moe import grouped_gemm_lever
from correctness.recipe_sets import NEMOTRON, QWEN3_MOE, at_recipes

MOE_RECIPES = (NEMOTRON, QWEN3_MOE)


@pytest.mark.levers(factory=at_recipes(grouped_gemm_lever.recipe_gpu_tier, MOE_RECIPES), lever=grouped_gemm_lever.NAME)
def test_moe_grouped_gemm_with_te(lever, case, lever_check):
    lever_check(lever, case)


@pytest.mark.levers(factory=at_recipes(grouped_gemm_lever.cpu_tier, MOE_RECIPES), lever=grouped_gemm_lever.NAME)
def test_moe_grouped_gemm_on_cpu(lever, case, lever_check):
    """torch's CPU grouped matmul against Megatron's SequentialMLP."""
    lever_check(lever, case)
