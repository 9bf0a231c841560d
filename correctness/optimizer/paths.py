"""The paths of the optimizer lever: three steps of AdamW on one unit, each as some code computes it.

Every path starts from the unit's BF16 weights (FP32 master = the BF16 values), applies the
global-norm clip to each step's FP32 gradient as Megatron does (coefficient
clip / (norm + 1e-6) in double from the FP32 norm, applied in FP32 only when below 1), runs the
step at the recipe's schedule, and rounds the master into BF16 (round to nearest even). Outputs,
per parameter `name`: `name:master` (FP32 master after the steps), `name:update` (master after
minus before), `name:bf16` (the BF16 weights), `name:exp_avg` and `name:exp_avg_sq`.
"""

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from correctness.errors import PathUnavailable
from correctness.lever import Implementation, PathOutput
from correctness.optimizer.inputs import OptimizerUnit
from references.adamw import CLIP_EPSILON, AdamWHyperparameters, adamw_run, clip_coefficient

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


@dataclass(frozen=True)
class TorchAdamW:
    """torch.optim.AdamW over an FP32 master copy, on the CPU: Megatron's CPU side (fused=True)."""

    name: str = "torch-adamw-fused"
    fused: bool = True

    def run(self, unit: OptimizerUnit) -> PathOutput:
        master0 = unit.weights.float()
        master = master0.clone().requires_grad_()
        hyper = unit.config.hyperparameters(unit.first_iteration, unit.weight_decay_multiplier)
        optimizer = torch.optim.AdamW(
            [master], lr=hyper.lr, betas=(hyper.beta1, hyper.beta2), eps=hyper.eps,
            weight_decay=hyper.weight_decay, fused=self.fused, foreach=False if self.fused else True,
        )
        for step, iteration in enumerate(unit.iterations()):
            optimizer.param_groups[0]["lr"] = unit.config.lr(iteration)
            master.grad = clipped(unit, step)
            optimizer.step()
        state = optimizer.state[master]
        kernel = "fused" if self.fused else "foreach"
        return PathOutput(
            tensors=outputs(unit, master0, master.detach(), state["exp_avg"], state["exp_avg_sq"]),
            backend=f"torch.optim.AdamW ({kernel}, cpu)",
            details={"torch": torch.__version__},
        )


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


@dataclass(frozen=True)
class EagerAdamW:
    """AdamW in plain torch ops with TE FusedAdam's arithmetic (`fused_adam_arithmetic`):
    hyperparameters rounded to FP32, bias corrections 1 - beta^t from the rounded betas, FP32 math,
    m/bc1 / (sqrt(v/bc2) + eps) + wd p. The CPU tier's stand-in for the GPU share, and the base of the controls:
    `bias_correction=False` drops the corrections, `master=torch.bfloat16` keeps the master in BF16."""

    name: str = "eager-adamw-fp32"
    bias_correction: bool = True
    master: torch.dtype = torch.float32

    def run(self, unit: OptimizerUnit) -> PathOutput:
        master0 = unit.weights.to(self.master)
        p = master0.float()
        m = torch.zeros_like(p)
        v = torch.zeros_like(p)
        for step, iteration in enumerate(unit.iterations()):
            hyper = unit.config.hyperparameters(iteration, unit.weight_decay_multiplier)
            p, m, v = fused_adam_arithmetic(
                p, clipped(unit, step), m, v, hyper=hyper, step=step + 1, bias_correction=self.bias_correction
            )
            p = p.to(self.master).float()
        master = p.to(self.master).float() if self.master != torch.float32 else p
        return PathOutput(
            tensors=outputs(unit, master0.float(), master, m, v),
            backend=f"eager AdamW (fp32 math, {str(self.master).removeprefix('torch.')} master"
            + ("" if self.bias_correction else ", no bias correction") + ")",
        )


@dataclass(frozen=True)
class TeFusedAdam:
    """Transformer Engine's FusedAdam on the GPU over an FP32 master copy: Megatron's GPU side.
    TE is imported only when this runs; without a GPU or TE the path is unavailable."""

    name: str = "te-fused-adam"
    bias_correction: bool = True
    master: torch.dtype = torch.float32

    def run(self, unit: OptimizerUnit) -> PathOutput:
        try:
            from transformer_engine.pytorch.optimizers import FusedAdam
            import transformer_engine
        except Exception as error:  # TE raises RuntimeError, OSError... where unusable
            raise PathUnavailable(f"Transformer Engine is not usable here: {type(error).__name__}: {error}") from None
        if not torch.cuda.is_available():
            raise PathUnavailable("TE FusedAdam needs a CUDA device; none is available")
        master0 = unit.weights.to("cuda").to(self.master)
        master = master0.clone().requires_grad_()
        hyper = unit.config.hyperparameters(unit.first_iteration, unit.weight_decay_multiplier)
        optimizer = FusedAdam(
            [master], lr=hyper.lr, betas=(hyper.beta1, hyper.beta2), eps=hyper.eps,
            weight_decay=hyper.weight_decay, bias_correction=self.bias_correction, adam_w_mode=True,
        )
        for step, iteration in enumerate(unit.iterations()):
            optimizer.param_groups[0]["lr"] = unit.config.lr(iteration)
            master.grad = clipped(unit, step).to("cuda").to(self.master)
            optimizer.step()
        state = optimizer.state[master]
        tensors = outputs(unit, master0.float(), master.detach().float(), state["exp_avg"], state["exp_avg_sq"])
        return PathOutput(
            tensors={name: tensor.cpu() for name, tensor in tensors.items()},
            backend="TE FusedAdam (cuda)",
            details={"transformer_engine": transformer_engine.__version__},
        )


@dataclass(frozen=True)
class OffloadSplit:
    """The candidate: each parameter on the side Megatron's split puts it, with that side's optimizer."""

    fraction: float
    shares: Mapping[str, str]  # parameter name -> "cpu" or "gpu"
    cpu: Implementation
    device: Implementation

    @property
    def name(self) -> str:
        return f"offload-{self.fraction:g}"

    def run(self, unit: OptimizerUnit) -> PathOutput:
        share = self.shares[unit.param.name]
        output = (self.cpu if share == "cpu" else self.device).run(unit)
        return PathOutput(tensors=output.tensors, backend=f"{share} share: {output.backend}", details=output.details)


@dataclass(frozen=True)
class Fp64AdamW:
    """The FP64 reference (references.adamw) on one unit; `fp32_hyperparameters` first rounds lr,
    betas, eps and weight decay to FP32, as TE FusedAdam's kernel arguments do."""

    fp32_hyperparameters: bool = False

    @property
    def name(self) -> str:
        return "fp64-adamw" + (" (fp32 hyperparameters)" if self.fp32_hyperparameters else "")

    def run(self, unit: OptimizerUnit) -> PathOutput:
        hypers = [unit.config.hyperparameters(i, unit.weight_decay_multiplier) for i in unit.iterations()]
        if self.fp32_hyperparameters:
            hypers = [hyper.rounded_to_fp32() for hyper in hypers]
        result = adamw_run(
            unit.weights,
            unit.grads,
            hypers=hypers,
            clip_coefficients=[clip_coefficient(norm, unit.config.clip_grad) for norm in unit.grad_norms],
        )
        master0 = unit.weights.double()
        return PathOutput(
            tensors=outputs(unit, master0, result["master"], result["exp_avg"], result["exp_avg_sq"]),
            backend=self.name,
        )
