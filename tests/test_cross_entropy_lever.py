"""The cross-entropy-fusion lever: its FP64 reference against torch's own cross entropy, its CPU
tier end to end on a seed recipe (Megatron's functions on gloo ranks), and a rank that raises."""

import time
from dataclasses import replace

import pytest
import torch

from correctness import tiers
from correctness.cross_entropy import lever as cross_entropy
from correctness.cross_entropy import paths as cross_entropy_paths
from correctness.cross_entropy.ranks import FUSED, TE, Call, resolve
from correctness.harness import run_case
from correctness.lever import LeverOptions, NotApplicable
from correctness.recipes import lever_recipe
from references.vocab_parallel_cross_entropy import vocab_parallel_cross_entropy

GEMMA = "gemma-4-31b/h100/attune-tp2-pp4-split13"



@pytest.mark.parametrize("tp", [1, 2, 3])
@pytest.mark.parametrize("offset", [0.0, cross_entropy.LARGE_OFFSET])
def test_reference_matches_torch_cross_entropy_in_fp64(tp, offset):
    """The reference gathers the shards and equals torch.nn.functional.cross_entropy over the full
    vocabulary in FP64, loss and gradient (autograd, with the upstream gradient) alike."""
    generator = torch.Generator().manual_seed(tp)
    seq, batch, width = 37, 3, 50
    logits = (2.0 * torch.randn(seq, batch, tp * width, generator=generator) + offset).to(torch.bfloat16)
    labels = torch.randint(tp * width, (seq, batch), generator=generator)
    mask = (torch.rand(seq, batch, generator=generator) < 0.7).double()
    upstream = mask * torch.rand(seq, batch, generator=generator).double()
    loss, grads = vocab_parallel_cross_entropy(list(logits.split(width, dim=-1)), labels, upstream)

    full = logits.double().requires_grad_()
    expected = torch.nn.functional.cross_entropy(full.reshape(-1, tp * width), labels.reshape(-1), reduction="none")
    expected.backward(upstream.reshape(-1))
    assert [grad.shape[-1] for grad in grads] == [width] * tp
    assert loss.dtype == torch.float64 and all(grad.dtype == torch.float64 for grad in grads)
    torch.testing.assert_close(loss.reshape(-1), expected.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat(grads, dim=-1), full.grad, rtol=1e-12, atol=1e-12)


def test_reference_refuses_labels_outside_the_full_vocabulary():
    shards = [torch.zeros(4, 1, 8), torch.zeros(4, 1, 8)]
    with pytest.raises(ValueError, match="full vocabulary"):
        vocab_parallel_cross_entropy(shards, torch.full((4, 1), 16), torch.ones(4, 1))


def test_shapes_come_from_the_recipe_and_the_model():
    """Each rank's slice is the model's vocabulary over the recipe's TP at the recipe's scale; the
    smoke scale divides it and the row tokens down; TP 2 cases hold two slices."""
    lever = cross_entropy.cpu_tier(GEMMA, LeverOptions())[0]
    recipe = lever_recipe(GEMMA)
    from correctness.models import facts_for

    model = facts_for(recipe, None)
    at_scale = cross_entropy.cross_entropy_shape(recipe, model, "recipe", 2, 0.0)
    assert at_scale.vocab_slice == int(model.field("vocab_size")) // recipe.tp
    assert (at_scale.seq_len, at_scale.batch) == (recipe.row_tokens, recipe.rows_per_microbatch)
    assert {case.shape.tp for case in lever.cases} == set(cross_entropy.TP_SIZES)
    for case in lever.cases:
        assert case.shape.vocab == case.shape.tp * cross_entropy.SMOKE["vocab_slice"]
        assert case.shape.final_logit_softcap == model.data.get("final_logit_softcap")
    large = [case for case in lever.cases if case.variant == "large-logits"]
    assert large and all(case.shape.logit_offset > cross_entropy.FP32_EXP_OVERFLOW for case in large)
    assert lever.tier == tiers.MEGATRON_CPU


def test_the_native_tiers_do_not_stand_for_a_recipe_that_fuses_with_te():
    recipe = lever_recipe(GEMMA)
    assert cross_entropy.fusion_impl(recipe) is None  # not fused: every tier measures turning it on
    def with_flags(flags: str):
        run = recipe.data["run"].replace("train.py", f"train.py {flags}", 1)
        return replace(recipe, data={**recipe.data, "run": run})

    fused_te = with_flags("--cross-entropy-loss-fusion --cross-entropy-fusion-impl te")
    options = LeverOptions(recipe=fused_te)
    assert cross_entropy.fusion_impl(fused_te) == "te"
    with pytest.raises(NotApplicable, match="impl 'te'"):
        cross_entropy.cpu_tier(GEMMA, options)
    with pytest.raises(NotApplicable, match="impl 'te'"):
        cross_entropy.megatron_gpu_tier(GEMMA, options)
    (lever,) = cross_entropy.recipe_gpu_tier(GEMMA, options)
    assert lever.candidate is cross_entropy_paths.TE_PATH and "megatron" in lever.tier.markers
    assert cross_entropy.fusion_impl(with_flags("--cross-entropy-loss-fusion")) == "native"  # Megatron's default


