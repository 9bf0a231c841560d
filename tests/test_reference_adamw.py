"""Tests of the FP64 AdamW, clipping and learning-rate reference (references/adamw.py).

The independent checks are torch.optim.AdamW in FP64 (single-tensor path, lr set per step),
steps worked by hand on 2-3 element tensors, and the recipe's schedule values in closed form.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from references.adamw import (
    AdamWHyperparameters,
    adamw_run,
    adamw_step,
    clip_coefficient,
    global_norm,
    lr_at,
    weight_decay_multiplier,
)


TORCH_AGREEMENT = 1e-14
"""Largest relative L2 error ||reference - torch|| / ||torch|| after several FP64 steps
(torch.optim.AdamW orders the same arithmetic differently: lerp for m, p (1 - lr wd))."""

HAND_EXACT = 1e-15
"""Relative tolerance for steps worked by hand: a few FP64 roundings of the same formula."""

MAX_EXAMPLES = 100
"""Hypothesis examples per property test; keeps the file to a few seconds."""

RECIPE = dict(max_lr=1e-5, min_lr=1e-6, warmup_fraction=0.1, iterations=20, global_batch=128)
"""The recipes' schedule: lr 1e-5 to 1e-6, warmup 0.1, 20 iterations of 128 samples."""

RECIPE_HYPER = AdamWHyperparameters(lr=1e-5, beta1=0.9, beta2=0.98, eps=1e-8, weight_decay=0.1)


def hyper(**overrides):
    return AdamWHyperparameters(**{**vars(RECIPE_HYPER), **overrides})


def relative_error(actual, expected):
    return ((actual - expected).norm() / expected.norm()).item()


# ---------------------------------------------------------------------------
# Against torch.optim.AdamW in FP64.


def torch_adamw(param0, grads, lrs, *, beta1, beta2, eps, weight_decay):
    """param, exp_avg, exp_avg_sq after len(grads) torch.optim.AdamW steps with lr lrs[k] at step k."""
    param = torch.nn.Parameter(param0.clone())
    optimizer = torch.optim.AdamW(
        [param], lr=lrs[0], betas=(beta1, beta2), eps=eps, weight_decay=weight_decay, foreach=False, fused=False
    )
    for grad, lr in zip(grads, lrs):
        optimizer.param_groups[0]["lr"] = lr
        param.grad = grad.clone()
        optimizer.step()
    state = optimizer.state[param]
    return param.detach(), state["exp_avg"], state["exp_avg_sq"]


def random_problem(seed, steps=6, shape=(7, 5)):
    """Parameters of the same order as the updates, so the update itself is compared closely."""
    generator = torch.Generator().manual_seed(seed)
    param0 = 1e-2 * torch.randn(shape, generator=generator, dtype=torch.float64)
    grads = [torch.randn(shape, generator=generator, dtype=torch.float64) for _ in range(steps)]
    lrs = [1e-3 * (1 + k) for k in range(steps)]  # varying per step
    return param0, grads, lrs


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adamw_step_matches_torch(weight_decay):
    param0, grads, lrs = random_problem(0)
    expected = torch_adamw(param0, grads, lrs, beta1=0.9, beta2=0.98, eps=1e-8, weight_decay=weight_decay)

    p, m, v = param0, torch.zeros_like(param0), torch.zeros_like(param0)
    for step, (grad, lr) in enumerate(zip(grads, lrs), start=1):
        p, m, v = adamw_step(p, grad, m, v, step=step, hyper=hyper(lr=lr, weight_decay=weight_decay))

    for actual, wanted in zip((p, m, v), expected):
        assert actual.dtype == torch.float64
        assert relative_error(actual, wanted) <= TORCH_AGREEMENT
    assert relative_error(p - param0, expected[0] - param0) <= TORCH_AGREEMENT


