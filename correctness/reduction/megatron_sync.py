"""Megatron's own gradient sync on gloo ranks, to hold correctness.reduction.ranks.grad_sync to it.

megatron-core 0.16's `_ParamAndGradBuffer` (the flat grad buffer: dtype, layout, padding, the
params' main_grad views) and `_ParamAndGradBucketGroup.start_grad_sync` (the pre-scaling by
gradient_scaling_factor and the collective inside `_coalescing_manager`) run here on the CPU with
one shim, inside `cpu_current_device()` and undone on leaving it: `torch.cuda.current_device()`,
which the buffer passes as the device of its zeros (param_and_grad_buffer.py, the `grad_data` and
`param_data` allocations), returns "cpu". Nothing else in that path touches CUDA without overlap
(`overlap_grad_reduce` off: a synchronous collective, no streams) and without NCCL user buffers
(`nccl_ub` off).

`compare_on_ranks(rank, world_size, plans)` builds Megatron's buffer for each plan at DP =
world_size (the whole group), adds each rank's gradients into the params' main_grad as Megatron's
backward hook does (`param.main_grad.add_(grad)`), syncs, and runs the reproduction's `grad_sync`
on the same gradients; it returns both results' digests and Megatron's result, for every plan and
both dtypes. Importing megatron-core costs each rank several seconds: the lever's tiers therefore
run the reproduction, and tests/test_reduction_lever.py holds it bitwise equal to this.
"""

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch

from correctness.reduction.plan import DTYPES, ReductionPlan, digest, rank_gradients
from correctness.reduction.ranks import grad_sync, portable


@contextlib.contextmanager
def cpu_current_device() -> Iterator[None]:
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = saved


def megatron_grad_sync(gradients: dict[str, torch.Tensor], plan: ReductionPlan, dtype: torch.dtype, group: Any,
                       tp_group: Any) -> torch.Tensor:
    """One sync through Megatron's classes: this rank's shard (distributed optimizer) or the whole buffer."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.param_and_grad_buffer import (
        _ParamAndGradBucketGroup,
        _ParamAndGradBuffer,
        shard_buffer,
    )

    config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=dtype == torch.float32, use_distributed_optimizer=plan.distributed_optimizer,
        overlap_grad_reduce=False,
    )
    params = [torch.nn.Parameter(torch.zeros(spec.shape, dtype=torch.bfloat16)) for spec in plan.tensors]
    with cpu_current_device():
        buffer = _ParamAndGradBuffer(
            config, torch.bfloat16, dtype, params, group, None,
            {param: spec.name for param, spec in zip(params, plan.tensors)},
            plan.scaling_factor(group.size()), list(range(len(params))), False,
            SimpleNamespace(tp=tp_group, dp_cp=group),
        )
        for param, spec in zip(params, plan.tensors):
            param.main_grad.add_(gradients[spec.name])
        bucket_group = _ParamAndGradBucketGroup(buffer.buckets, config, group, group.size())
        bucket_group.start_grad_sync()
    if len(buffer.buckets) != 1:
        raise RuntimeError(f"Megatron made {len(buffer.buckets)} buckets; the reproduction assumes one")
    if plan.distributed_optimizer:
        return shard_buffer(buffer.grad_data, group.size())[group.rank()].clone()
    return buffer.grad_data.clone()


def compare_on_ranks(rank: int, world_size: int, plans: tuple[ReductionPlan, ...]) -> list[dict[str, Any]]:
    import torch.distributed as dist

    group = dist.new_group(list(range(world_size)))
    tp_groups = [dist.new_group([member]) for member in range(world_size)]  # TP 1: each rank alone
    results = []
    for plan in plans:
        if plan.dp_sizes != (world_size,):
            raise ValueError(f"a comparison plan reduces over the whole group ({world_size}), not {plan.dp_sizes}")
        gradients = rank_gradients(plan, rank)
        layout = plan.layout(world_size)
        entry = {}
        for name, dtype in DTYPES.items():
            megatron = megatron_grad_sync(gradients, plan, dtype, group, tp_groups[rank])
            ours = grad_sync(gradients, plan, layout, dtype, group, rank, torch.device("cpu"), drop=False)
            entry[name] = {"megatron": digest({"r": megatron}), "reproduction": digest({"r": ours}),
                           "result": portable(megatron)}
        results.append(entry)
    return results