@pytest.mark.megatron
def test_cpu_tier_end_to_end_on_a_seed_recipe():
    """Every case runs Megatron's fused and unfused functions on gloo ranks (one spawn for the
    lever); the controls fail on every case they apply to, the overflow control by its Inf and NaN;
    the candidate's verdict is its own; the FP32 probe shows the fused backward's BF16 gradient."""
    lever = cross_entropy.cpu_tier(GEMMA, LeverOptions())[0]
    started = time.perf_counter()
    results = [run_case(lever, case) for case in lever.cases]
    seconds = time.perf_counter() - started
    for case, result in zip(lever.cases, results):
        assert result.status in ("pass", "fail"), (case.id, result.failures)
        assert result.candidate is not None, (case.id, result.failures)
        own = [failure for failure in result.failures if failure.startswith("candidate")]
        assert result.status == ("fail" if own else "pass"), (case.id, result.failures)  # no other cause
        names = {tensor.tensor for tensor in result.candidate.tensors}
        assert names == {"loss", *(f"grad_logits_rank{rank}" for rank in range(case.shape.tp))}
        assert result.candidate.run.backend.startswith("megatron-fused-native")
        assert result.default.backend == "megatron-vocab-parallel"
        controls = {control.name: control for control in result.controls}
        labels = controls["labels off by one position"]
        assert labels.fails_bound and labels.power > 10, (case.id, labels.power)
        overflow = controls["max subtraction skipped"]
        if case.variant == "large-logits":
            assert overflow.fails_bound
            assert all(tensor.nonfinite and not tensor.passes for tensor in overflow.judgement.tensors)
        else:
            assert overflow.judgement is None and "overflow" in overflow.inapplicable_reason
        probe = result.summary["fp32_logits_probe"]
        assert probe["candidate_grad_is_bf16"] and not probe["default_grad_is_bf16"]
        assert probe["candidate_grad_error"] > 100 * probe["default_grad_error"]
    assert seconds < 120, f"the CPU tier took {seconds:.0f} s"


def raise_on_rank_one(logits, labels, tp_group):
    """A cross entropy that raises on TP rank 1 (its peer waits in the all-reduce that follows)."""
    if tp_group.rank() == 1:
        raise ValueError("rank one refuses")
    return resolve(FUSED)(logits, labels, tp_group)


@pytest.mark.megatron
def test_a_rank_that_raises_fails_the_case_in_one_line():
    raising = Call(f"{__name__}:raise_on_rank_one", takes_group=True)
    candidate = cross_entropy_paths.MegatronPath("raising", raising, "raising")
    lever = cross_entropy.cross_entropy_lever(
        lever_recipe(GEMMA), tier=tiers.MEGATRON_CPU, scale="smoke", options=LeverOptions(),
        candidate=candidate, shared_session=False,
    )
    case = next(case for case in lever.cases if case.shape.tp == 2)
    started = time.perf_counter()
    result = run_case(lever, case)
    assert time.perf_counter() - started < 120
    assert result.status == "fail"
    (failure,) = result.failures
    assert "\n" not in failure
    assert "rank 1 raised ValueError: rank one refuses" in failure, failure


@pytest.mark.megatron
def test_a_function_that_is_not_there_skips_the_case_with_the_reason():
    """TE's wrapper where Transformer Engine is missing (or gloo refuses its CUDA gather) refuses
    the case: it skips with the reason, it does not fail."""
    try:
        usable = callable(resolve(TE))
    except (ImportError, AttributeError):
        usable = False
    if usable:
        pytest.skip("Transformer Engine's cross entropy is usable here")
    lever = cross_entropy.cross_entropy_lever(
        lever_recipe(GEMMA), tier=tiers.MEGATRON_CPU, scale="smoke", options=LeverOptions(),
        candidate=cross_entropy_paths.TE_PATH, shared_session=False,
    )
    case = next(case for case in lever.cases if case.shape.tp == 1)
    result = run_case(lever, case)
    assert result.status == "skip", result.failures
    assert "te_parallel_cross_entropy is not available here" in result.skip_reason