def test_adamw_run_matches_torch_with_clipping():
    param0, grads, lrs = random_problem(1)
    coefficients = [1.0, 0.5, 0.25, 1.0, 0.8, 0.125]
    clipped = [grad * c for grad, c in zip(grads, coefficients)]
    master, exp_avg, exp_avg_sq = torch_adamw(
        param0, clipped, lrs, beta1=0.9, beta2=0.98, eps=1e-8, weight_decay=0.1
    )

    result = adamw_run(param0, grads, hypers=[hyper(lr=lr) for lr in lrs], clip_coefficients=coefficients)

    assert set(result) == {"master", "update", "exp_avg", "exp_avg_sq"}
    assert relative_error(result["master"], master) <= TORCH_AGREEMENT
    assert relative_error(result["update"], master - param0) <= TORCH_AGREEMENT
    assert relative_error(result["exp_avg"], exp_avg) <= TORCH_AGREEMENT
    assert relative_error(result["exp_avg_sq"], exp_avg_sq) <= TORCH_AGREEMENT


def test_adamw_run_upcasts_and_leaves_inputs_alone():
    param0 = torch.tensor([[0.5, -1.0], [2.0, 0.25]], dtype=torch.bfloat16)
    grads = [torch.tensor([[0.1, 0.2], [-0.3, 0.4]], dtype=torch.float32)] * 2
    before = param0.clone()
    result = adamw_run(param0, grads, hypers=[hyper(lr=1e-2)] * 2, clip_coefficients=[1.0, 1.0])
    assert all(t.dtype == torch.float64 for t in result.values())
    assert torch.equal(param0, before)
    expected = adamw_run(param0.double(), [g.double() for g in grads], hypers=[hyper(lr=1e-2)] * 2,
                         clip_coefficients=[1.0, 1.0])
    assert all(torch.equal(result[key], expected[key]) for key in result)


def test_adamw_run_first_step_sets_the_bias_correction():
    param0, grads, lrs = random_problem(2, steps=3)
    hypers = [hyper(lr=lr) for lr in lrs]
    result = adamw_run(param0, grads, hypers=hypers, clip_coefficients=[1.0] * 3, first_step=5)
    p, m, v = param0, torch.zeros_like(param0), torch.zeros_like(param0)
    for k in range(3):
        p, m, v = adamw_step(p, grads[k], m, v, step=5 + k, hyper=hypers[k])
    assert torch.equal(result["master"], p)
    default = adamw_run(param0, grads, hypers=hypers, clip_coefficients=[1.0] * 3)
    assert not torch.equal(default["master"], p)


def test_adamw_run_validates_lengths_and_coefficients():
    param0, grads, lrs = random_problem(3, steps=2)
    with pytest.raises(ValueError, match="one entry per step"):
        adamw_run(param0, grads, hypers=[hyper()], clip_coefficients=[1.0, 1.0])
    with pytest.raises(ValueError, match="clip_coefficients"):
        adamw_run(param0, grads, hypers=[hyper()] * 2, clip_coefficients=[1.0, math.nan])
    with pytest.raises(ValueError, match="grad"):
        adamw_run(param0, [grads[0], grads[1][:2]], hypers=[hyper()] * 2, clip_coefficients=[1.0, 1.0])
    with pytest.raises(ValueError, match="step"):
        adamw_step(param0, grads[0], param0, param0, step=0, hyper=hyper())


# ---------------------------------------------------------------------------
# Steps worked by hand.


def f64(values):
    return torch.tensor(values, dtype=torch.float64)


def assert_exact(actual, expected):
    expected = f64(expected)
    assert torch.allclose(actual, expected, rtol=HAND_EXACT, atol=0.0), (actual.tolist(), expected.tolist())


def test_first_step_with_bias_correction_and_weight_decay_by_hand():
    # Step 1: m = (1 - b1) g and 1 - b1^1 = 1 - b1, so m_hat = g; likewise v_hat = g^2.
    # The Adam direction is g / (|g| + eps): the sign of g, shrunk by eps; 0 where g is 0.
    lr, wd, eps = 0.01, 0.1, 1e-8
    p0, g = [1.0, -2.0, 0.5], [0.5, -0.25, 0.0]
    p, m, v = adamw_step(
        f64(p0), f64(g), f64([0.0] * 3), f64([0.0] * 3),
        step=1, hyper=hyper(lr=lr, eps=eps, weight_decay=wd),
    )
    assert_exact(m, [0.1 * 0.5, 0.1 * -0.25, 0.0])
    assert_exact(v, [0.02 * 0.25, 0.02 * 0.0625, 0.0])
    assert_exact(p, [
        1.0 - lr * (0.5 / (0.5 + eps) + wd * 1.0),      # 1 - 0.01 (0.99999998 + 0.1) = 0.9890000002
        -2.0 - lr * (-0.25 / (0.25 + eps) + wd * -2.0),  # -2 + 0.01 (0.99999996 + 0.2) = -1.9880000004
        0.5 - lr * (0.0 + wd * 0.5),                   # no gradient: decay alone, 0.5 - 0.0005
    ])
    assert p[2].item() == 0.4995


