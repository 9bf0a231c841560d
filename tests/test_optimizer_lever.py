"""The optimizer-offload lever: recipe settings, gradients, paths, controls, summary."""

import math

import pytest
import torch

from correctness.adam.arithmetic import QUANTITIES, megatron_clip_coefficient
from correctness.adam.config import optimizer_config
from correctness.adam.inputs import (
    DEFAULT_PRECLIP_NORMS,
    UNIT_ELEMENTS,
    gradient_scales,
    optimizer_units,
    raw_gradient,
    row_blocks,
)
from correctness.adam.offload_setting import recipe_slices
from correctness.adam.reference import Fp64AdamW
from correctness.adam.synthetic_values import synthetic_slice
from correctness.errors import CaseInputError, RecipeError
from correctness.fixtures import recipe_path
from correctness.harness import run_case
from correctness.lever import LeverOptions
from correctness.models import load_model
from correctness.optimizer import lever as offload
from correctness.megatron.layout import SMOKE
from correctness.optimizer.megatron import AllUnits, MegatronHybrid, WholeInventory
from correctness.optimizer.paths import EagerAdamW, OffloadSplit, TorchAdamW
from correctness.recipes import load_recipe
from numerics import FP32_AGREEMENT
from references.adamw import clip_coefficient

GEMMA = "gemma-4-31b/h100/attune-tp2-pp4-split13"
# FP32 arithmetic against FP64 after three steps: rounding alone is far below this.


def gemma():
    recipe = load_recipe(recipe_path(GEMMA))
    return recipe, load_model(recipe.model)


def smoke_slices():
    recipe, model = gemma()
    return recipe_slices(recipe, model, SMOKE)


def units(slices=None, norms=DEFAULT_PRECLIP_NORMS):
    recipe, _ = gemma()
    return optimizer_units(
        slices or smoke_slices(), seed=0, preclip_norms=norms,
        weights=lambda param: synthetic_slice(param, 0), config=optimizer_config(recipe),
    )


def test_recipe_optimizer_settings():
    config = optimizer_config(gemma()[0])
    assert (config.max_lr, config.min_lr, config.warmup_fraction) == (1e-5, 1e-6, 0.1)
    assert (config.iterations, config.global_batch, config.weight_decay) == (20, 128, 0.1)
    assert (config.beta1, config.beta2, config.eps, config.clip_grad) == (0.9, 0.98, 1e-8, 1.0)
    assert config.offload_fraction == 0.8
    assert [config.lr(i) for i in (1, 2, 3)] == [0.0, 5e-6, 1e-5]


def broken_recipe(tmp_path, old, new):
    text = recipe_path(GEMMA).read_text().replace(old, new)
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    return load_recipe(path)


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("--optimizer-offload-fraction 0.8", "--optimizer-offload-fraction 1.5", "outside \\[0, 1\\]"),
        ("--lr 1e-5", "--lr fast", "--lr must be one number"),
        ("--lr-decay-style cosine", "--lr-decay-style linear", "not modelled"),
        ("--global-batch-size 128", "", "--global-batch-size is missing"),
    ],
)
def test_bad_optimizer_arguments_are_named(tmp_path, old, new, message):
    with pytest.raises(RecipeError, match=message):
        optimizer_config(broken_recipe(tmp_path, old, new))


def test_gradients_reach_the_given_preclip_norms():
    slices = smoke_slices()
    scales, norms = gradient_scales(slices, seed=0, preclip_norms=DEFAULT_PRECLIP_NORMS)
    for norm, target in zip(norms, DEFAULT_PRECLIP_NORMS):
        assert math.isclose(norm, target, rel_tol=1e-6)
    squares = [0.0] * len(norms)
    for unit in units(slices):
        for step, grad in enumerate(unit.grads):
            squares[step] += grad.double().square().sum().item()
    # Rounding the scaled gradients to FP32 moves the norm by about 1e-11 (see inputs.py).
    assert [math.sqrt(s) for s in squares] == pytest.approx(norms, rel=1e-9)


def test_default_norms_are_clipped_and_differ_between_steps():
    config = optimizer_config(gemma()[0])
    assert all(norm > config.clip_grad for norm in DEFAULT_PRECLIP_NORMS)
    assert len(set(DEFAULT_PRECLIP_NORMS)) == len(DEFAULT_PRECLIP_NORMS)


