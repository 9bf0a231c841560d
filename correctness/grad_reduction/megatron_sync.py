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

Other variants of a sync (correctness.grad_reduction.plan's RankPath.variant) change one thing each:
- RANK_DROPPED: the dropped rank's gradients never reach its buffer (it still joins the collective);
- ORDER_VARIES (the deterministic-mode lever's control): Megatron's buffer filled and scaled the
  same way, then the ranks' buffers summed one after another in an order that moves with the run,
  in place of the collective;
- wrong implementations in BF16 (correctness.grad_reduction.wrong): TRUNCATED, the gradients converted
  into the BF16 buffer by truncation (the low 16 bits of FP32 dropped) instead of to nearest even;
  HOPS_THROUGH_FP8, the ranks' buffers summed one after another from rank 0 (a ring's hops), each
  partial sum passed through FP8 E4M3 (scaled by a power of two to its largest value) before BF16;
- FP32_ACCUMULATION: Megatron's own reduce_scatter_with_fp32_accumulation (DDP config), the BF16
  shards exchanged by an all-to-all and summed in FP32, the sum rounded to BF16 once. Megatron
  installs it in a module global of param_and_grad_buffer for every later bucket group; the sync
  puts the usual reduce-scatter back after it.
The buffer's layout must be the plan's (correctness.grad_reduction.plan.buffer_layout, which the parent
uses to cut the tensors out of the result): a rank whose buffer Megatron laid out otherwise raises.
"""

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import torch

from correctness.grad_reduction.plan import (
    FP32_ACCUMULATION, HOPS_THROUGH_FP8, ORDER_VARIES, SUM, TRUNCATED, VARIANTS, BufferLayout, ReductionPlan,
)
from references.rounding import round_toward_zero

E4M3_MAX = 448.0


@contextlib.contextmanager
def cpu_current_device() -> Iterator[None]:
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = saved


def through_fp8_e4m3(values: torch.Tensor) -> torch.Tensor:
    """FP32 values through FP8 E4M3 and back: scaled by the power of two that brings their largest
    magnitude to at most E4M3's largest value, rounded to nearest even, scaled back."""
    largest = float(values.abs().max())
    if largest == 0.0:
        return values
    scale = 2.0 ** math.floor(math.log2(E4M3_MAX / largest))
    return (values * scale).to(torch.float8_e4m3fn).float() / scale


def summed_in_varying_order(buffer: torch.Tensor, group: Any, run: int,
                            hop: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """The group's buffers gathered and summed one after another in the buffer's dtype, starting at
    the group rank `run` (mod the group's size): another order of addition on each run. `hop`: each
    partial sum (in FP32) passed through it before it is rounded to the buffer's dtype."""
    import torch.distributed as dist

    size = dist.get_world_size(group)
    gathered = [torch.empty_like(buffer) for _ in range(size)]
    dist.all_gather(gathered, buffer, group=group)
    total = gathered[run % size].clone()
    for step in range(1, size):
        if hop is None:
            total += gathered[(run + step) % size]
        else:
            total = hop(total.float() + gathered[(run + step) % size].float()).to(buffer.dtype)
    return total


def grad_sync(gradients: dict[str, torch.Tensor], plan: ReductionPlan, layout: BufferLayout, dtype: torch.dtype,
              group: Any, tp_group: Any, device: torch.device, *, variant: str = SUM, run: int = 0,
              drop: bool = False) -> torch.Tensor:
    """One sync on this rank: its shard (distributed optimizer) or the whole reduced buffer, in the
    buffer's dtype. `variant`: what the sync changes (module docstring), `run` its run (the order
    control's order moves with it); `drop`: this rank's gradients never reach its buffer (it still
    joins the collective)."""
    if variant not in VARIANTS:
        raise ValueError(f"grad sync: unknown variant {variant!r} (one of {', '.join(VARIANTS)})")
    if variant in (TRUNCATED, HOPS_THROUGH_FP8) and dtype != torch.bfloat16:
        raise ValueError(f"grad sync: {variant} is a BF16 buffer's mistake, not {dtype}'s")
    from megatron.core.distributed import DistributedDataParallelConfig, param_and_grad_buffer
    from megatron.core.distributed.param_and_grad_buffer import (
        _ParamAndGradBucketGroup,
        _ParamAndGradBuffer,
        shard_buffer,
    )

    if variant == FP32_ACCUMULATION and not plan.distributed_optimizer:
        raise ValueError("grad sync: reduce_scatter_with_fp32_accumulation needs the distributed optimizer")
    config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=dtype == torch.float32, use_distributed_optimizer=plan.distributed_optimizer,
        overlap_grad_reduce=False, reduce_scatter_with_fp32_accumulation=variant == FP32_ACCUMULATION,
    )
    usual_reduce_scatter = param_and_grad_buffer.dist_reduce_scatter_func
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
                gradient = gradients[spec.name]
                if variant == TRUNCATED:
                    gradient = round_toward_zero(gradient.float(), torch.bfloat16)
                param.main_grad.add_(gradient)
        if variant in (ORDER_VARIES, HOPS_THROUGH_FP8):
            factor = plan.scaling_factor(group.size())
            if factor != 1.0:
                buffer.grad_data *= factor
            reduced = (summed_in_varying_order(buffer.grad_data, group, run) if variant == ORDER_VARIES
                       else summed_in_varying_order(buffer.grad_data, group, 0, hop=through_fp8_e4m3))
        else:
            try:
                with warnings.catch_warnings():  # torch 2.13 deprecates it; Megatron 0.16 calls it
                    warnings.filterwarnings("ignore", message=".*reduce_scatter_tensor.* is deprecated",
                                            category=FutureWarning)
                    _ParamAndGradBucketGroup(buffer.buckets, config, group, group.size()).start_grad_sync()
            finally:
                param_and_grad_buffer.dist_reduce_scatter_func = usual_reduce_scatter
            reduced = buffer.grad_data
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