def test_second_step_with_bias_correction_by_hand():
    # g = +1 then -1 (b1 = 0.9, b2 = 0.98, no decay):
    #   m_2 = 0.9 * 0.1 - 0.1 = -0.01,  1 - 0.9^2 = 0.19,  m_hat = -1/19
    #   v_2 = 0.98 * 0.02 + 0.02 = 0.0396,  1 - 0.98^2 = 0.0396,  v_hat = 1
    # A constant gradient g gives m_hat = g and v_hat = g^2 at every step:
    #   g = 2, 2: m_2 = 0.9 * 0.2 + 0.2 = 0.38 = 0.19 * 2,  v_2 = 0.0396 * 4.
    lr, eps = 0.1, 1e-8
    h = hyper(lr=lr, eps=eps, weight_decay=0.0)
    p, m, v = adamw_step(f64([0.0, 3.0]), f64([1.0, 2.0]), f64([0.0] * 2), f64([0.0] * 2),
                         step=1, hyper=h)
    p, m, v = adamw_step(p, f64([-1.0, 2.0]), m, v, step=2, hyper=h)
    assert_exact(m, [-0.01, 0.38])
    assert_exact(v, [0.0396, 0.0396 * 4])
    step1 = [-lr * 1 / (1 + eps), 3.0 - lr * 2 / (2 + eps)]
    assert_exact(p, [step1[0] - lr * (-1 / 19) / (1 + eps), step1[1] - lr * 2 / (2 + eps)])


def test_first_step_without_bias_correction_by_hand():
    # m = 0.1 g, v = 0.02 g^2, so the direction is 0.1 g / (sqrt(0.02) |g| + eps),
    # about sqrt(0.5) = 0.7071 times the sign of g (with bias correction it would be about 1).
    lr, eps = 0.01, 1e-8
    g = [2.0, -0.5]
    p, m, v = adamw_step(f64([0.0] * 2), f64(g), f64([0.0] * 2), f64([0.0] * 2),
                         step=1, hyper=hyper(lr=lr, eps=eps, weight_decay=0.0), bias_correction=False)
    assert_exact(p, [
        -lr * 0.1 * 2.0 / (math.sqrt(0.02 * 4.0) + eps),
        -lr * 0.1 * -0.5 / (math.sqrt(0.02 * 0.25) + eps),
    ])
    # eps shrinks it by eps / (sqrt(0.02) |g|): 3.5e-8 for g = 2, 1.4e-7 for g = -0.5.
    assert p[0].item() == pytest.approx(-lr * math.sqrt(0.5), rel=1e-7)
    assert p[1].item() == pytest.approx(lr * math.sqrt(0.5), rel=3e-7)


def test_lr_zero_changes_only_the_moments():
    # Iteration 1 of the schedule runs at lr 0: the parameter is unchanged, even with decay.
    p0 = f64([1.0, -2.0])
    p, m, v = adamw_step(p0, f64([0.3, 0.4]), f64([0.0] * 2), f64([0.0] * 2), step=1, hyper=hyper(lr=0.0))
    assert torch.equal(p, p0)
    assert_exact(m, [0.1 * 0.3, 0.1 * 0.4])


# ---------------------------------------------------------------------------
# Learning-rate schedule.


