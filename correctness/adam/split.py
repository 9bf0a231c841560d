"""Megatron's CPU/GPU optimizer split (`--optimizer-cpu-offload --optimizer-offload-fraction F`).

Confirmed in radixark/Megatron-LM at the recipe's commit 37f91617 (megatron-core 0.16.0rc0):
- megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py,
  `HybridDeviceOptimizer._get_sub_optimizer_param_groups`: the threshold is F x the numel of all
  its (GPU) parameters; it walks its param groups in order and each group's params in order, and a
  param goes to the CPU when `offload_params_numel < offload_threshold` holds *before* its numel is
  added, so whole tensors move and the CPU share overshoots F by up to one tensor; F = 0 moves
  none, F = 1 moves all.
- megatron/core/optimizer/__init__.py, `_get_param_groups`: params are grouped by their override
  key and the groups sorted with the no-override key first: the default (weight-decayed) group
  comes first, then the wd_mult = 0 group (`get_standard_config_overrides`: 1-D params and
  `*.bias`).
- megatron/core/optimizer/distrib_optimizer.py: with the distributed optimizer (required by
  `--use-precision-aware-optimizer`, optimizer_config.py, which `--optimizer-cpu-offload` requires,
  training/arguments.py) the HybridDeviceOptimizer is rebuilt from `opt_group_ranges`, whose params
  follow the grad buffer's order; megatron/core/distributed/param_and_grad_buffer.py fills the
  buffer with `params[::-1]` (reverse of named_parameters(), "to roughly follow backprop order").
  So inside a group the order is reverse model order: the last layer first, the embedding last.
- megatron/core/optimizer/__init__.py, `get_megatron_optimizer`: parameters with `allreduce=False`
  (routed experts at EP > 1, TEGroupedLinear in megatron/core/extensions/transformer_engine.py)
  get their own optimizer, built from the `expert_parallel_buffers`, after the dense one built from
  the `buffers`; `_get_megatron_optimizer_based_on_param_groups` makes each a HybridDeviceOptimizer
  with the same `optimizer_offload_fraction`, so the fraction applies to each on its own, each with
  the group and order rules above (megatron/core/distributed/distributed_data_parallel.py fills the
  dense and the expert-parallel buffers from named_parameters() separately). The ChainedOptimizer
  (megatron/core/optimizer/optimizer.py) clips every optimizer's gradients with one global norm.
At DP 1 each rank's shard of a parameter is the whole rank-local tensor, as modelled here.
"""

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from numbers import Real

from correctness.megatron.layout import OPTIMIZERS, ParamSlice

CPU = "cpu"
GPU = "gpu"


def _check_fraction(fraction: object) -> float:
    if isinstance(fraction, bool) or not isinstance(fraction, Real):
        raise ValueError(f"offload fraction {fraction!r} is not a number")
    value = float(fraction)
    if math.isnan(value) or not 0.0 <= value <= 1.0:
        raise ValueError(f"offload fraction {fraction!r} outside [0, 1]")
    return value


def _checked(slices: Iterable[ParamSlice]) -> tuple[ParamSlice, ...]:
    slices = tuple(slices)
    seen: set[str] = set()
    for param in slices:
        if param.name in seen:
            raise ValueError(f"parameter {param.name} is listed twice")
        seen.add(param.name)
        if param.optimizer not in OPTIMIZERS:
            raise ValueError(f"parameter {param.name}: optimizer {param.optimizer!r} is not one of {list(OPTIMIZERS)}")
    return slices


def _walk(slices: Sequence[ParamSlice]) -> tuple[ParamSlice, ...]:
    backwards = sorted(slices, key=lambda param: param.index, reverse=True)
    return tuple(p for p in backwards if p.weight_decay) + tuple(p for p in backwards if not p.weight_decay)


def offload_orders(slices: Iterable[ParamSlice]) -> dict[str, tuple[ParamSlice, ...]]:
    """Each optimizer's walk (only those with parameters, dense first): weight-decayed tensors, then
    norms and biases, each group in reverse model order."""
    slices = _checked(slices)
    orders = {name: _walk([p for p in slices if p.optimizer == name]) for name in OPTIMIZERS}
    return {name: order for name, order in orders.items() if order}


def offload_order(slices: Iterable[ParamSlice]) -> tuple[ParamSlice, ...]:
    """Every optimizer's walk, one after the other (dense, then expert); for a model without expert
    parallelism the order the one hybrid optimizer walks."""
    return tuple(param for order in offload_orders(slices).values() for param in order)


def _split_one(order: Sequence[ParamSlice], fraction: float) -> dict[str, str]:
    threshold = sum(param.numel for param in order) * fraction
    offloaded = 0
    split = {}
    for param in order:
        if offloaded < threshold:  # checked before the tensor is added
            split[param.name] = CPU
            offloaded += param.numel
        else:
            split[param.name] = GPU
    return split


def offload_split(slices: Iterable[ParamSlice], fraction: float) -> dict[str, str]:
    """"cpu" or "gpu" for each Megatron name, each optimizer split on its own at `fraction`, in
    offload order (dense, then expert)."""
    fraction = _check_fraction(fraction)
    split: dict[str, str] = {}
    for order in offload_orders(slices).values():
        split.update(_split_one(order, fraction))
    return split


@dataclass(frozen=True, kw_only=True)
class OffloadSummary:
    """The split of some parameters: all of them (`optimizer` None), or one optimizer's."""

    fraction: float
    cpu: tuple[str, ...]  # names, in offload order
    gpu: tuple[str, ...]
    cpu_numel: int
    gpu_numel: int
    optimizer: str | None = None
    optimizers: dict[str, "OffloadSummary"] = field(default_factory=dict)  # per optimizer, dense first

    @property
    def tensors(self) -> int:
        return len(self.cpu) + len(self.gpu)

    @property
    def parameters(self) -> int:
        return self.cpu_numel + self.gpu_numel

    @property
    def gpu_share(self) -> float:
        """The GPU's fraction of all parameters."""
        total = self.cpu_numel + self.gpu_numel
        return self.gpu_numel / total if total else 0.0


def _summary(
    split: dict[str, str], numel: dict[str, int], fraction: float, optimizer: str | None, **extra
) -> OffloadSummary:
    cpu = tuple(name for name, device in split.items() if device == CPU)
    gpu = tuple(name for name, device in split.items() if device == GPU)
    return OffloadSummary(
        fraction=float(fraction), cpu=cpu, gpu=gpu, optimizer=optimizer,
        cpu_numel=sum(numel[name] for name in cpu), gpu_numel=sum(numel[name] for name in gpu), **extra,
    )


def offload_summary(slices: Sequence[ParamSlice], fraction: float) -> OffloadSummary:
    """The whole split, with each optimizer's own summary in `optimizers` (tensors, parameters, GPU share)."""
    fraction = _check_fraction(fraction)
    numel = {param.name: param.numel for param in slices}
    per_optimizer = {
        name: _summary(_split_one(order, fraction), numel, fraction, name)
        for name, order in offload_orders(slices).items()
    }
    return _summary(offload_split(slices, fraction), numel, fraction, None, optimizers=per_optimizer)
