"""FP64 reference for Megatron's AdamW step, gradient clipping and learning-rate schedule.

AdamW with decoupled weight decay, step t = 1, 2, ... from zero moments m_0 = v_0 = 0:

    m_t     = b1 m_{t-1} + (1 - b1) g_t
    v_t     = b2 v_{t-1} + (1 - b2) g_t^2
    m_hat_t = m_t / (1 - b1^t)                  (bias correction; skipped when switched off)
    v_hat_t = v_t / (1 - b2^t)
    p_t     = p_{t-1} - lr_t (m_hat_t / (sqrt(v_hat_t) + eps) + wd p_{t-1})

torch.optim.AdamW computes the same rule as p (1 - lr wd) - lr m_hat / (sqrt(v_hat) + eps).

Weight decay per parameter is wd x weight_decay_multiplier(param, is_bias): Megatron gives
multiplier 0 to biases and to parameters of exactly one dimension (norm gains), 1 to the rest.

Gradient clipping: one global L2 norm N over every gradient, coefficient
c = min(1, max_norm / (N + 1e-6)), each gradient multiplied by c before the step.

Learning rate (Megatron's OptimizerParamScheduler, counted in samples): D = iterations x B,
W = warmup_fraction x D.  Iteration k (1-based) runs at the rate of s = (k - 1) B samples:

    s <= W:  lr = max_lr s / W                                     (max_lr when W = 0)
    s >  W:  r = (s - W) / (D - W),  lr = min_lr + (1 + cos(pi r)) / 2 (max_lr - min_lr)

so iteration 1 runs at lr 0 whenever there is warmup (it changes only the moments).
"""

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields

import torch

CLIP_EPSILON = 1e-6
"""Added to the global norm before dividing, as Megatron does."""


