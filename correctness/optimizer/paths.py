"""The paths of the optimizer lever: three steps of AdamW on one unit, each as some code computes it.

Every path starts from the unit's BF16 weights (FP32 master = the BF16 values), applies the
global-norm clip to each step's FP32 gradient as Megatron does, runs the step at the recipe's
schedule, and rounds the master into BF16 (round to nearest even). The clip, the named outputs and
TE FusedAdam's FP32 arithmetic are shared with the precision-aware-Adam lever
(correctness.adam.arithmetic), as is the FP64 reference (correctness.adam.reference.Fp64AdamW).
"""

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from correctness.adam.arithmetic import clipped, fused_adam_arithmetic, outputs
from correctness.adam.inputs import OptimizerUnit
from correctness.errors import ImplementationUnavailable
from correctness.lever import Implementation, ImplementationOutput


@dataclass(frozen=True)
class TorchAdamW:
    """torch.optim.AdamW over an FP32 master copy, on the CPU: Megatron's CPU side (fused=True)."""

    name: str = "torch-adamw-fused"
    fused: bool = True

    def run(self, unit: OptimizerUnit) -> ImplementationOutput:
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
        return ImplementationOutput(
            tensors=outputs(unit, master0, master.detach(), state["exp_avg"], state["exp_avg_sq"]),
            backend=f"torch.optim.AdamW ({kernel}, cpu)",
            details={"torch": torch.__version__},
        )


@dataclass(frozen=True)
class EagerAdamW:
    """AdamW in plain torch ops with TE FusedAdam's arithmetic (`fused_adam_arithmetic`):
    hyperparameters rounded to FP32, bias corrections 1 - beta^t from the rounded betas, FP32 math,
    m/bc1 / (sqrt(v/bc2) + eps) + wd p. The CPU tier's stand-in for the GPU share, and the base of the controls:
    `bias_correction=False` drops the corrections, `master=torch.bfloat16` keeps the master in BF16."""

    name: str = "eager-adamw-fp32"
    bias_correction: bool = True
    master: torch.dtype = torch.float32

    def run(self, unit: OptimizerUnit) -> ImplementationOutput:
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
        return ImplementationOutput(
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

    def run(self, unit: OptimizerUnit) -> ImplementationOutput:
        try:
            from transformer_engine.pytorch.optimizers import FusedAdam
            import transformer_engine
        except Exception as error:  # TE raises RuntimeError, OSError... where unusable
            raise ImplementationUnavailable(
                f"Transformer Engine is not usable here: {type(error).__name__}: {error}") from None
        if not torch.cuda.is_available():
            raise ImplementationUnavailable("TE FusedAdam needs a CUDA device; none is available")
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
        return ImplementationOutput(
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

    def run(self, unit: OptimizerUnit) -> ImplementationOutput:
        share = self.shares[unit.param.name]
        output = (self.cpu if share == "cpu" else self.device).run(unit)
        return ImplementationOutput(
            tensors=output.tensors, backend=f"{share} share: {output.backend}", details=output.details)

