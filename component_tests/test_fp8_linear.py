"""The FP8 lever at both recipes (see correctness/fp8/lever.py): a linear layer's forward and backward
in FP8 as TE's delayed, tensorwise (current), blockwise and MXFP8 recipes quantise it, against BF16
and FP64.

FP8 fails the rule against BF16 on every tensor of every case (E4M3's unit roundoff is 32 times
BF16's, and the bound is 2 x the BF16 error + 1e-3), and so does its format floor: the FP64 linear
on the recipe's FP8 operands, rounded once to the output dtypes. Judged against that floor (2 x the
floor's error + 1e-3, no bias beyond it, every negative control outside it), every case of both
seed recipes is `format-limited` (docs/levers/fp8.md), which passes; anything else fails the test,
whether the recipe trains in FP8 or not. What a recipe that turns FP8 on needs besides is
convergence evidence against its BF16 reference (`correctness converge`), which the rule cannot give.
"""

import pytest

from correctness.fp8 import lever as fp8
from correctness.recipe_sets import at_recipes


@pytest.mark.levers(factory=at_recipes(fp8.recipe_gpu_tier), lever=fp8.NAME)
def test_fp8_linear_with_te(lever, case, lever_check):
    """TE's Linear under te.autocast with the FP8 recipe, against TE's Linear in BF16, recipe scale."""
    lever_check(lever, case)


@pytest.mark.levers(factory=at_recipes(fp8.cpu_tier), lever=fp8.NAME)
def test_fp8_linear_cpu(lever, case, lever_check):
    """torch's float8 dtypes, smoke scale; the GEMMs with Hopper's arithmetic (mmaemu hopper-te: the H100 PCIe's,
    the nearest chip mmaemu models to the recipe's H100 SXM / H200) on delayed and tensorwise scaling, the FP32
    stand-in on blockwise and MXFP8 (the record says which ran)."""
    lever_check(lever, case)
