"""What runs in each rank of the cross-entropy-fusion lever: Megatron's own cross-entropy functions
on a tensor-parallel group of gloo ranks (correctness.distributed.run_ranks).

`run_jobs(rank, world_size, payload, device)` (the jobs pickled) initialises megatron-core's
parallel_state (no shim is needed: `initialize_model_parallel` builds its groups on the default
gloo group, and neither cross-entropy function touches CUDA on the CPU), once per TP size its jobs
ask for, and runs each job's calls on this rank's vocabulary shard, as Megatron's
`compute_language_model_loss` calls them:

- the fused ("native"): `fused_vocab_parallel_cross_entropy(logits, labels, tp_group)`;
- the unfused (the default): `vocab_parallel_cross_entropy(logits, labels)`, which finds its group
  in parallel_state;
- TE ("te", GPU only): Megatron's wrapper `te_parallel_cross_entropy(logits, labels, tp_group)`.

Each run takes a fresh copy of the shard (the functions subtract the max in place, and TE writes
its gradient into its input), computes the per-token loss and backpropagates the job's upstream
gradient. Every TP size the world divides runs in one start of ranks: at TP 1 each rank is a group of its own
(Megatron's TP groups of one rank, the rest data parallel) and the ranks share the TP 1 jobs; at
TP 2 both ranks run every TP 2 job. A rank returns its shard's outputs; the lever gathers them.
On a GPU the ranks share the GPUs there are (both on one, over gloo); a collective that gloo
refuses for CUDA tensors refuses the call (the case skips with gloo's reason).

Two deliberately wrong calls, for the negative controls:
- SHIFTED_LABELS: the labels rolled by one position along the sequence (a missed label shift);
- NO_MAX: Megatron's fused function with its max replaced by zeros (`max_subtraction_skipped`):
  the rest of its code runs unchanged, so exp overflows FP32 once the logits pass 88.7.

The FP32 probe: Megatron's fused backward casts the logits gradient to BF16 whatever the logits'
dtype (megatron/core/fusions/fused_cross_entropy.py, `calculate_gradients`); at BF16 logits autograd
would round it so anyway, which hides the cast. A job with `probe_positions` also runs each
unmutated call once on FP32 copies of its first positions (eagerly: a second dtype would cost the
compiler another graph), so that the record shows what the cast costs where it is not hidden.
"""

import contextlib
import importlib
import pickle
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

FUSED = "megatron.core.fusions.fused_cross_entropy:fused_vocab_parallel_cross_entropy"
UNFUSED = "megatron.core.tensor_parallel.cross_entropy:vocab_parallel_cross_entropy"
TE = "megatron.core.extensions.transformer_engine:te_parallel_cross_entropy"

SHIFTED_LABELS = "labels shifted one position"
NO_MAX = "max subtraction skipped"
MUTATIONS = (SHIFTED_LABELS, NO_MAX)


@dataclass(frozen=True)
class Call:
    """One cross-entropy function as a rank calls it: `function` names it ("module:attribute", so
    that a rank imports it by name), `takes_group` says whether it is called (logits, labels,
    tp_group) like the fused ones or (logits, labels) like the unfused one, and `mutation` is None
    or one of MUTATIONS."""

    function: str
    takes_group: bool
    mutation: str | None = None

    def __post_init__(self):
        if ":" not in self.function:
            raise ValueError(f"call: function must read 'module:attribute', got {self.function!r}")
        if self.mutation is not None and self.mutation not in MUTATIONS:
            raise ValueError(f"call: unknown mutation {self.mutation!r} (known: {', '.join(MUTATIONS)})")


@dataclass(frozen=True)
class Job:
    """One case's inputs at one TP size and the calls to make on them (each `runs` times)."""

    key: str
    tp: int
    logits: torch.Tensor  # [sequence, batch, tp x vocabulary slice]: the full vocabulary, on the CPU
    labels: torch.Tensor  # [sequence, batch] indices into the full vocabulary
    upstream: torch.Tensor  # [sequence, batch] FP32: dL/dloss per token
    calls: tuple[tuple[Call, int], ...]
    probe_positions: int = 0  # 0: no FP32 probe


def resolve(function: str) -> Any:
    module, _, attribute = function.partition(":")
    return getattr(importlib.import_module(module), attribute)


