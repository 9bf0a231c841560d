"""The cross-entropy-fusion lever (`--cross-entropy-loss-fusion`, `--cross-entropy-fusion-impl`):
the per-token loss and the logits gradient of a fused vocab-parallel cross entropy against
Megatron's unfused `vocab_parallel_cross_entropy` (the default: no fusion) and an FP64 cross
entropy over the full vocabulary (references/vocab_parallel_cross_entropy.py), at TP 1 and TP 2.

The candidate is what the flags select in Megatron's `compute_language_model_loss` (megatron-core
0.16): impl `native`, `fused_vocab_parallel_cross_entropy` (its pieces under Megatron's
`jit_fuser`, torch.compile; TORCH_COMPILE_DISABLE=1 runs them eagerly and the record says so); impl
`te`, TE's `parallel_cross_entropy` through Megatron's wrapper (GPU only). Every Megatron path
runs in gloo ranks (correctness.cross_entropy.ranks): at TP 2 the all-reduces of the max,
of the sum of exponentials and of the label's logit are part of what is tested.

Judged per case: `loss`, the per-token loss [sequence, batch] in FP32 (every rank computes it; the
ranks must agree bit for bit, else the case fails), and `grad_logits_rank<r>`, the gradient each TP
rank holds for its vocabulary shard, in the logits' dtype, judged shard by shard so that an error
confined to one rank's shard (its vocabulary offset, its target mask) is not diluted by the other.

Shapes: each rank's vocabulary slice is the model's vocabulary over the recipe's TP (at TP t the
cases' full vocabulary is t slices, so that every rank works on the recipe's slice), the sequence
and batch are the recipe's row tokens and rows per microbatch; the smoke scale divides both down.
The GPU tiers run at the one-GPU scale ("one-gpu"): the recipe's vocabulary slice and rows, with
the row tokens cut (to a multiple of ROW_TOKEN_STEP) until a case's logits, all its TP ranks'
together, are at most ONE_GPU_LOGITS. At the recipe's own scale Gemma's TP 2 cases hold 8,192 x
262,144 BF16 logits (4.3 GB), made on the host and pickled to each of two spawned ranks per case,
which a one-GPU run of ten minutes cannot afford; at this scale all four cases share one start of
ranks (GPU_TIMEOUT), and each shape's id states its sequence.
The upstream gradient is the loss mask (supervised with the recipe's dataset ratio): per-token loss
summed under it, as `--calculate-per-token-loss` does.

Inputs (seeded): model-like logits (standard normal x LOGIT_STD, the label's logit raised by
LABEL_MARGIN, as the packed-loss lever), and the same offset by LARGE_OFFSET, past exp's FP32
overflow (88.7): softmax does not change, and a path without the max subtraction overflows.
Negative controls: the labels off by one position, and Megatron's fused function with the max
subtraction skipped (on the large logits only: below the overflow it changes nothing but rounding);
its Inf and NaN fail it, and the record names them.

The fused backward casts the gradient to BF16 whatever the logits' dtype; at BF16 logits that is
invisible. Each case probes it: the candidate and the default also run on FP32 copies of the
logits (the first PROBE_POSITIONS positions), and the case's summary records their gradient errors
against FP64 and whether the candidate's gradient is BF16-representable.
"""

import collections
import pickle
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from correctness import tiers
from correctness.shapes import DTYPES
from correctness.compare import bitwise_equal
from correctness.cross_entropy.ranks import FUSED, NO_MAX, SHIFTED_LABELS, TE, UNFUSED, Call, Job, run_jobs
from correctness.distributed import DEFAULT_TIMEOUT, DistributedError, run_ranks
from correctness.errors import PathUnavailable
from correctness.lever import Case, Control, Lever, LeverOptions, NotApplicable, PathOutput, Tier
from correctness.models import ModelFacts, facts_for
from correctness.recipes import Recipe, lever_recipe
from correctness.rule import DEFAULT_RULE
from references.vocab_parallel_cross_entropy import vocab_parallel_cross_entropy

