"""The rope-fusion lever (`--no-rope-fusion`, see correctness/rope/lever.py): Megatron's unfused
`apply_rotary_pos_emb` against TE's fused RoPE (on the CPU: the fused kernel's arithmetic, a named
stand-in) and an FP64 RoPE, q and k, forward and backward.

Both seed recipes are named; Nemotron-3-Super's attention has no position embedding, so its lever
does not apply (NotApplicable, with the reason) and only Gemma-4's runs; with --recipe the one
recipe runs, or the test skips with the reason where the recipe has no RoPE."""

import pytest

from correctness.rope import lever as rope
from correctness.recipe_sets import at_recipes


@pytest.mark.levers(factory=at_recipes(rope.recipe_gpu_tier), lever=rope.NAME)
def test_rope_fusion_te_on_gpu(lever, case, lever_check):
    lever_check(lever, case)


@pytest.mark.levers(factory=at_recipes(rope.cpu_tier), lever=rope.NAME)
def test_rope_fusion_on_cpu(lever, case, lever_check):
    """Megatron's own unfused RoPE on the CPU against the fused kernel's arithmetic."""
    lever_check(lever, case)
