"""The optimizer settings a recipe trains with, read from its training arguments.

Megatron's defaults apply where the recipe does not set a flag (megatron/training/arguments.py and
megatron-core's OptimizerConfig: betas 0.9 / 0.999, eps 1e-8, clip 1.0, weight decay 0.01, the
offload fraction 1.0, `--overlap-cpu-optimizer-d2h-h2d` off). The run's length is miles'
`--num-rollout` (one optimizer step per rollout in these SFT recipes) or Megatron's `--train-iters`.
"""

import math
from dataclasses import dataclass

from correctness.errors import RecipeError
from correctness.recipes import Recipe
from references.adamw import AdamWHyperparameters, lr_at

MEGATRON_DEFAULTS = {
    "--adam-eps": 1e-8,
    "--clip-grad": 1.0,
    "--adam-beta1": 0.9,
    "--adam-beta2": 0.999,
    "--weight-decay": 0.01,
    "--optimizer-offload-fraction": 1.0,
}


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    max_lr: float
    min_lr: float
    warmup_fraction: float
    iterations: int
    global_batch: int
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    clip_grad: float
    offload_fraction: float  # the recipe's CPU share of the optimizer state (0.0 without --optimizer-cpu-offload)
    # `--overlap-cpu-optimizer-d2h-h2d`: Megatron's HybridDeviceOptimizer then builds one CPU
    # optimizer per parameter and copies on side streams, another code path than without it.
    overlap_cpu_optimizer_d2h_h2d: bool

    def lr(self, iteration: int) -> float:
        return lr_at(
            iteration,
            max_lr=self.max_lr,
            min_lr=self.min_lr,
            warmup_fraction=self.warmup_fraction,
            iterations=self.iterations,
            global_batch=self.global_batch,
        )

    def hyperparameters(self, iteration: int, weight_decay_multiplier: float) -> AdamWHyperparameters:
        return AdamWHyperparameters(
            lr=self.lr(iteration),
            beta1=self.beta1,
            beta2=self.beta2,
            eps=self.eps,
            weight_decay=self.weight_decay * weight_decay_multiplier,
        )


def _number(recipe: Recipe, flag: str, default: float | None = None) -> float:
    values = recipe.argument(flag)
    if values is None:
        if default is None:
            raise RecipeError(f"recipe {recipe.id}: training argument {flag} is missing")
        return default
    try:
        value = float(values[0]) if len(values) == 1 else math.nan
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise RecipeError(f"recipe {recipe.id}: training argument {flag} must be one number, got {values}")
    return value


def _switch(recipe: Recipe, flag: str) -> bool:
    """A store_true flag: on where the run passes it, without a value."""
    values = recipe.argument(flag)
    if values:
        raise RecipeError(f"recipe {recipe.id}: training argument {flag} is a switch, got values {values}")
    return values is not None


def optimizer_config(recipe: Recipe) -> OptimizerConfig:
    optimizer = recipe.argument("--optimizer")
    if optimizer is not None and optimizer != ["adam"]:
        raise RecipeError(f"recipe {recipe.id}: --optimizer {' '.join(optimizer)} is not adam")
    decay = recipe.argument("--lr-decay-style")
    if decay is not None and decay != ["cosine"]:
        raise RecipeError(f"recipe {recipe.id}: --lr-decay-style {' '.join(decay)} is not modelled (cosine is)")
    length_flag = "--num-rollout" if recipe.argument("--num-rollout") is not None else "--train-iters"
    offloaded = recipe.argument("--optimizer-cpu-offload") is not None
    config = OptimizerConfig(
        max_lr=_number(recipe, "--lr"),
        min_lr=_number(recipe, "--min-lr", 0.0),
        warmup_fraction=_number(recipe, "--lr-warmup-fraction", 0.0),
        iterations=int(_number(recipe, length_flag)),
        global_batch=int(_number(recipe, "--global-batch-size")),
        beta1=_number(recipe, "--adam-beta1", MEGATRON_DEFAULTS["--adam-beta1"]),
        beta2=_number(recipe, "--adam-beta2", MEGATRON_DEFAULTS["--adam-beta2"]),
        eps=_number(recipe, "--adam-eps", MEGATRON_DEFAULTS["--adam-eps"]),
        weight_decay=_number(recipe, "--weight-decay", MEGATRON_DEFAULTS["--weight-decay"]),
        clip_grad=_number(recipe, "--clip-grad", MEGATRON_DEFAULTS["--clip-grad"]),
        offload_fraction=(
            _number(recipe, "--optimizer-offload-fraction", MEGATRON_DEFAULTS["--optimizer-offload-fraction"])
            if offloaded else 0.0
        ),
        overlap_cpu_optimizer_d2h_h2d=_switch(recipe, "--overlap-cpu-optimizer-d2h-h2d"),
    )
    if not 0.0 <= config.offload_fraction <= 1.0:
        raise RecipeError(
            f"recipe {recipe.id}: --optimizer-offload-fraction {config.offload_fraction} is outside [0, 1]"
        )
    return config