@contextlib.contextmanager
def max_subtraction_skipped() -> Iterator[None]:
    """Inside: Megatron's fused cross entropy (megatron.core.fusions.fused_cross_entropy, 0.16)
    takes 0 for every token's max, as a kernel that forgot the max subtraction would; the module
    global its forward looks up is restored on leaving."""
    from megatron.core.fusions import fused_cross_entropy

    saved = fused_cross_entropy.calculate_logits_max

    def zero_max(vocab_parallel_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = vocab_parallel_logits.float()
        return logits, torch.zeros(logits.shape[:-1], dtype=logits.dtype, device=logits.device)

    fused_cross_entropy.calculate_logits_max = zero_max
    try:
        yield
    finally:
        fused_cross_entropy.calculate_logits_max = saved


def fuser() -> str:
    """How Megatron's `jit_fuser` functions (the fused cross entropy's pieces) run in this process."""
    from megatron.core import jit

    if jit.jit_fuser is torch.compile:
        from torch import _dynamo

        if _dynamo.config.disable:
            return "eager (torch.compile disabled: TORCH_COMPILE_DISABLE)"
        return "torch.compile"
    if jit.jit_fuser is torch.jit.script:
        return "torch.jit.script"
    return "eager (Megatron's jit_fuser is a no-op)"


def versions(calls: set[Call]) -> dict[str, str]:
    import megatron.core

    found = {"megatron_core": str(getattr(megatron.core, "__version__", "unknown")), "jit_fuser": fuser()}
    if any(call.function == TE for call in calls):
        try:
            import transformer_engine

            found["transformer_engine"] = str(getattr(transformer_engine, "__version__", "unknown"))
        except Exception as error:  # reported as the call's refusal below
            found["transformer_engine"] = f"not usable: {type(error).__name__}"
    return found


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _refusal(call: Call, group: Any, device: torch.device) -> str | None:
    """Why this rank cannot make the call at all (its module does not import here, or gloo cannot
    gather CUDA tensors as TE's distributed path does), or None."""
    try:
        function = resolve(call.function)
    except (ImportError, AttributeError) as error:
        return f"{call.function} is not available here: {type(error).__name__}: {error}"
    if not callable(function):  # Megatron sets te_parallel_cross_entropy to None where TE is missing
        return f"{call.function} is not available here: it is {function!r} (is Transformer Engine installed?)"
    if device.type == "cuda" and group.size() > 1:  # gloo's support for CUDA tensors varies by collective
        collective = "all-gathers" if call.function == TE else "all-reduces"
        try:
            if call.function == TE:
                gathered = torch.zeros(group.size(), device=device)
                torch.distributed.all_gather_into_tensor(gathered, torch.ones(1, device=device), group=group)
            else:
                probe = torch.ones(1, device=device)
                torch.distributed.all_reduce(probe, op=torch.distributed.ReduceOp.MAX, group=group)
        except Exception as error:
            return (f"{call.function} {collective} CUDA tensors, which the gloo group of {group.size()} ranks here"
                    f" refuses: {type(error).__name__}: {error}")
    return None


def _one_run(call: Call, shard: torch.Tensor, labels: torch.Tensor, upstream: torch.Tensor, group: Any
             ) -> dict[str, Any]:
    function = resolve(call.function)
    logits = shard.detach().clone().requires_grad_()
    if call.mutation == SHIFTED_LABELS:
        labels = labels.roll(-1, dims=0)
    wrong_max = max_subtraction_skipped() if call.mutation == NO_MAX else contextlib.nullcontext()
    _synchronize(shard.device)
    start = time.perf_counter()
    with wrong_max:
        loss = function(logits, labels, group) if call.takes_group else function(logits, labels)
        loss.backward(upstream)
    _synchronize(shard.device)
    return {"loss": loss.detach().cpu(), "grad": logits.grad.cpu(), "seconds": time.perf_counter() - start}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    def bits(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.reshape(-1).view(torch.uint8)

    return all(a[name].dtype == b[name].dtype and torch.equal(bits(a[name]), bits(b[name]))
               for name in ("loss", "grad"))


def _run_job(job: Job, group: Any, tp_rank: int, device: torch.device) -> dict[Call, dict[str, Any]]:
    width = job.logits.shape[-1] // job.tp
    shard = job.logits[..., tp_rank * width : (tp_rank + 1) * width].contiguous().to(device)
    labels, upstream = job.labels.to(device), job.upstream.to(device)
    outcomes: dict[Call, dict[str, Any]] = {}
    for call, runs in job.calls:
        refusal = _refusal(call, group, device)
        if refusal is not None:
            outcomes[call] = {"unavailable": refusal}
            continue
        done: list[dict[str, Any]] = []
        for _ in range(runs):
            run = _one_run(call, shard, labels, upstream, group)
            if done and _same(run, done[0]):  # the same tensors once: pickling sends them once
                run = {**run, "loss": done[0]["loss"], "grad": done[0]["grad"]}
            done.append(run)
        outcome: dict[str, Any] = {"runs": done}
        if job.probe_positions and call.mutation is None:
            positions = min(job.probe_positions, shard.shape[0])
            with torch.compiler.set_stance("force_eager"):
                probe = _one_run(call, shard[:positions].float(), labels[:positions], upstream[:positions], group)
            outcome["probe"] = {"positions": positions, "grad": probe["grad"], "loss": probe["loss"]}
        outcomes[call] = outcome
    return outcomes


def run_jobs(rank: int, world_size: int, payload: bytes, device_type: str) -> bytes:
    """This rank's outputs of every job it takes part in, pickled: {"versions": ..., "jobs": {key:
    {"tp_rank": r, "calls": {Call: {"runs": [...], "probe": ...} or {"unavailable": reason}}}}}.

    Jobs arrive and results leave as plain pickled bytes (`pickle.dumps(jobs)`): through the pipe,
    where torch's own pickling of tensors would put them in shared memory, which a container's
    /dev/shm (often 64 MB) may not hold."""
    jobs: tuple[Job, ...] = pickle.loads(payload)
    device = torch.device(device_type)
    if device.type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        torch.set_flush_denormal(True)  # as the harness does on the CPU (correctness.harness._cpu_settings)
    from megatron.core import parallel_state

    results: dict[str, Any] = {}
    for tp in sorted({job.tp for job in jobs}):
        if world_size % tp:
            raise ValueError(f"TP {tp} does not divide the {world_size} ranks")
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        try:
            group = parallel_state.get_tensor_model_parallel_group()
            tp_rank = parallel_state.get_tensor_model_parallel_rank()
            sized = [job for job in jobs if job.tp == tp]
            for job in sized[rank // tp :: world_size // tp]:  # each TP group takes its share
                results[job.key] = {"tp_rank": tp_rank, "calls": _run_job(job, group, tp_rank, device)}
        finally:
            parallel_state.destroy_model_parallel()
    return pickle.dumps({"versions": versions({call for job in jobs for call, _ in job.calls}), "jobs": results})