def test_bad_norms_and_nonfinite_gradients_are_refused():
    with pytest.raises(CaseInputError, match="finite and positive"):
        next(units(norms=(1.0, math.nan)))
    recipe, _ = gemma()
    broken = optimizer_units(
        smoke_slices(), seed=0, preclip_norms=(math.inf, 1.0),
        weights=lambda param: synthetic_slice(param, 0), config=optimizer_config(recipe),
    )
    with pytest.raises(CaseInputError):
        next(broken)


def test_units_cover_each_parameter_in_blocks_of_bounded_size():
    slices = smoke_slices()
    covered = {}
    for unit in units(slices):
        assert unit.weights.numel() <= max(UNIT_ELEMENTS, math.prod(unit.param.shape[1:]))
        covered.setdefault(unit.param.name, []).append(unit.rows)
    for param in slices:
        assert covered[param.name] == row_blocks(param)
        assert covered[param.name][0][0] == 0 and covered[param.name][-1][1] == param.shape[0]


def test_gradients_are_seeded():
    param = smoke_slices()[1]
    first = raw_gradient(param, (0, 4), step=0, seed=0)
    assert torch.equal(first, raw_gradient(param, (0, 4), step=0, seed=0))
    assert not torch.equal(first, raw_gradient(param, (0, 4), step=1, seed=0))
    assert not torch.equal(first, raw_gradient(param, (0, 4), step=0, seed=1))


def test_megatron_clip_coefficient_follows_the_fp32_norm():
    assert megatron_clip_coefficient(4.0, 1.0) == pytest.approx(clip_coefficient(4.0, 1.0), rel=1e-12)
    assert megatron_clip_coefficient(0.5, 1.0) > 1.0  # no clipping below the clip value


@pytest.mark.parametrize("path", [TorchAdamW(), EagerAdamW()], ids=lambda p: p.name)
def test_working_paths_agree_with_the_reference_in_fp32(path):
    unit = next(u for u in units() if u.param.weight_decay)
    reference = Fp64AdamW(fp32_hyperparameters=isinstance(path, EagerAdamW)).run(unit).tensors
    output = path.run(unit).tensors
    for name, expected in reference.items():
        if name.endswith((":master", ":exp_avg", ":exp_avg_sq")):
            error = (output[name].double() - expected).norm() / expected.norm()
            assert error < FP32_AGREEMENT, f"{path.name} {name}: {error:.2e}"


def test_eager_path_rounds_its_hyperparameters_as_te_fused_adam_does():
    """Against the exact FP64 run the FP32 betas show in the moments; against the rounded one they vanish."""
    unit = next(units())
    eager = EagerAdamW().run(unit).tensors
    name = f"{unit.param.name}:exp_avg_sq"
    exact, rounded = Fp64AdamW().run(unit).tensors[name], Fp64AdamW(True).run(unit).tensors[name]

    def error(reference):
        return ((eager[name].double() - reference).norm() / reference.norm()).item()

    assert error(exact) > 4 * error(rounded)


def test_control_variants_change_the_update_far_beyond_fp32_rounding():
    """At betas 0.9 / 0.98 the two bias corrections nearly cancel (sqrt(1 - b2^t) / (1 - b1^t) is
    1.05 at t = 2, 0.90 at t = 3), so dropping them moves the update by some percent: still
    thousands of times the FP32 error."""
    unit = next(u for u in units() if u.param.weight_decay)
    base = EagerAdamW().run(unit).tensors
    name = f"{unit.param.name}:update"
    for variant in (EagerAdamW(bias_correction=False), EagerAdamW(master=torch.bfloat16)):
        changed = variant.run(unit).tensors[name]
        assert ((changed - base[name]).norm() / base[name].norm()) > 1000 * FP32_AGREEMENT, variant


def test_the_split_routes_each_parameter_to_its_share():
    unit = next(units())
    cpu_side = OffloadSplit(fraction=0.5, shares={unit.param.name: "cpu"}, cpu=TorchAdamW(), device=EagerAdamW())
    gpu_side = OffloadSplit(fraction=0.5, shares={unit.param.name: "gpu"}, cpu=TorchAdamW(), device=EagerAdamW())
    assert cpu_side.run(unit).backend.startswith("cpu share: torch.optim.AdamW")
    assert gpu_side.run(unit).backend.startswith("gpu share: eager AdamW")


