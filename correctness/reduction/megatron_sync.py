"""One gradient sync of Megatron's DDP on a rank, through megatron-core's own classes.

megatron-core 0.16's `_ParamAndGradBuffer` (the flat grad buffer: dtype, layout, padding, the
params' main_grad views) and `_ParamAndGradBucketGroup.start_grad_sync` (the pre-scaling by
gradient_scaling_factor and the collective inside `_coalescing_manager`: reduce-scatter with the
distributed optimizer, else all-reduce) run without overlap (`overlap_grad_reduce` off: a
synchronous collective, no streams) and without NCCL user buffers. Each rank's gradients go into
the params' main_grad as Megatron's backward hook puts them there (`param.main_grad.add_(grad)`
into the zeroed buffer: in a BF16 buffer, the FP32 gradient rounded to nearest even).

One shim, on the CPU only (`cpu_current_device`, undone on leaving it): `torch.cuda.current_device()`,
which the buffer passes as the device of its zeros (param_and_grad_buffer.py, the `grad_data` and
`param_data` allocations), returns "cpu". Nothing else in that path touches CUDA.

The order control (`order_run`) fills and scales Megatron's buffer the same way, then sums the
ranks' buffers one after another in an order that moves with the run, in place of the collective.
The buffer's layout must be the plan's (correctness.reduction.plan.buffer_layout, which the parent
uses to cut the tensors out of the result): a rank whose buffer Megatron laid out otherwise raises.
"""

import contextlib
import warnings
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch

from correctness.reduction.plan import BufferLayout, ReductionPlan


@contextlib.contextmanager
def cpu_current_device() -> Iterator[None]:
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = saved


def summed_in_varying_order(buffer: torch.Tensor, group: Any, run: int) -> torch.Tensor:
    """The group's buffers gathered and summed one after another in the buffer's dtype, starting at
    the group rank `run` (mod the group's size): another order of addition on each run."""
    import torch.distributed as dist

    size = dist.get_world_size(group)
    gathered = [torch.empty_like(buffer) for _ in range(size)]
    dist.all_gather(gathered, buffer, group=group)
    total = gathered[run % size].clone()
    for step in range(1, size):
        total += gathered[(run + step) % size]
    return total


def grad_sync(gradients: dict[str, torch.Tensor], plan: ReductionPlan, layout: BufferLayout, dtype: torch.dtype,
              group: Any, tp_group: Any, device: torch.device, drop: bool,
              order_run: int | None = None) -> torch.Tensor:
    """One sync on this rank: its shard (distributed optimizer) or the whole reduced buffer, in the
    buffer's dtype. `drop`: this rank's gradients never reach its buffer (it still joins the
    collective). `order_run`: the buffers summed in an order that moves with the run."""
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
    params = [torch.nn.Parameter(torch.zeros(spec.shape, dtype=torch.bfloat16, device=device)) for spec in plan.tensors]
    shim = cpu_current_device() if device.type == "cpu" else contextlib.nullcontext()
    with shim:
        buffer = _ParamAndGradBuffer(
            config, torch.bfloat16, dtype, params, group, None,
            {param: spec.name for param, spec in zip(params, plan.tensors)},
            plan.scaling_factor(group.size()), list(range(len(params))), False,
            SimpleNamespace(tp=tp_group, dp_cp=group),
        )
        _check_layout(buffer, params, layout)
        if not drop:
            for param, spec in zip(params, plan.tensors):
                param.main_grad.add_(gradients[spec.name])
        if order_run is None:
            with warnings.catch_warnings():  # torch 2.13 deprecates it; Megatron 0.16 calls it
                warnings.filterwarnings("ignore", message=".*reduce_scatter_tensor.* is deprecated", category=FutureWarning)
                _ParamAndGradBucketGroup(buffer.buckets, config, group, group.size()).start_grad_sync()
            reduced = buffer.grad_data
        else:
            factor = plan.scaling_factor(group.size())
            if factor != 1.0:
                buffer.grad_data *= factor
            reduced = summed_in_varying_order(buffer.grad_data, group, order_run)
    if plan.distributed_optimizer:
        return shard_buffer(reduced, group.size())[group.rank()].clone()
    return reduced.clone()


def _check_layout(buffer: Any, params: list[torch.nn.Parameter], layout: BufferLayout) -> None:
    starts = tuple(buffer.param_index_map[param][0] for param in params)
    if len(buffer.buckets) != 1 or starts != layout.starts or buffer.grad_data.numel() != layout.numel:
        raise RuntimeError(
            f"Megatron laid the grad buffer out as {len(buffer.buckets)} bucket(s), starts {starts}, "
            f"{buffer.grad_data.numel()} elements; the plan expects one bucket, starts {layout.starts}, {layout.numel}"
        )
