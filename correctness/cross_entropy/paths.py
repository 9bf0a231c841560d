"""The cross-entropy-fusion lever's paths and what runs them (the lever's declaration, its shapes,
cases, controls and tiers: correctness.cross_entropy.lever).

- `MegatronPath`: a cross-entropy function of Megatron's (or TE's, through Megatron's wrapper) run
  in gloo ranks (correctness.cross_entropy.ranks) of the case's TP group: `NATIVE` (impl `native`,
  `fused_vocab_parallel_cross_entropy`), `TE_PATH` (impl `te`), `UNFUSED_PATH` (the default,
  `vocab_parallel_cross_entropy`), `NO_MAX_PATH` and `shifted` (the negative controls' mutations).
- `RankSession`: one start of ranks for a group of cases, each planned call run as often as the
  harness asks for it, and the FP32 probe's figures (`probe_figures`).
- `Fp64CrossEntropy`: the reference, FP64 over the full vocabulary
  (references/vocab_parallel_cross_entropy.py).

`CrossEntropyShape` and `CrossEntropyInputs` are what every path runs on: a case's shape (its id,
its record) and its tensors with the session that holds its ranks' outputs.
"""

import collections
import pickle
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from correctness.compare import bitwise_equal
from correctness.cross_entropy.ranks import FUSED, NO_MAX, SHIFTED_LABELS, TE, UNFUSED, Call, Job, run_jobs
from correctness.distributed import DistributedError, run_ranks
from correctness.errors import ImplementationUnavailable
from correctness.lever import ImplementationOutput
from references.vocab_parallel_cross_entropy import vocab_parallel_cross_entropy

PROBE_POSITIONS = 512


@dataclass(frozen=True, kw_only=True)
class CrossEntropyShape:
    model: str
    scale: str
    tp: int  # the TP size of this case's group
    recipe_tp: int
    seq_len: int
    batch: int
    vocab_slice: int  # one rank's shard of the vocabulary
    dtype: str
    supervised_ratio: float
    logit_offset: float
    final_logit_softcap: float | None  # the model's, where it has one: its logits stay within it

    @property
    def vocab(self) -> int:
        return self.tp * self.vocab_slice

    @property
    def id(self) -> str:
        offset = f"-offset{self.logit_offset:g}" if self.logit_offset else ""
        sizes = f"{self.seq_len}x{self.batch}-v{self.tp}x{self.vocab_slice}"
        return f"{self.model}-ce-tp{self.tp}-{sizes}-{self.dtype}{offset}"

    def record(self) -> dict[str, Any]:
        return {"id": self.id, "vocab": self.vocab, **asdict(self)}


@dataclass(frozen=True, kw_only=True)
class CrossEntropyInputs:
    shape: CrossEntropyShape
    key: str  # the case's id: its outputs in the session
    logits: torch.Tensor  # [sequence, batch, full vocabulary], the recipe's dtype
    labels: torch.Tensor  # [sequence, batch]
    upstream: torch.Tensor  # [sequence, batch] FP32
    session: "RankSession"

    def shards(self) -> list[torch.Tensor]:
        return list(self.logits.split(self.shape.vocab_slice, dim=-1))

    def job(self, calls: tuple[tuple[Call, int], ...], probe: bool) -> Job:
        return Job(key=self.key, tp=self.shape.tp, logits=self.logits.cpu(), labels=self.labels.cpu(),
                   upstream=self.upstream.cpu(), calls=calls, probe_positions=PROBE_POSITIONS if probe else 0)


@dataclass
class _Planned:
    make_inputs: Callable[[torch.device], CrossEntropyInputs]
    calls: tuple[tuple[Call, int], ...]


