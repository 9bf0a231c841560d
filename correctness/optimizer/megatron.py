"""Megatron's own HybridDeviceOptimizer, driven standalone on one GPU: the real offload code.

Unlike the other paths it needs every parameter at once (it makes its own split), so its lever
runs on `WholeInventory` inputs, the units of every parameter materialised, and the per-unit
paths join it through `AllUnits`. It is set up as Megatron sets it up for `--optimizer adam
--optimizer-cpu-offload --use-precision-aware-optimizer` (megatron/core/optimizer/__init__.py at
megatron-core 0.16): one optimizer for the dense and one for the expert-parallel parameters, each
with torch.optim.AdamW (fused) on the CPU, TE FusedAdam on the GPU, FP32 masters
(`param_update_in_fp32`), the weight-decayed group before the no-decay group, each in reverse model
order, gradients handed over as FP32 `decoupled_grad`s, already clipped (Megatron clips before the
hybrid step). Needs megatron-core, Transformer Engine and a CUDA device; unavailable otherwise.
"""

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from correctness.errors import CorrectnessError, PathUnavailable
from correctness.lever import Path, PathOutput
from correctness.optimizer.inputs import OptimizerUnit
from correctness.optimizer.paths import clipped, outputs
from correctness.optimizer.split import offload_orders, offload_split


@dataclass(frozen=True)
class WholeInventory:
    """Every unit of every parameter of a case, held at once."""

    units: tuple[OptimizerUnit, ...]

    def mutated(self, mutate) -> "WholeInventory":
        return replace(self, units=tuple(mutate(unit) for unit in self.units))


@dataclass(frozen=True)
class AllUnits:
    """A per-unit path run over every unit of a whole inventory, its pieces joined per tensor."""

    path: Path

    @property
    def name(self) -> str:
        return self.path.name

    def run(self, inputs: WholeInventory) -> PathOutput:
        pieces: dict[str, list[torch.Tensor]] = {}
        backends: dict[str, None] = {}
        details: dict[str, Any] = {}
        for unit in inputs.units:
            output = self.path.run(unit)
            backends[output.backend] = None
            details = {**output.details, **details}
            for name, tensor in output.tensors.items():
                pieces.setdefault(name, []).append(tensor)
        return PathOutput(
            tensors={name: torch.cat(parts) for name, parts in pieces.items()},
            backend=" | ".join(backends),
            details=details,
        )


def _whole(units: Sequence[OptimizerUnit], values) -> torch.Tensor:
    return torch.cat([values(unit) for unit in units])


@dataclass(frozen=True)
class MegatronHybrid:
    fraction: float
    bias_correction: bool = True  # reaches TE FusedAdam only: torch's AdamW has no such switch
    fp32_masters: bool = True  # Megatron's param_update_in_fp32

    @property
    def name(self) -> str:
        return f"megatron-hybrid-{self.fraction:g}"

    def run(self, inputs: WholeInventory) -> PathOutput:
        try:
            from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer
            from transformer_engine.pytorch.optimizers import FusedAdam
        except Exception as error:  # either may fail to import for many reasons
            raise PathUnavailable(f"megatron-core or Transformer Engine is not usable here: {error}") from None
        if not torch.cuda.is_available():
            raise PathUnavailable("Megatron's HybridDeviceOptimizer needs a CUDA device; none is available")
        by_param: dict[str, list[OptimizerUnit]] = {}
        for unit in inputs.units:
            by_param.setdefault(unit.param.name, []).append(unit)
        slices = [units[0].param for units in by_param.values()]
        first = inputs.units[0]
        params = {
            name: torch.nn.Parameter(_whole(units, lambda u: u.weights).cuda(), requires_grad=True)
            for name, units in by_param.items()
        }
        weights0 = {name: _whole(units, lambda u: u.weights.float()) for name, units in by_param.items()}
        hyper = first.config.hyperparameters(first.first_iteration, 1.0)
        # Megatron builds one optimizer for the dense and one for the expert-parallel parameters, each
        # its own HybridDeviceOptimizer split at the same fraction (megatron/core/optimizer/__init__.py).
        optimizers = []
        for order in offload_orders(slices).values():
            groups = [
                {"params": [params[p.name] for p in order if p.weight_decay], "weight_decay": hyper.weight_decay},
                {"params": [params[p.name] for p in order if not p.weight_decay], "weight_decay": 0.0},
            ]
            optimizers.append(HybridDeviceOptimizer(
                [group for group in groups if group["params"]],
                offload_fraction=self.fraction,
                cpu_optimizer_cls=torch.optim.AdamW,
                gpu_optimizer_cls=FusedAdam,
                param_update_in_fp32=self.fp32_masters,
                overlap_cpu_optimizer_d2h_h2d=False,
                lr=hyper.lr,
                betas=(hyper.beta1, hyper.beta2),
                eps=hyper.eps,
                weight_decay=hyper.weight_decay,
                bias_correction=self.bias_correction,
                fused=True,
            ))
        for step, iteration in enumerate(first.iterations()):
            for optimizer in optimizers:
                for group in optimizer.param_groups:
                    group["lr"] = first.config.lr(iteration)
            for name, units in by_param.items():
                params[name].decoupled_grad = _whole(units, lambda u: clipped(u, step)).cuda()
            for optimizer in optimizers:
                optimizer.step()
            torch.cuda.synchronize()
        states = {id(p): optimizer.state[p] for optimizer in optimizers for p in optimizer.state}
        tensors: dict[str, torch.Tensor] = {}
        split: dict[str, str] = {}
        for slice_ in slices:
            state = states.get(id(params[slice_.name]), {})
            needed = ("exp_avg", "exp_avg_sq") + (("master_param",) if self.fp32_masters else ())
            missing = [key for key in needed if key not in state]
            if missing:
                raise CorrectnessError(
                    f"Megatron's HybridDeviceOptimizer state for {slice_.name} lacks {missing} (has {sorted(state)})"
                )
            split[slice_.name] = "cpu" if state["exp_avg"].device.type == "cpu" else "gpu"
            master = (state["master_param"] if self.fp32_masters else params[slice_.name]).detach().float().cpu()
            whole = outputs(
                replace(first, param=slice_), weights0[slice_.name], master,
                state["exp_avg"].float().cpu(), state["exp_avg_sq"].float().cpu(),
            )
            whole[f"{slice_.name}:bf16"] = params[slice_.name].detach().cpu()
            tensors.update(whole)
        modelled = offload_split(slices, self.fraction)
        if split != modelled:
            differ = sorted(name for name in split if split[name] != modelled[name])
            raise CorrectnessError(f"Megatron's split differs from the modelled one at fraction {self.fraction}: {differ}")
        return PathOutput(
            tensors=tensors,
            backend="Megatron HybridDeviceOptimizer (cpu: torch AdamW fused, gpu: TE FusedAdam)",
            details={"split": split},
        )
