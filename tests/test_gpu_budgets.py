"""Every GPU tier fits a one-GPU, ten-minute run, checked on the CPU: the cross-entropy GPU tiers at
the one-GPU scale (the recipe's vocabulary slice, row tokens cut to a stated size, one start of
ranks), and each multi-GPU tier skipping at once, with the reason, where torch sees one GPU (a
monkeypatched device count)."""

import time

import pytest
import torch

from correctness.cross_entropy import lever as cross_entropy
from correctness.cross_entropy import paths as cross_entropy_paths
from correctness.composites.determinism import lever as determinism
from correctness.harness import run_case
from correctness.lever import LeverOptions
from correctness.models import facts_for
from correctness.recipe_sets import GEMMA, NEMOTRON
from correctness.recipes import lever_recipe
from correctness.grad_reduction import lever as reduction


@pytest.mark.parametrize("recipe_id", [GEMMA, NEMOTRON])
def test_the_cross_entropy_gpu_tier_runs_the_recipes_vocabulary_slice_at_a_stated_one_gpu_scale(recipe_id):
    recipe = lever_recipe(recipe_id)
    slice_ = int(facts_for(recipe, None).field("vocab_size")) // recipe.tp
    (lever,) = cross_entropy.megatron_gpu_tier(recipe_id, LeverOptions())
    shapes = [case.shape for case in lever.cases]
    assert {shape.scale for shape in shapes} == {"one-gpu"}
    assert {shape.vocab_slice for shape in shapes} == {slice_}
    assert {shape.batch for shape in shapes} == {recipe.rows_per_microbatch}
    for shape in shapes:
        logits = shape.seq_len * shape.batch * shape.vocab
        assert logits <= cross_entropy.ONE_GPU_LOGITS and shape.seq_len % cross_entropy.ROW_TOKEN_STEP == 0
        assert shape.seq_len <= recipe.row_tokens and f"-{shape.seq_len}x{shape.batch}-" in shape.id  # stated
    assert cross_entropy.GPU_TIMEOUT <= 300


def test_gemmas_one_gpu_cases_are_an_eighth_of_its_recipe_scale():
    recipe = lever_recipe(GEMMA)
    model = facts_for(recipe, None)
    at_recipe = cross_entropy.cross_entropy_shape(recipe, model, "recipe", 2, 0.0)
    one_gpu = cross_entropy.cross_entropy_shape(recipe, model, "one-gpu", 2, 0.0)
    assert at_recipe.seq_len * at_recipe.vocab * 2 > 4e9  # 4.3 GB of BF16 logits, pickled to each rank
    assert (one_gpu.seq_len, one_gpu.vocab) == (at_recipe.seq_len // 8, at_recipe.vocab)


@pytest.mark.parametrize("tier", [cross_entropy.megatron_gpu_tier, cross_entropy.recipe_gpu_tier], ids=["megatron", "te"])
def test_the_cross_entropy_gpu_cases_share_one_start_of_ranks(monkeypatch, tier):
    made = []

    class Counted(cross_entropy_paths.RankSession):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(cross_entropy, "RankSession", Counted)  # where the lever looks it up
    monkeypatch.setattr(cross_entropy, "_runs_impl", lambda recipe, impl: None)  # each tier, whatever the recipe fuses
    (lever,) = tier(GEMMA, LeverOptions())
    assert len(made) == 1 and (made[0].device, made[0].timeout) == ("cuda", cross_entropy.GPU_TIMEOUT)
    assert len(lever.cases) == 4 and {case.shape.scale for case in lever.cases} == {"one-gpu"}


@pytest.fixture
def one_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


@pytest.mark.parametrize("tier", [determinism.gpu_tier, reduction.gpu_tier], ids=["deterministic-mode", "reduction"])
def test_each_multi_gpu_tier_skips_at_once_on_one_gpu_with_the_reason(one_gpu, tier):
    (lever,) = [lever for lever in tier(GEMMA, LeverOptions()) if "nccl" in lever.candidate.name.lower()
                or lever.name == reduction.NAME]
    started = time.perf_counter()
    results = [run_case(lever, case) for case in lever.cases]
    assert time.perf_counter() - started < 1.0
    assert {result.status for result in results} == {"skip"}
    assert all("an NCCL rank needs a GPU of its own and this machine has 1" in result.skip_reason for result in results)
