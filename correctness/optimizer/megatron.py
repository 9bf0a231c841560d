"""Megatron's own HybridDeviceOptimizer, driven standalone: the real offload code.

Unlike the other paths it needs every parameter at once (it makes its own split), so its lever
runs on `WholeInventory` inputs, the units of every parameter materialised, and the per-unit
paths join it through `AllUnits`. It is set up as Megatron sets it up for `--optimizer adam
--optimizer-cpu-offload --use-precision-aware-optimizer` (megatron/core/optimizer/__init__.py at
megatron-core 0.16, `_get_megatron_optimizer_based_on_param_groups`): one optimizer for the dense
and one for the expert-parallel parameters, each with torch.optim.AdamW (fused) on the CPU and TE
FusedAdam on the GPU, FP32 masters (`param_update_in_fp32`), `overlap_cpu_optimizer_d2h_h2d` as
the recipe sets it, lr, weight decay, betas, eps, bias correction and `fused` as its only
optimizer arguments, the weight-decayed group before the no-decay group, each in reverse model
order, gradients handed over as FP32 `decoupled_grad`s, already clipped (Megatron clips before
the hybrid step).

On a GPU (device "cuda") it needs megatron-core, Transformer Engine and CUDA. On the CPU (device
"cpu") it runs the same upstream code under `megatron_on_cpu` (streams, pinned memory and
`is_cuda` shimmed; see correctness.optimizer.megatron_on_cpu for what that leaves untested) with
`CpuFusedAdam`, TE FusedAdam's arithmetic, on the GPU share; it needs megatron-core only.
"""

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from correctness.adam.arithmetic import clipped, outputs
from correctness.adam.inputs import OptimizerUnit
from correctness.adam.split import CPU, GPU, offload_orders, offload_split
from correctness.errors import CorrectnessError, ImplementationUnavailable
from correctness.lever import Implementation, ImplementationOutput
from correctness.megatron.layout import ParamSlice
from correctness.optimizer.megatron_on_cpu import CpuFusedAdam, megatron_on_cpu, plain, reports_cuda
from correctness.provenance import package_version

DEVICES = ("cuda", "cpu")


@dataclass(frozen=True)
class WholeInventory:
    """Every unit of every parameter of a case, held at once."""

    units: tuple[OptimizerUnit, ...]

    def mutated(self, mutate) -> "WholeInventory":
        return replace(self, units=tuple(mutate(unit) for unit in self.units))


@dataclass(frozen=True)
class AllUnits:
    """A per-unit path run over every unit of a whole inventory, its pieces joined per tensor."""

    path: Implementation

    @property
    def name(self) -> str:
        return self.path.name

    def run(self, inputs: WholeInventory) -> ImplementationOutput:
        pieces: dict[str, list[torch.Tensor]] = {}
        backends: dict[str, None] = {}
        details: dict[str, Any] = {}
        for unit in inputs.units:
            output = self.path.run(unit)
            backends[output.backend] = None
            details = {**output.details, **details}
            for name, tensor in output.tensors.items():
                pieces.setdefault(name, []).append(tensor)
        return ImplementationOutput(
            tensors={name: torch.cat(parts) for name, parts in pieces.items()},
            backend=" | ".join(backends),
            details=details,
        )


def _whole(units: Sequence[OptimizerUnit], values) -> torch.Tensor:
    return torch.cat([values(unit) for unit in units])