class RankSession:
    """Megatron's runs for a group of cases, made in one start of gloo ranks when the first of
    them is asked for (a start costs seconds of compilation in the ranks; every tier shares one
    among all its cases, as the GPU tiers' one-GPU scale allows). Each planned call runs as often as the
    harness asks for it (the candidate and the default twice: the repeat and the positive control);
    a path asked once more than planned gets a start of its own. The inputs a case's harness made
    are checked to be the ones its ranks saw."""

    def __init__(self, device: str, timeout: float):
        self.device = device
        self.timeout = timeout
        self._planned: dict[str, _Planned] = {}
        self._seen: dict[str, tuple[torch.Tensor, ...]] = {}
        self._outputs: dict[str, dict[Call, collections.deque]] = {}
        self._probes: dict[tuple[str, Call], dict[int, Any]] = {}  # {tp rank: its probe outputs}
        self._probe_figures: dict[tuple[str, Call], dict[str, Any]] = {}
        self._failed: dict[str, str] = {}
        self.versions: dict[str, str] = {}

    def plan(self, key: str, make_inputs: Callable[[torch.device], CrossEntropyInputs],
             calls: tuple[tuple[Call, int], ...]) -> None:
        runs: dict[Call, int] = {}
        for call, count in calls:
            runs[call] = runs.get(call, 0) + count
        self._planned[key] = _Planned(make_inputs=make_inputs, calls=tuple(runs.items()))

    def take(self, inputs: CrossEntropyInputs, call: Call) -> tuple[dict[int, dict[str, Any]], dict[str, Any] | None]:
        """The next run of `call` on the case ({tp rank: its outputs}) and the figures of the call's
        FP32 probe (None for a mutated call)."""
        if inputs.key in self._failed:
            raise DistributedError(self._failed[inputs.key])
        if inputs.key in self._planned:
            self._run_planned(inputs)
        queue = self._outputs.setdefault(inputs.key, {}).get(call)
        if not queue:
            self._run((inputs.job(((call, 1),), probe=call.mutation is None),))
            queue = self._outputs[inputs.key][call]
        self._check_inputs(inputs)
        runs = queue[0] if isinstance(queue[0], ImplementationUnavailable) else queue.popleft()
        if isinstance(runs, ImplementationUnavailable):
            raise runs
        probe = self._probes.pop((inputs.key, call), None)  # its tensors, reduced to figures once
        if probe is not None:
            self._probe_figures[(inputs.key, call)] = probe_figures(inputs, probe)
        return runs, self._probe_figures.get((inputs.key, call))

    def _run_planned(self, inputs: CrossEntropyInputs) -> None:
        jobs = []
        for key, planned in list(self._planned.items()):
            if key == inputs.key:
                made = inputs
            else:  # the same seeded inputs its case will make (checked when it runs)
                made = planned.make_inputs(torch.device("cpu"))
                self._seen[key] = (made.logits, made.labels, made.upstream)
            jobs.append(made.job(planned.calls, probe=True))
        self._planned.clear()
        try:
            self._run(tuple(jobs))
        except DistributedError as error:
            self._failed.update((job.key, str(error)) for job in jobs if job.key != inputs.key)
            raise

    def _check_inputs(self, inputs: CrossEntropyInputs) -> None:
        seen = self._seen.pop(inputs.key, None)
        if seen is None:
            return
        ours = (inputs.logits, inputs.labels, inputs.upstream)
        for name, theirs, mine in zip(("logits", "labels", "upstream"), seen, ours):
            if not bitwise_equal(theirs, mine.cpu()):
                raise ValueError(f"case {inputs.key}: its {name} are not those its ranks ran on"
                                 " (seeded inputs must repeat)")

    def _run(self, jobs: tuple[Job, ...]) -> None:
        world = max(job.tp for job in jobs)
        results = [pickle.loads(result) for result in
                   run_ranks(run_jobs, world, pickle.dumps(jobs), self.device, timeout=self.timeout,
                             cuda=self.device == "cuda", compiles=True)]
        self.versions = results[0]["versions"]
        for job in jobs:
            per_rank = [result["jobs"][job.key] for result in results if job.key in result["jobs"]]
            if sorted(part["tp_rank"] for part in per_rank) != list(range(job.tp)):
                raise DistributedError(f"case {job.key}: the ranks returned TP ranks"
                                       f" {sorted(part['tp_rank'] for part in per_rank)}, not 0..{job.tp - 1}")
            for call, runs in job.calls:
                outcomes = {part["tp_rank"]: part["calls"][call] for part in per_rank}
                refusals = [outcome["unavailable"] for outcome in outcomes.values() if "unavailable" in outcome]
                queue = self._outputs.setdefault(job.key, {}).setdefault(call, collections.deque())
                if refusals:
                    queue.append(ImplementationUnavailable(refusals[0]))
                    continue
                queue.extend({rank: outcomes[rank]["runs"][index] for rank in outcomes} for index in range(runs))
                if all("probe" in outcome for outcome in outcomes.values()):
                    self._probes[(job.key, call)] = {rank: outcome["probe"] for rank, outcome in outcomes.items()}