def test_cpu_tier_passes_with_every_control_failing():
    (lever,) = offload.cpu_tier(GEMMA, LeverOptions())
    case = next(c for c in lever.cases if c.source == "synthetic")
    result = run_case(lever, case)
    assert result.status == "pass", result.failures
    assert [c.fails_bound for c in result.controls] == [True, True, True]
    summary = result.summary
    assert summary["cpu"]["bitwise_identical_to_default"] is True
    assert summary["gpu"]["bitwise_identical_to_default"] is False
    assert summary["cpu"]["tensors"] + summary["gpu"]["tensors"] == len(smoke_slices())
    rounded = summary["gpu"]["against fp64-adamw (fp32 hyperparameters)"]["exp_avg_sq"]["error"]
    assert rounded < summary["gpu"]["quantities"]["exp_avg_sq"]["error"]


def test_checkpoint_case_skips_without_a_checkpoint():
    (lever,) = offload.cpu_tier(GEMMA, LeverOptions())
    (checkpoint,) = [c for c in lever.cases if c.source == "checkpoint"]
    assert "--model-checkpoint" in checkpoint.skip_reason


def test_all_units_joins_a_per_unit_path_over_the_whole_inventory():
    whole = WholeInventory(units=tuple(units()))
    joined = AllUnits(TorchAdamW()).run(whole).tensors
    for unit in whole.units[:3]:
        piece = TorchAdamW().run(unit).tensors
        for name, tensor in piece.items():
            assert torch.equal(joined[name][unit.rows[0] : unit.rows[1]], tensor)
    assert set(joined) == {f"{p.name}:{q}" for p in smoke_slices() for q in QUANTITIES}


def test_every_tier_is_the_same_lever_with_its_own_candidate():
    options = LeverOptions()
    tiers = {
        "cpu": offload.cpu_tier(GEMMA, options),
        "h100": offload.recipe_gpu_tier(GEMMA, options),
        "megatron": offload.megatron_tier(GEMMA, options),
        "megatron-cpu": offload.megatron_cpu_tier(GEMMA, options),
    }
    devices = {"cpu": "cpu", "h100": "cuda", "megatron": "cuda", "megatron-cpu": "cpu"}
    for tier, (lever,) in tiers.items():
        assert (lever.tier.name, lever.tier.device) == (tier, devices[tier])
        assert [control.name for control in lever.controls] == ["no bias correction", "BF16 masters", "no clipping"]
        assert lever.default.name == "torch-adamw-fused" and lever.reference.name == "fp64-adamw"
    for tier, device in (("megatron", "cuda"), ("megatron-cpu", "cpu")):
        (lever,) = tiers[tier]
        assert lever.candidate == MegatronHybrid(0.8, device=device)
        assert [c.implementation for c in lever.controls[:2]] == [
            MegatronHybrid(0.8, bias_correction=False, device=device),
            MegatronHybrid(0.8, fp32_masters=False, device=device),
        ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the tier may run")
def test_megatron_gpu_tier_skips_here_with_the_reason():
    (lever,) = offload.megatron_tier(GEMMA, LeverOptions())
    case = next(c for c in lever.cases if c.source == "synthetic")
    result = run_case(lever, case)
    assert result.status == "skip"
    assert any(word in result.skip_reason for word in ("megatron-core", "Transformer Engine", "CUDA"))


def test_weight_decay_defaults_to_megatrons(tmp_path):
    """Megatron's --weight-decay default is 0.01 (megatron/training/arguments.py; megatron-core's
    OptimizerConfig.weight_decay), not 0."""
    assert optimizer_config(broken_recipe(tmp_path, "--weight-decay 0.1 ", "")).weight_decay == 0.01


def test_overlap_switch_is_read_from_the_recipe(tmp_path):
    assert optimizer_config(gemma()[0]).overlap_cpu_optimizer_d2h_h2d is True
    absent = broken_recipe(tmp_path, "--overlap-cpu-optimizer-d2h-h2d", "")
    assert optimizer_config(absent).overlap_cpu_optimizer_d2h_h2d is False
    valued = broken_recipe(tmp_path, "--overlap-cpu-optimizer-d2h-h2d", "--overlap-cpu-optimizer-d2h-h2d yes")
    with pytest.raises(RecipeError, match="--overlap-cpu-optimizer-d2h-h2d is a switch"):
        optimizer_config(valued)


def test_offload_shape_records_the_overlap_setting():
    (lever,) = offload.cpu_tier(GEMMA, LeverOptions())
    assert all(case.shape.record()["overlap_cpu_optimizer_d2h_h2d"] is True for case in lever.cases)
