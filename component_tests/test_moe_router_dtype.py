"""The moe-router-dtype lever (see correctness/router/lever.py): Megatron's TopKRouter with its
logits in BF16 against the recipe's router dtype (FP32) and FP64 routing, at the Nemotron-3-Super
recipe and the example MoE recipes (Qwen3-30B-A3B, GPT-OSS-20B: softmax scoring; Moonlight-16B-A3B:
sigmoid with an expert bias and a scaling factor).

BF16 logits fail the rule on every recipe measured (README of the lever): the BF16 rounding of the
logits alone is a relative error of about 1.7e-3, above the rule's 1e-3 slack, where the FP32
default's is about 1.4e-7, and near-ties at the top-k boundary change the expert set of 1.5-22% of
the tokens. Where the recipe itself runs the router in FP32 or FP64 (every recipe here), that
failure is evidence about leaving `--moe-router-dtype` out, not about the recipe: the test is
xfailed with the figures, provided the only failures are the candidate's tensors outside the bound
(a control that passes, a default repeat that fails, an error still fail it). Where the recipe runs
BF16 logits (a user's recipe without the flag, run with --recipe), the failure fails the test.
"""

import pytest

from correctness.router import lever as router
from correctness.recipe_sets import GPT_OSS, MOONLIGHT, NEMOTRON, QWEN3_MOE, at_recipes

MOE_RECIPES = (NEMOTRON, QWEN3_MOE, GPT_OSS, MOONLIGHT)


def check_router(lever, case, lever_check):
    lever_check(lever, case, expected_failure=None if router.recipe_runs_bf16_logits(case.shape) else (
        f"BF16 router logits judged for a recipe that runs its router in {case.shape.recipe_router_dtype}: evidence"
        " about leaving --moe-router-dtype out, not about the recipe"))


@pytest.mark.levers(factory=at_recipes(router.megatron_gpu_tier, (NEMOTRON,)))
def test_moe_router_bf16_logits_against_fp32_gpu(lever, case, lever_check):
    check_router(lever, case, lever_check)


@pytest.mark.levers(factory=at_recipes(router.cpu_tier, MOE_RECIPES))
def test_moe_router_bf16_logits_against_fp32_cpu(lever, case, lever_check):
    """Megatron's own TopKRouter on the CPU (shims: correctness/router/megatron_router.py)."""
    check_router(lever, case, lever_check)