def test_recipe_schedule_values():
    lrs = [lr_at(k, **RECIPE) for k in range(1, 21)]
    # D = 2560 samples, W = 256: iterations 1-3 are warmup at s = 0, 128, 256.
    assert lrs[0] == 0.0
    assert lrs[1] == 5e-6
    assert lrs[2] == 1e-5
    # Iteration 4: s = 384, r = 128 / 2304 = 1/18, lr = 1e-6 + 0.5 (1 + cos(10 degrees)) 9e-6.
    assert lrs[3] == pytest.approx(1e-6 + 0.5 * (1 + math.cos(math.pi / 18)) * 9e-6, rel=HAND_EXACT)
    assert lrs[3] == pytest.approx(9.931634888554937e-06, rel=HAND_EXACT)
    # Iteration 12: s = 1408, r = 1152 / 2304 = 1/2, the midpoint 5.5e-6.
    assert lrs[11] == pytest.approx(5.5e-6, rel=HAND_EXACT)
    # Iteration 20: s = 2432, r = 17/18: still above min_lr (the schedule reaches it only at s = D).
    assert lrs[19] == pytest.approx(1e-6 + 0.5 * (1 + math.cos(17 * math.pi / 18)) * 9e-6, rel=HAND_EXACT)
    assert lrs[19] > RECIPE["min_lr"]


def test_no_warmup_starts_at_max_lr():
    assert lr_at(1, **{**RECIPE, "warmup_fraction": 0.0}) == RECIPE["max_lr"]


@settings(max_examples=MAX_EXAMPLES, deadline=None)
@given(
    max_lr=st.floats(1e-8, 1.0),
    min_fraction=st.floats(0.0, 1.0),
    warmup_fraction=st.floats(0.0, 1.0),
    iterations=st.integers(1, 60),
    global_batch=st.integers(1, 512),
)
def test_schedule_warms_up_then_decays(max_lr, min_fraction, warmup_fraction, iterations, global_batch):
    min_lr = min_fraction * max_lr
    args = dict(max_lr=max_lr, min_lr=min_lr, warmup_fraction=warmup_fraction,
                iterations=iterations, global_batch=global_batch)
    lrs = [lr_at(k, **args) for k in range(1, iterations + 1)]
    warmup = warmup_fraction * iterations * global_batch
    in_warmup = [(k - 1) * global_batch <= warmup for k in range(1, iterations + 1)]
    rising = [lr for lr, w in zip(lrs, in_warmup) if w]
    falling = [lr for lr, w in zip(lrs, in_warmup) if not w]
    assert in_warmup == sorted(in_warmup, reverse=True)  # a warmup prefix, then the decay
    assert rising == sorted(rising)
    assert falling == sorted(falling, reverse=True)
    assert all(0.0 <= lr <= max_lr for lr in rising)
    assert all(min_lr <= lr <= max_lr * (1 + 1e-15) for lr in falling)
    if warmup > 0:
        assert lrs[0] == 0.0


@pytest.mark.parametrize(
    "overrides, name",
    [
        ({"iteration": 0}, "iteration"),
        ({"iteration": 21}, "iteration"),
        ({"iterations": 0}, "iterations"),
        ({"global_batch": 0}, "global_batch"),
        ({"warmup_fraction": 1.5}, "warmup_fraction"),
        ({"warmup_fraction": -0.1}, "warmup_fraction"),
        ({"warmup_fraction": math.nan}, "warmup_fraction"),
        ({"min_lr": 2e-5}, "min_lr"),
        ({"min_lr": -1e-6}, "min_lr"),
        ({"max_lr": math.inf}, "max_lr"),
    ],
)
def test_schedule_validation(overrides, name):
    args = {"iteration": 1, **RECIPE, **overrides}
    iteration = args.pop("iteration")
    with pytest.raises(ValueError, match=name) as error:
        lr_at(iteration, **args)
    assert "\n" not in str(error.value)


# ---------------------------------------------------------------------------
# Clipping and the global norm.


def test_clip_coefficient_below_at_and_above_the_max():
    assert clip_coefficient(0.5, 1.0) == 1.0
    assert clip_coefficient(0.0, 1.0) == 1.0
    # At the max Megatron still scales, by 1 / (1 + 1e-6).
    assert clip_coefficient(1.0, 1.0) == 1.0 / (1.0 + 1e-6)
    assert clip_coefficient(4.0, 1.0) == 1.0 / (4.0 + 1e-6)


