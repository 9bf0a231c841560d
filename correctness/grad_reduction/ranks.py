"""What each data-parallel rank runs: Megatron's gradient sync, through megatron-core's own classes.

`reduce_on_ranks(rank, world_size, plan)` runs in every rank (correctness.distributed.run_ranks
on the CPU: gloo; on GPUs an NCCL subgroup over the same ranks, one GPU each). For every DP size d of
the plan, ranks 0 .. d-1 form a subgroup (dist.new_group), so one run of max(d) ranks reduces at
every size. In each subgroup, every path's sync runs on that rank's own gradient:

- candidate: `--grad-reduce-in-bf16` (DDP grad_reduce_in_fp32 False): a BF16 grad buffer, twice
  (the repeat is a second collective on the same inputs);
- default: `--accumulate-allreduce-grads-in-fp32` (grad_reduce_in_fp32 True): an FP32 buffer, twice;
- control: the candidate with one rank's gradient dropped from the sum (that rank's buffer stays
  zero, as if its gradients never reached it; the rank still joins the collective; at DP 1 the
  only rank: the result is zero).

Those are the gradient-reduction-dtype lever's paths (plan.DTYPE_PATHS); a plan may carry others
(the deterministic-mode lever's, and the wrong BF16 reductions of correctness.grad_reduction.wrong:
plan.RankPath).

One sync (`correctness.grad_reduction.megatron_sync.grad_sync`) is megatron-core 0.16's own
`_ParamAndGradBuffer` and `_ParamAndGradBucketGroup.start_grad_sync`, without overlap, on the
path's subgroup (every rank a TP group of its own: the tier's TP rank is one rank of the model's
TP group, whose other members do not take part in the data-parallel sync). megatron-core is
imported once, by the server the ranks are forked from (correctness.distributed).

Returned (pickled to the parent; tensors as numpy arrays of their bits, `portable`): the digest of
the rank's gradients; per DP size and path, the digest of every run's result, and the tensors the
parent assembles: each rank's shard after a reduce-scatter, rank 0's whole buffer after an
all-reduce (the other ranks' digests must equal rank 0's). A repeat bitwise equal to its first run
is returned as None (the parent reuses the first run's tensor: the same bits), to halve the transfer.
"""

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from correctness.environment import environment_set
from correctness.grad_reduction.megatron_sync import grad_sync
from correctness.grad_reduction.plan import DTYPES, RANK_DROPPED, RankPath, ReductionPlan, digest, rank_gradients


def portable(tensor: torch.Tensor) -> tuple[str, Any]:
    """A CPU tensor as (dtype name, numpy array of its bits): pickled by value. A torch tensor put on
    a multiprocessing queue travels as a shared-memory handle that the sending process must outlive
    until the receiver opens it, and a rank exits as soon as it has put its result."""
    bits = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[tensor.dtype]
    return str(tensor.dtype).removeprefix("torch."), tensor.contiguous().view(bits).numpy().copy()


def from_portable(value: tuple[str, Any]) -> torch.Tensor:
    dtype, bits = value
    return torch.from_numpy(bits).view(getattr(torch, dtype))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@contextlib.contextmanager
def path_settings(path: RankPath) -> Iterator[None]:
    """The path's environment and torch's deterministic-algorithms switch, restored after."""
    saved_deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(path.deterministic)
    try:
        with environment_set(dict(path.env)):
            yield
    finally:
        torch.use_deterministic_algorithms(saved_deterministic)


def reduce_on_ranks(rank: int, world_size: int, plan: ReductionPlan) -> dict[str, Any]:
    import torch.distributed as dist

    if world_size != plan.world_size:
        raise ValueError(f"the plan needs {plan.world_size} ranks, the group has {world_size}")
    if plan.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    backend = "nccl" if plan.device == "cuda" else None
    tp_groups = [dist.new_group([member], backend=backend) for member in range(world_size)]
    groups = {}
    for dp in plan.dp_sizes:  # every rank calls new_group for every subgroup, members or not
        for env in dict.fromkeys(path.env for path in plan.paths):  # paths of one environment share a group
            with path_settings(RankPath(name="groups", dtype="fp32", runs=1, env=env)):
                group = dist.new_group(list(range(dp)), backend=backend)
            if rank < dp:
                groups[(dp, env)] = group
    gradients = rank_gradients(plan, rank)
    out: dict[str, Any] = {"digest": digest(gradients), "runs": {}}
    gradients = {name: tensor.to(device) for name, tensor in gradients.items()}
    for dp in plan.dp_sizes:
        if rank >= dp:
            continue
        layout = plan.layout(dp)
        dropped = plan.dropped_rank(dp)
        for path in plan.paths:
            group = groups[(dp, path.env)]
            results, digests, firsts = [], [], []
            for run in range(path.runs):
                with path_settings(path):
                    result = grad_sync(gradients, plan, layout, DTYPES[path.dtype], group, tp_groups[rank], device,
                                       variant=path.variant, run=run,
                                       drop=path.variant == RANK_DROPPED and rank == dropped).cpu()
                digests.append(digest({"result": result}))
                keep = plan.distributed_optimizer or rank == 0
                if not keep or (run > 0 and _same_bits(result, firsts[0])):
                    results.append(None)
                else:
                    results.append(portable(result))
                firsts.append(result)
            out["runs"][(dp, path.name)] = {"tensors": results, "digests": digests}
    if plan.device == "cuda":
        out["nccl_version"] = ".".join(str(part) for part in torch.cuda.nccl.version())
    return out