NAME = "cross-entropy-fusion"
VERSION = 1
TP_SIZES = (1, 2)
LOGIT_STD = 2.0
LABEL_MARGIN = 3.0
LARGE_OFFSET = 100.0
FP32_EXP_OVERFLOW = 88.72  # log(FP32 max): exp of a larger logit is Inf
VARIANTS = (("learned-logits", 0, 0.0), ("large-logits", 1, LARGE_OFFSET))  # variant, seed, offset
SMOKE = {"row_tokens": 256, "vocab_slice": 4096}
PROBE_POSITIONS = 512
GPU_TIMEOUT = 300.0  # seconds for the GPU tiers' ranks (every case, one start), compilation included
ONE_GPU_LOGITS = 2**28  # a case's logits at the one-GPU scale, at most (512 MiB in BF16)
ROW_TOKEN_STEP = 128


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


def make_tensors(shape: CrossEntropyShape, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits [s, b, V] in the recipe's dtype, labels [s, b], upstream gradient [s, b] FP32), on the CPU."""
    generator = torch.Generator().manual_seed(seed)
    size = (shape.seq_len, shape.batch)
    labels = torch.randint(shape.vocab, size, generator=generator)
    logits = LOGIT_STD * torch.randn(*size, shape.vocab, generator=generator)
    logits.scatter_add_(-1, labels.unsqueeze(-1), torch.full((*size, 1), LABEL_MARGIN))
    logits += shape.logit_offset
    upstream = (torch.rand(size, generator=generator) < shape.supervised_ratio).float()
    return logits.to(DTYPES[shape.dtype]), labels, upstream


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
        runs = queue[0] if isinstance(queue[0], PathUnavailable) else queue.popleft()
        if isinstance(runs, PathUnavailable):
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
                                         cuda=self.device == "cuda")]
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
                    queue.append(PathUnavailable(refusals[0]))
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

    def run(self, inputs: CrossEntropyInputs) -> PathOutput:
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
        return PathOutput(tensors=tensors, backend=backend, details=details)


@dataclass(frozen=True)
class Fp64CrossEntropy:
    name: str = "fp64-cross-entropy"

    def run(self, inputs: CrossEntropyInputs) -> PathOutput:
        loss, grads = vocab_parallel_cross_entropy(inputs.shards(), inputs.labels, inputs.upstream)
        tensors = {"loss": loss, **{f"grad_logits_rank{rank}": grad for rank, grad in enumerate(grads)}}
        return PathOutput(tensors=tensors, backend=self.name)


NATIVE = MegatronPath("megatron-fused-native", Call(FUSED, takes_group=True), "megatron-fused-native")
TE_PATH = MegatronPath("te-parallel-cross-entropy", Call(TE, takes_group=True), "te-parallel-cross-entropy")
UNFUSED_PATH = MegatronPath("megatron-vocab-parallel", Call(UNFUSED, takes_group=False), "megatron-vocab-parallel")
NO_MAX_PATH = MegatronPath("megatron-fused-native (max subtraction skipped)", Call(FUSED, True, NO_MAX),
                           "megatron-fused-native")


def shifted(candidate: MegatronPath) -> MegatronPath:
    return MegatronPath(f"{candidate.name} ({SHIFTED_LABELS})", replace(candidate.call, mutation=SHIFTED_LABELS),
                        candidate.label)


def overflow_inapplicable(case: Case) -> str | None:
    if case.shape.logit_offset > FP32_EXP_OVERFLOW:
        return None
    return (f"the logits stay far below exp's FP32 overflow ({FP32_EXP_OVERFLOW:g}): without the max subtraction"
            f" only the rounding changes")


def one_gpu_row_tokens(recipe: Recipe, vocab: int) -> int:
    """The recipe's row tokens, cut to a multiple of ROW_TOKEN_STEP (one step at least) so that a
    case's logits over `vocab` (the full vocabulary of its TP group) are at most ONE_GPU_LOGITS."""
    fitting = ONE_GPU_LOGITS // (recipe.rows_per_microbatch * vocab) // ROW_TOKEN_STEP * ROW_TOKEN_STEP
    return min(recipe.row_tokens, max(ROW_TOKEN_STEP, fitting))


