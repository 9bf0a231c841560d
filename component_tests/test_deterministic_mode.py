"""The deterministic-mode lever at both seed recipes (see correctness/determinism/lever.py):
attention forward and backward and the gradient reduction with --deterministic-mode's switches on,
bitwise repeatable over three runs, against the same kernels with nondeterminism allowed and FP64."""

import pytest

from correctness.determinism import lever as determinism
from correctness.recipe_sets import at_recipes


@pytest.mark.levers(factory=at_recipes(determinism.recipe_gpu_tier), lever=determinism.NAME)
def test_deterministic_mode_te_attention(lever, case, lever_check):
    lever_check(lever, case)


@pytest.mark.levers(factory=at_recipes(determinism.gpu_tier), lever=determinism.NAME)
def test_deterministic_mode_on_gpu(lever, case, lever_check):
    """Each torch SDPA backend, and NCCL with NCCL_ALGO=Ring over this machine's GPUs."""
    lever_check(lever, case)


@pytest.mark.levers(factory=at_recipes(determinism.cpu_tier), lever=determinism.NAME)
def test_deterministic_mode_on_cpu(lever, case, lever_check):
    """torch SDPA's flash CPU kernel, and gloo ranks at DP 2, 4 and 8."""
    lever_check(lever, case)
