"""Packing two rows per microbatch at the Nemotron-3-Super recipe: attention over THD rows and the
per-token loss of the packed microbatch (see correctness/attention/packing.py, correctness/loss/packing.py)."""

from functools import partial

import pytest

from correctness.attention import packing
from correctness.loss import packing as loss

NEMOTRON = "nemotron-3-super-120b-a12b/h200/attune-tp4-pp2-ep8-mt16k"


@pytest.mark.levers(factory=partial(packing.recipe_gpu_tier, NEMOTRON), lever=packing.NAME)
def test_thd_packing_with_te(lever, case, lever_check):
    lever_check(lever, case)


@pytest.mark.levers(factory=partial(packing.gpu_sdpa_tier, NEMOTRON), lever=packing.NAME)
def test_thd_packing_with_sdpa_fused_backends(lever, case, lever_check):
    lever_check(lever, case)


@pytest.mark.levers(factory=partial(loss.gpu_tier, NEMOTRON), lever=loss.NAME)
def test_packed_loss_gpu(lever, case, lever_check):
    lever_check(lever, case)


@pytest.mark.levers(factory=partial(packing.cpu_tier, NEMOTRON), lever=packing.NAME)
def test_thd_packing_cpu(lever, case, lever_check):
    lever_check(lever, case)


@pytest.mark.levers(factory=partial(loss.cpu_tier, NEMOTRON), lever=loss.NAME)
def test_packed_loss_cpu(lever, case, lever_check):
    lever_check(lever, case)