def cross_entropy_shape(recipe: Recipe, model: ModelFacts, scale: str, tp: int, offset: float) -> CrossEntropyShape:
    """`scale`: "recipe", "one-gpu" (the GPU tiers': the module's docstring) or "smoke"."""
    slice_ = int(model.field("vocab_size")) // recipe.tp
    if scale == "one-gpu":  # every TP size at the largest one's sequence: one compiled shape per rank
        sizes = {"row_tokens": one_gpu_row_tokens(recipe, max(TP_SIZES) * slice_), "vocab_slice": slice_}
    else:
        sizes = {"row_tokens": recipe.row_tokens, "vocab_slice": slice_} if scale == "recipe" else SMOKE
    softcap = model.data.get("final_logit_softcap")
    return CrossEntropyShape(
        model=model.short_name, scale=scale, tp=tp, recipe_tp=recipe.tp, seq_len=sizes["row_tokens"],
        batch=recipe.rows_per_microbatch, vocab_slice=sizes["vocab_slice"], dtype=recipe.precision,
        supervised_ratio=float(recipe.field("workload.dataset.build.supervised_token_ratio")),
        logit_offset=offset, final_logit_softcap=None if softcap is None else float(softcap),
    )


# Peak bytes per logit (row tokens x the full vocabulary), the lever's process and its ranks
# together: the FP32 draws and the inputs, each rank's slice and its gradient, every path's
# gradients (the FP32 probe's too), and the FP64 reference's logits, softmax and gradient over the
# full vocabulary. Measured at 2,048 x 16,384 logits on the CPU: about 118 bytes a logit in the
# lever's process and 36 in its rank's.
LOGIT_BYTES = 160


def cross_entropy_memory(shape: CrossEntropyShape) -> int:
    """A case's estimated peak bytes, all its ranks together: LOGIT_BYTES per logit."""
    return LOGIT_BYTES * shape.seq_len * shape.batch * shape.vocab


def cross_entropy_driver(shape: CrossEntropyShape) -> str:
    return f"row_tokens {shape.seq_len} x {shape.batch} rows x vocabulary {shape.vocab} logits"


def describe(candidate: MegatronPath) -> str:
    te = candidate.call.function == TE
    what = "TE's parallel cross entropy" if te else "Megatron's fused vocab-parallel cross entropy"
    return (f"cross-entropy fusion: {what} against the unfused vocab-parallel one and FP64 over the full vocabulary,"
            f" per-token loss and logits gradient at TP {' and '.join(map(str, TP_SIZES))}")


def cross_entropy_lever(recipe: Recipe, *, tier: Tier, scale: str, options: LeverOptions,
                        candidate: MegatronPath = NATIVE, shared_session: bool = True) -> Lever:
    """The lever of every tier; `shared_session`: one start of ranks for all its cases (else one per case)."""
    model = facts_for(recipe, options.model)
    timeout = DEFAULT_TIMEOUT if tier.device == "cpu" else GPU_TIMEOUT
    controls = (
        Control(name="labels off by one position", path=shifted(candidate)),
        Control(name="max subtraction skipped", path=NO_MAX_PATH, why_inapplicable=overflow_inapplicable),
    )
    session = RankSession(tier.device, timeout) if shared_session else None
    cases = []
    for tp in TP_SIZES:
        for variant, seed, offset in VARIANTS:
            shape = cross_entropy_shape(recipe, model, scale, tp, offset)
            key = f"{shape.id}-seed{seed}"
            case_session = session or RankSession(tier.device, timeout)

            def make_inputs(device, shape=shape, seed=seed, key=key, case_session=case_session):
                logits, labels, upstream = make_tensors(shape, seed)
                return CrossEntropyInputs(shape=shape, key=key, logits=logits.to(device), labels=labels.to(device),
                                          upstream=upstream.to(device), session=case_session)

            case = Case(id=key, shape=shape, seed=seed, source="synthetic", variant=variant, make_inputs=make_inputs,
                        memory_bytes=cross_entropy_memory(shape), memory_driver=cross_entropy_driver(shape))
            calls = ((candidate.call, 2), (UNFUSED_PATH.call, 2)) + tuple(
                (control.path.call, 1) for control in controls if control.why_inapplicable(case) is None
            )
            case_session.plan(key, make_inputs, calls)
            cases.append(case)
    return Lever(
        name=NAME, version=VERSION, tier=tier, description=describe(candidate), recipe=recipe.ref_for(model),
        cases=tuple(cases), candidate=candidate, default=UNFUSED_PATH, reference=Fp64CrossEntropy(),
        controls=controls, summarize=summarize,  # the rule is DEFAULT_RULE, as summarize assumes
    )