def _host(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A plain CPU copy of an output, detached from the optimizer that made it."""
    return plain(tensor.detach()).to("cpu", dtype, copy=True)


def hybrid_optimizer_class():
    try:
        from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer
    except Exception as error:  # megatron-core missing, or failing to import for another reason
        raise ImplementationUnavailable(f"megatron-core is not usable here: {type(error).__name__}: {error}") from None
    return HybridDeviceOptimizer


def hybrid_optimizers(
    params: Mapping[str, torch.Tensor], slices: Sequence[ParamSlice], *, fraction: float, gpu_optimizer_cls: type,
    fp32_masters: bool, overlap: bool, weight_decay: float, **defaults: Any,
) -> list[Any]:
    """Megatron's HybridDeviceOptimizers over `params` (one per slice, by name): one per Megatron
    optimizer (dense, then expert), each split on its own at `fraction`, its weight-decayed group
    first, then the no-decay group, each in reverse model order, torch AdamW on the CPU share.
    `defaults` are the other optimizer arguments (lr, betas, eps, bias_correction, fused)."""
    HybridDeviceOptimizer = hybrid_optimizer_class()
    optimizers = []
    for order in offload_orders(slices).values():
        groups = [
            {"params": [params[p.name] for p in order if p.weight_decay], "weight_decay": weight_decay},
            {"params": [params[p.name] for p in order if not p.weight_decay], "weight_decay": 0.0},
        ]
        optimizers.append(HybridDeviceOptimizer(
            [group for group in groups if group["params"]],
            offload_fraction=fraction,
            cpu_optimizer_cls=torch.optim.AdamW,
            gpu_optimizer_cls=gpu_optimizer_cls,
            param_update_in_fp32=fp32_masters,
            overlap_cpu_optimizer_d2h_h2d=overlap,
            weight_decay=weight_decay,
            **defaults,
        ))
    return optimizers


def hybrid_split(optimizers: Sequence[Any], params: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Where Megatron's optimizers put each parameter: "cpu" for those it copied to the host
    (its `gpu_params_map_cpu_copy`), "gpu" for the others."""
    offloaded = {id(param) for optimizer in optimizers for param in optimizer.gpu_params_map_cpu_copy}
    return {name: CPU if id(param) in offloaded else GPU for name, param in params.items()}


def megatron_split(slices: Sequence[ParamSlice], fraction: float, *, overlap: bool) -> dict[str, str]:
    """Megatron's own split of `slices` at `fraction`, from their shapes alone: its
    HybridDeviceOptimizers built under `megatron_on_cpu` over BF16 meta tensors that report
    `is_cuda` (the constructor splits; it reads numel, dtype and is_cuda, no values), so the
    recipe scale costs no memory."""
    params = {p.name: reports_cuda(torch.empty(p.shape, dtype=torch.bfloat16, device="meta")) for p in slices}
    with megatron_on_cpu():
        optimizers = hybrid_optimizers(
            params, slices, fraction=fraction, gpu_optimizer_cls=CpuFusedAdam, fp32_masters=True, overlap=overlap,
            weight_decay=0.0, bias_correction=True, fused=True,
        )
    return hybrid_split(optimizers, params)


def _gpu_optimizer(device: str) -> tuple[type, dict[str, Any]]:
    """The GPU share's optimizer class on `device`, and the versions to record."""
    if device == "cpu":
        return CpuFusedAdam, {}
    try:
        import transformer_engine
        from transformer_engine.pytorch.optimizers import FusedAdam
    except Exception as error:  # TE raises RuntimeError, OSError... where unusable
        raise ImplementationUnavailable(
            f"Transformer Engine is not usable here: {type(error).__name__}: {error}") from None
    if not torch.cuda.is_available():
        raise ImplementationUnavailable(
            "Megatron's HybridDeviceOptimizer with TE FusedAdam needs a CUDA device; none here")
    return FusedAdam, {"transformer_engine": transformer_engine.__version__}


@dataclass(frozen=True)
class MegatronHybrid:
    """Megatron's HybridDeviceOptimizer at `fraction` over the whole inventory: on the GPU with TE
    FusedAdam (device "cuda"), or on the CPU with the shims and CpuFusedAdam (device "cpu").

    `fp32_masters=False` (a control) is Megatron's `param_update_in_fp32=False`: the BF16 parameters
    themselves are updated. Upstream then hands the GPU share's BF16 parameters to the GPU optimizer
    as they are (hybrid_optimizer.py 285-286) and passes gradients over only to FP32 copies and host
    copies (83-115); FusedAdam reads `.grad` (its `use_decoupled_grad` is off), which must have the
    parameter's dtype. So each parameter gets `.grad` in BF16 too, and both shares step on BF16
    gradients (the host copies' gradient buffers have the BF16 dtype of the copies, line 110)."""

    fraction: float
    bias_correction: bool = True  # reaches the GPU share's FusedAdam only: torch's AdamW has no such switch
    fp32_masters: bool = True  # Megatron's param_update_in_fp32
    device: str = "cuda"

    def __post_init__(self):
        if self.device not in DEVICES:
            raise ValueError(f"MegatronHybrid device {self.device!r} is not one of {list(DEVICES)}")

    @property
    def name(self) -> str:
        return f"megatron-hybrid-{self.fraction:g}"

    def run(self, inputs: WholeInventory) -> ImplementationOutput:
        hybrid_optimizer_class()  # ImplementationUnavailable without megatron-core
        gpu_optimizer_cls, versions = _gpu_optimizer(self.device)
        by_param: dict[str, list[OptimizerUnit]] = {}
        for unit in inputs.units:
            by_param.setdefault(unit.param.name, []).append(unit)
        slices = [units[0].param for units in by_param.values()]
        first = inputs.units[0]
        on_cpu = self.device == "cpu"
        place = reports_cuda if on_cpu else (lambda values: torch.nn.Parameter(values.cuda(), requires_grad=True))
        params = {name: place(_whole(units, lambda u: u.weights)) for name, units in by_param.items()}
        weights0 = {name: _whole(units, lambda u: u.weights.float()) for name, units in by_param.items()}
        hyper = first.config.hyperparameters(first.first_iteration, 1.0)
        overlap = first.config.overlap_cpu_optimizer_d2h_h2d
        with megatron_on_cpu() if on_cpu else contextlib.nullcontext():
            optimizers = hybrid_optimizers(
                params, slices, fraction=self.fraction, gpu_optimizer_cls=gpu_optimizer_cls,
                fp32_masters=self.fp32_masters, overlap=overlap, weight_decay=hyper.weight_decay,
                lr=hyper.lr, betas=(hyper.beta1, hyper.beta2), eps=hyper.eps, bias_correction=self.bias_correction,
                fused=True,
            )
            for step, iteration in enumerate(first.iterations()):
                for optimizer in optimizers:
                    for group in optimizer.param_groups:
                        group["lr"] = first.config.lr(iteration)
                for name, units in by_param.items():
                    grad = _whole(units, lambda u: clipped(u, step)).to(params[name].device)
                    params[name].decoupled_grad = grad
                    if not self.fp32_masters:
                        params[name].grad = grad.to(params[name].dtype)
                for optimizer in optimizers:
                    optimizer.step()
            if not on_cpu:
                torch.cuda.synchronize()
        states = {id(p): optimizer.state[p] for optimizer in optimizers for p in optimizer.state}
        tensors: dict[str, torch.Tensor] = {}
        for slice_ in slices:
            state = states.get(id(params[slice_.name]), {})
            needed = ("exp_avg", "exp_avg_sq") + (("master_param",) if self.fp32_masters else ())
            missing = [key for key in needed if key not in state]
            if missing:
                raise CorrectnessError(
                    f"Megatron's HybridDeviceOptimizer state for {slice_.name} lacks {missing} (has {sorted(state)}):"
                    " its optimizer did not step it"
                )
            master = state["master_param"] if self.fp32_masters else params[slice_.name]
            whole = outputs(
                replace(first, param=slice_), weights0[slice_.name], _host(master, torch.float32),
                _host(state["exp_avg"], torch.float32), _host(state["exp_avg_sq"], torch.float32),
            )
            whole[f"{slice_.name}:bf16"] = _host(params[slice_.name], torch.bfloat16)
            tensors.update(whole)
        split = hybrid_split(optimizers, params)
        modelled = offload_split(slices, self.fraction)
        if split != modelled:
            differ = sorted(name for name in split if split[name] != modelled[name])
            raise CorrectnessError(
                f"Megatron's split differs from the modelled one at fraction {self.fraction}: {differ}"
            )
        gpu_share = "CpuFusedAdam, TE FusedAdam's arithmetic on the CPU" if on_cpu else "TE FusedAdam (cuda)"
        return ImplementationOutput(
            tensors=tensors,
            backend=f"Megatron HybridDeviceOptimizer (cpu share: torch AdamW fused; gpu share: {gpu_share})",
            details={
                "megatron_core": package_version("megatron-core"),
                **versions,
                "device": self.device,
                "overlap_cpu_optimizer_d2h_h2d": overlap,
                "param_update_in_fp32": self.fp32_masters,
                "cpu_optimizers": [len(optimizer.cpu_optimizers) for optimizer in optimizers],
                "gpu_optimizer": gpu_optimizer_cls.__name__,
                "split": split,
            },
        )