@pytest.mark.parametrize("norm", [1.0 + 1e-9, 1.5, 3.0, 1e3, 1e8])
def test_clipped_norm_equals_max_norm(norm):
    max_norm = 1.0
    coefficient = clip_coefficient(norm, max_norm)
    assert coefficient < 1.0
    assert coefficient * norm == pytest.approx(max_norm, rel=1e-6)


@pytest.mark.parametrize("norm", [math.nan, math.inf, -math.inf, -1.0])
def test_clip_coefficient_rejects_bad_norms(norm):
    with pytest.raises(ValueError, match="total_norm"):
        clip_coefficient(norm, 1.0)


def test_clip_coefficient_rejects_bad_max_norm():
    with pytest.raises(ValueError, match="max_norm"):
        clip_coefficient(1.0, 0.0)


def test_global_norm():
    grads = [torch.tensor([3.0], dtype=torch.bfloat16), torch.tensor([[4.0, 12.0]], dtype=torch.float32)]
    assert global_norm(grads) == 13.0
    assert global_norm([]) == 0.0
    big = [torch.full((1000,), 1e-3, dtype=torch.float64)] * 4
    assert global_norm(big) == pytest.approx(math.sqrt(4000) * 1e-3, rel=1e-15)
    with pytest.raises(ValueError, match="total_norm"):
        clip_coefficient(global_norm([torch.tensor([1.0, math.nan])]), 1.0)


# ---------------------------------------------------------------------------
# FP32-rounded hyperparameters (TE FusedAdam's C float arguments).


def test_rounded_to_fp32_values_and_idempotence():
    rounded = RECIPE_HYPER.rounded_to_fp32()
    assert rounded.beta1 == 0.8999999761581421
    assert rounded.beta2 == 0.9800000190734863
    assert rounded.rounded_to_fp32() == rounded
    for name, value in vars(rounded).items():
        assert torch.tensor(value, dtype=torch.float32).item() == value, name
    assert AdamWHyperparameters(lr=0.5, beta1=0.5, beta2=0.75, eps=0.0, weight_decay=0.0).rounded_to_fp32() == (
        AdamWHyperparameters(lr=0.5, beta1=0.5, beta2=0.75, eps=0.0, weight_decay=0.0)
    )


def test_fp32_hyperparameters_shift_exp_avg_by_a_known_amount():
    # (1 - b1) moves from 0.1 to 0.10000002384..., a relative shift of about 2.4e-7 in m
    # (2.1e-7 here): far above FP64 rounding (1e-16) and of the order of FP32 rounding itself,
    # so TE FusedAdam must be compared with a reference run on the same rounded values.
    param0, grads, lrs = random_problem(4, steps=3)
    hypers = [hyper(lr=lr) for lr in lrs]
    exact = adamw_run(param0, grads, hypers=hypers, clip_coefficients=[1.0] * 3)
    rounded = adamw_run(param0, grads, hypers=[h.rounded_to_fp32() for h in hypers], clip_coefficients=[1.0] * 3)
    shift = relative_error(rounded["exp_avg"], exact["exp_avg"])
    assert 1e-9 < shift < 1e-6


def test_hyperparameter_validation():
    with pytest.raises(ValueError, match="beta1"):
        hyper(beta1=1.0)
    with pytest.raises(ValueError, match="lr"):
        hyper(lr=math.nan)
    with pytest.raises(ValueError, match="weight_decay"):
        hyper(weight_decay=-0.1)


# ---------------------------------------------------------------------------
# Weight-decay multiplier.


def test_weight_decay_multiplier():
    assert weight_decay_multiplier((4096, 1024)) == 1.0
    assert weight_decay_multiplier(torch.empty(8, 3, 3)) == 1.0
    assert weight_decay_multiplier((4096,)) == 0.0  # norm gains
    assert weight_decay_multiplier(torch.empty(16)) == 0.0
    assert weight_decay_multiplier(torch.Size([32, 4]), is_bias=True) == 0.0
    assert weight_decay_multiplier(()) == 1.0  # Megatron tests len(shape) == 1 exactly
