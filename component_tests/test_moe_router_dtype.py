"""The moe-router-dtype lever (see correctness/router/lever.py): Megatron's TopKRouter with its
logits in BF16 against the recipe's router dtype (FP32) and FP64 routing, at the Nemotron-3-Super
recipe and the example MoE recipes (Qwen3-30B-A3B, GPT-OSS-20B: softmax scoring; Nemotron-3-Super,
Moonlight-16B-A3B: sigmoid with an expert bias and a scaling factor).

A BF16 router fails the rule on every recipe measured (docs/levers/moe-router-dtype.md): its logits'
rounding alone is a relative error of about 1.7e-3, above the rule's 1e-3 slack, and near-ties at
the top-k boundary then change the expert set of some tokens. So does its BF16 format floor (FP64
routing from the logits and the scores rounded to BF16, correctness/router/floor.py): every case is
`format-limited`, which passes; anything else (worse than BF16 allows, biased beyond the floor, a
control within the format bound, an error) fails the test.
"""

import pytest

from correctness.router import lever as router
from correctness.recipe_sets import GPT_OSS, MOONLIGHT, NEMOTRON, QWEN3_MOE, at_recipes

MOE_RECIPES = (NEMOTRON, QWEN3_MOE, GPT_OSS, MOONLIGHT)


@pytest.mark.levers(factory=at_recipes(router.megatron_gpu_tier, (NEMOTRON,)), lever=router.NAME)
def test_moe_router_bf16_logits_against_fp32_gpu(lever, case, lever_check):
    lever_check(lever, case)


@pytest.mark.levers(factory=at_recipes(router.cpu_tier, MOE_RECIPES), lever=router.NAME)
def test_moe_router_bf16_logits_against_fp32_cpu(lever, case, lever_check):
    """Megatron's own TopKRouter on the CPU (shims: correctness/router/megatron_router.py)."""
    lever_check(lever, case)