def lr_at(
    iteration: int, *, max_lr: float, min_lr: float, warmup_fraction: float, iterations: int, global_batch: int
) -> float:
    """Learning rate of iteration `iteration` (1-based) under linear warmup then cosine decay.

    See the module docstring for the formula.  Arguments are checked: 1 <= iteration <=
    iterations, global_batch >= 1, 0 <= warmup_fraction <= 1, 0 <= min_lr <= max_lr.
    """
    for name, value in (("iterations", iterations), ("global_batch", global_batch), ("iteration", iteration)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if iteration > iterations:
        raise ValueError(f"iteration must be in 1..iterations = 1..{iterations}, got {iteration}")
    if not (_real(warmup_fraction) and 0.0 <= warmup_fraction <= 1.0):
        raise ValueError(f"warmup_fraction must be in [0, 1], got {warmup_fraction!r}")
    if not (_real(min_lr) and _real(max_lr) and 0.0 <= min_lr <= max_lr):
        raise ValueError(f"min_lr and max_lr must satisfy 0 <= min_lr <= max_lr, got {min_lr!r} and {max_lr!r}")

    total = iterations * global_batch  # D
    warmup = warmup_fraction * total  # W
    samples = (iteration - 1) * global_batch  # s
    if samples <= warmup:
        return max_lr * samples / warmup if warmup > 0 else float(max_lr)
    ratio = (samples - warmup) / (total - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (max_lr - min_lr)


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """min(1, max_norm / (total_norm + 1e-6)): the factor Megatron applies to every gradient.

    Note that a norm exactly at max_norm is still scaled, by max_norm / (max_norm + 1e-6).
    A NaN or infinite total_norm raises ValueError: it must never pass silently.
    """
    if not _real(total_norm) or total_norm < 0:
        raise ValueError(f"total_norm must be finite and >= 0, got {total_norm!r}")
    if not _real(max_norm) or max_norm <= 0:
        raise ValueError(f"max_norm must be finite and > 0, got {max_norm!r}")
    return min(1.0, max_norm / (total_norm + CLIP_EPSILON))


def global_norm(grads: Iterable[torch.Tensor]) -> float:
    """sqrt(sum over all tensors and elements of g^2), computed in FP64 (0.0 for no tensors)."""
    total = 0.0
    for grad in grads:
        total += grad.to(torch.float64).square().sum().item()
    return math.sqrt(total)


def weight_decay_multiplier(shape_or_tensor, is_bias: bool = False) -> float:
    """0.0 for biases and for parameters of exactly one dimension, 1.0 otherwise (Megatron's rule)."""
    shape = shape_or_tensor.shape if isinstance(shape_or_tensor, torch.Tensor) else tuple(shape_or_tensor)
    return 0.0 if is_bias or len(shape) == 1 else 1.0


@dataclass(frozen=True, kw_only=True)
class AdamWHyperparameters:
    """One step's hyperparameters; weight_decay already multiplied by the parameter's multiplier."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float

    def __post_init__(self):
        for field in fields(self):
            value = getattr(self, field.name)
            if not _real(value):
                raise ValueError(f"{field.name} must be a finite real number, got {value!r}")
        if self.lr < 0 or self.eps < 0 or self.weight_decay < 0:
            got = f"{self.lr}, {self.eps} and {self.weight_decay}"
            raise ValueError(f"lr, eps and weight_decay must be >= 0, got {got}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"beta1 and beta2 must be in [0, 1), got {self.beta1} and {self.beta2}")

    def rounded_to_fp32(self) -> "AdamWHyperparameters":
        """Each value rounded to the nearest FP32 and back (what TE FusedAdam's C float arguments do)."""
        return AdamWHyperparameters(**{field.name: _fp32(getattr(self, field.name)) for field in fields(self)})


def adamw_step(
    param, grad, exp_avg, exp_avg_sq, *, step: int, hyper: AdamWHyperparameters, bias_correction: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One AdamW step (module docstring) in FP64: returns new (param, exp_avg, exp_avg_sq).

    Inputs may have any floating dtype and are upcast to FP64; they are not modified.
    step is t >= 1 (used only by the bias correction).
    """
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ValueError(f"step must be an int >= 1, got {step!r}")
    p = _fp64("param", param)
    g = _fp64("grad", grad, p.shape)
    m = _fp64("exp_avg", exp_avg, p.shape)
    v = _fp64("exp_avg_sq", exp_avg_sq, p.shape)
    h = hyper
    m = h.beta1 * m + (1 - h.beta1) * g
    v = h.beta2 * v + (1 - h.beta2) * g * g
    m_hat, v_hat = m, v
    if bias_correction:
        m_hat = m / (1 - h.beta1**step)
        v_hat = v / (1 - h.beta2**step)
    p = p - h.lr * (m_hat / (v_hat.sqrt() + h.eps) + h.weight_decay * p)
    return p, m, v


def adamw_run(
    param0,
    grads: Sequence[torch.Tensor],
    *,
    hypers: Sequence[AdamWHyperparameters],
    clip_coefficients: Sequence[float],
    first_step: int = 1,
    bias_correction: bool = True,
    stored: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """len(grads) AdamW steps on one tensor from zero moments, in FP64.

    Step k (0-based) uses grads[k] x clip_coefficients[k], hypers[k] and t = first_step + k.
    Returns {"master": final param, "update": final - param0, "exp_avg", "exp_avg_sq"}.

    `stored(name, values)`, where given, is what an optimizer that keeps the state in a narrower
    format reads back after storing `values` (FP64 in, FP64 out; name "master", "exp_avg" or
    "exp_avg_sq"): it is applied to the master before the first step (the optimizer's copy of
    param0) and to each of the three after every step, so every step reads the stored state and the
    results are the stored values; "update" is still taken from param0. None: nothing is rounded.
    """
    if not (len(grads) == len(hypers) == len(clip_coefficients)):
        raise ValueError(
            f"grads, hypers and clip_coefficients must have one entry per step, "
            f"got {len(grads)}, {len(hypers)} and {len(clip_coefficients)}"
        )
    for coefficient in clip_coefficients:
        if not _real(coefficient) or coefficient < 0:
            raise ValueError(f"clip_coefficients must be finite and >= 0, got {coefficient!r}")
    p0 = _fp64("param0", param0)
    p, m, v = p0 if stored is None else stored("master", p0), torch.zeros_like(p0), torch.zeros_like(p0)
    for k, (grad, hyper, coefficient) in enumerate(zip(grads, hypers, clip_coefficients)):
        g = _fp64("grad", grad, p0.shape) * coefficient
        p, m, v = adamw_step(p, g, m, v, step=first_step + k, hyper=hyper, bias_correction=bias_correction)
        if stored is not None:
            p, m, v = stored("master", p), stored("exp_avg", m), stored("exp_avg_sq", v)
    return {"master": p, "update": p - p0, "exp_avg": m, "exp_avg_sq": v}


def _real(x) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _fp32(x: float) -> float:
    """x rounded to the nearest FP32 (ties to even), as a Python float."""
    return torch.tensor(x, dtype=torch.float64).to(torch.float32).item()


def _fp64(name, x, shape=None) -> torch.Tensor:
    """x upcast to FP64, after checking it is a floating-point tensor (of `shape` if given)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a floating-point torch.Tensor, got {got}")
    if shape is not None and x.shape != shape:
        raise ValueError(f"{name} must have the parameter's shape {tuple(shape)}, got {tuple(x.shape)}")
    return x.to(torch.float64)