def _relative(x: torch.Tensor, reference: torch.Tensor) -> float:
    return float((x.double() - reference).norm() / reference.norm())


def probe_figures(inputs: CrossEntropyInputs, probe: dict[int, Any]) -> dict[str, Any]:
    """The FP32 probe's figures: the gradient's and the loss's errors against FP64 on the probe's
    positions, and whether every gradient element is a BF16 value (the fused backward's cast)."""
    positions = probe[0]["positions"]
    shards = [shard[:positions].float() for shard in inputs.shards()]
    loss, grads = vocab_parallel_cross_entropy(shards, inputs.labels[:positions], inputs.upstream[:positions])
    grad = torch.cat([probe[rank]["grad"] for rank in sorted(probe)], dim=-1)
    reference = torch.cat(grads, dim=-1).cpu()
    return {
        "positions": positions,
        "logits_dtype": "float32",
        "grad_error": _relative(grad, reference),
        "loss_error": _relative(probe[0]["loss"], loss.cpu()),
        "grad_is_bf16": bool(torch.equal(grad, grad.to(torch.bfloat16).float())),
    }


@dataclass(frozen=True)
class MegatronPath:
    """A cross-entropy function run in the session's ranks (ranks.Call); `label` names what runs,
    the compiler or eager mode following in parentheses."""

    name: str
    call: Call
    label: str

    def run(self, inputs: CrossEntropyInputs) -> ImplementationOutput:
        runs, probe = inputs.session.take(inputs, self.call)
        ranks = sorted(runs)
        loss = runs[ranks[0]]["loss"]
        for rank in ranks[1:]:
            if not bitwise_equal(runs[rank]["loss"], loss):
                differ = int((runs[rank]["loss"] != loss).sum())
                raise ValueError(f"TP ranks 0 and {rank} disagree on the loss at {differ} of {loss.numel()} tokens")
        device = inputs.logits.device
        tensors = {"loss": loss.to(device)}
        tensors.update((f"grad_logits_rank{rank}", runs[rank]["grad"].to(device)) for rank in ranks)
        versions = inputs.session.versions
        details: dict[str, Any] = {
            "function": self.call.function, "tp": inputs.shape.tp, "process_group": "gloo",
            "rank_seconds": max(run["seconds"] for run in runs.values()),
            "megatron_core": versions.get("megatron_core"),
        }
        fused_detail = versions.get("jit_fuser") if self.call.function == FUSED else None
        if fused_detail:
            details["jit_fuser"] = fused_detail
        if self.call.function == TE:
            details["transformer_engine"] = versions.get("transformer_engine")
        if probe is not None:
            details["fp32_logits_probe"] = probe
        backend = f"{self.label} ({fused_detail})" if fused_detail else self.label
        if self.call.mutation:
            backend = f"{backend} (mutated: {self.call.mutation})"
            details["mutation"] = self.call.mutation
        return ImplementationOutput(tensors=tensors, backend=backend, details=details)


@dataclass(frozen=True)
class Fp64CrossEntropy:
    name: str = "fp64-cross-entropy"

    def run(self, inputs: CrossEntropyInputs) -> ImplementationOutput:
        loss, grads = vocab_parallel_cross_entropy(inputs.shards(), inputs.labels, inputs.upstream)
        tensors = {"loss": loss, **{f"grad_logits_rank{rank}": grad for rank, grad in enumerate(grads)}}
        return ImplementationOutput(tensors=tensors, backend=self.name)


NATIVE = MegatronPath("megatron-fused-native", Call(FUSED, takes_group=True), "megatron-fused-native")
TE_PATH = MegatronPath("te-parallel-cross-entropy", Call(TE, takes_group=True), "te-parallel-cross-entropy")
UNFUSED_PATH = MegatronPath("megatron-vocab-parallel", Call(UNFUSED, takes_group=False), "megatron-vocab-parallel")
NO_MAX_PATH = MegatronPath("megatron-fused-native (max subtraction skipped)", Call(FUSED, True, NO_MAX),
                           "megatron-fused-native")


def shifted(candidate: MegatronPath) -> MegatronPath:
    return MegatronPath(f"{candidate.name} ({SHIFTED_LABELS})", replace(candidate.call, mutation=SHIFTED_LABELS),
                        candidate.label)
