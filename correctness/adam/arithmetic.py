"""AdamW's arithmetic as the Adam levers' paths share it: Megatron's global-norm clip, the named
outputs of a unit's steps, and one step as TE FusedAdam's kernel computes it in FP32.

The clip: coefficient clip / (norm + 1e-6) in double from the FP32 norm, applied in FP32 only when
below 1. Outputs, per parameter `name`: `name:master` (FP32 master after the steps), `name:update`
(master after minus before), `name:bf16` (the BF16 weights), `name:exp_avg` and `name:exp_avg_sq`.
"""

import torch

from correctness.adam.inputs import OptimizerUnit
from references.adamw import CLIP_EPSILON, AdamWHyperparameters

QUANTITIES = ("master", "update", "bf16", "exp_avg", "exp_avg_sq")


def megatron_clip_coefficient(norm: float, clip: float) -> float:
    """Megatron's coefficient, in double, from the global norm as it holds it (in FP32)."""
    norm32 = float(torch.tensor(norm, dtype=torch.float32))
    return clip / (norm32 + CLIP_EPSILON)


def clipped(unit: OptimizerUnit, step: int) -> torch.Tensor:
    coefficient = megatron_clip_coefficient(unit.grad_norms[step], unit.config.clip_grad)
    grad = unit.grads[step]
    return grad * coefficient if coefficient < 1.0 else grad.clone()


def outputs(unit: OptimizerUnit, master0, master, exp_avg, exp_avg_sq) -> dict[str, torch.Tensor]:
    name = unit.param.name
    values = {
        "master": master,
        "update": master - master0,
        "bf16": master.to(torch.bfloat16) if master.dtype != torch.float64 else master,
        "exp_avg": exp_avg,
        "exp_avg_sq": exp_avg_sq,
    }
    return {f"{name}:{quantity}": values[quantity] for quantity in QUANTITIES}


def fused_adam_arithmetic(
    p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *,
    hyper: AdamWHyperparameters, step: int, bias_correction: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One ADAMW step as TE FusedAdam's kernel computes it, on FP32 values: the hyperparameters
    cross into the kernel as C floats (rounded to FP32), the bias corrections 1 - beta^t come in
    double from the rounded betas and are stored as floats, then m/bc1 / (sqrt(v/bc2) + eps) +
    wd p and p - lr update in FP32. Returns the new (p, m, v); the inputs are not modified."""
    hyper = hyper.rounded_to_fp32()
    beta1, beta2 = torch.tensor(hyper.beta1), torch.tensor(hyper.beta2)  # FP32 scalars
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    bc1 = float(1 - hyper.beta1**step) if bias_correction else 1.0
    bc2 = float(1 - hyper.beta2**step) if bias_correction else 1.0
    bc1, bc2 = torch.tensor(bc1), torch.tensor(bc2)
    update = (m / bc1) / (torch.sqrt(v / bc2) + torch.tensor(hyper.eps)) + torch.tensor(hyper.weight_decay) * p
    return p - torch.tensor(hyper.lr) * update, m, v