def summarize(result: Any) -> dict[str, Any]:
    """The FP32 probe of the case (the fused backward's BF16 cast, hidden at BF16 logits): both
    paths' errors at FP32 logits, and where the candidate's gradient would sit against the rule's
    bound there (informational: the recipe's logits are not FP32)."""
    candidate = result.candidate.run.details.get("fp32_logits_probe") if result.candidate else None
    default = result.default.details.get("fp32_logits_probe") if result.default else None
    if candidate is None or default is None:
        return {}
    bound = DEFAULT_RULE.bound(default["grad_error"])
    return {"fp32_logits_probe": {
        "positions": candidate["positions"],
        "candidate_grad_error": candidate["grad_error"], "default_grad_error": default["grad_error"],
        "candidate_grad_error_over_bound": candidate["grad_error"] / bound,
        "candidate_grad_is_bf16": candidate["grad_is_bf16"], "default_grad_is_bf16": default["grad_is_bf16"],
        "candidate_loss_error": candidate["loss_error"], "default_loss_error": default["loss_error"],
    }}


def fusion_impl(recipe: Recipe) -> str | None:
    """The fused implementation the recipe selects ("native", Megatron's default, or "te"), or None
    where it does not fuse the loss (the lever then measures what turning the fusion on would do)."""
    if recipe.argument("--cross-entropy-loss-fusion") is None:
        return None
    impl = recipe.argument("--cross-entropy-fusion-impl")
    return impl[0] if impl else "native"


def _runs_impl(recipe: Recipe, impl: str) -> None:
    chosen = fusion_impl(recipe)
    if chosen not in (None, impl):
        raise NotApplicable(f"recipe {recipe.id} fuses its cross entropy with impl {chosen!r}; this tier runs {impl!r}")


def cpu_tier(recipe_id: str, options: LeverOptions, candidate: MegatronPath = NATIVE) -> list[Lever]:
    """Megatron's native fused cross entropy (or `candidate`: any function called as the fused one,
    by its import path) on the CPU: gloo ranks, smoke scale, one start of ranks for all cases."""
    recipe = lever_recipe(recipe_id, options.recipe)
    _runs_impl(recipe, "native")
    return [cross_entropy_lever(recipe, tier=tiers.MEGATRON_CPU, scale="smoke", options=options, candidate=candidate)]


def megatron_gpu_tier(recipe_id: str, options: LeverOptions) -> list[Lever]:
    """Megatron's native fused cross entropy on a CUDA GPU (its jit_fuser compiles Triton kernels),
    at the one-GPU scale (the module's docstring); both ranks on one GPU over gloo, one start of
    ranks for every case."""
    recipe = lever_recipe(recipe_id, options.recipe)
    _runs_impl(recipe, "native")
    return [cross_entropy_lever(recipe, tier=tiers.MEGATRON_GPU, scale="one-gpu", options=options)]


def recipe_gpu_tier(recipe_id: str, options: LeverOptions) -> list[Lever]:
    """TE's parallel cross entropy (impl `te`) on the recipe's GPU, at the one-GPU scale; the
    default is still Megatron's unfused function, so the tier needs megatron-core too."""
    recipe = lever_recipe(recipe_id, options.recipe)
    _runs_impl(recipe, "te")
    tier = tiers.recipe_gpu_tier(recipe.gpu)
    tier = replace(tier, markers=(*tier.markers, "megatron"))
    return [cross_entropy_lever(recipe, tier=tier, scale="one-gpu", options=options, candidate=TE_PATH)]
