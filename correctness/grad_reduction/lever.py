"""The gradient-reduction-dtype lever: Megatron's data-parallel gradient reduction in BF16
(`--grad-reduce-in-bf16`: DDP's grad_reduce_in_fp32 off, a BF16 grad buffer) against FP32
(`--accumulate-allreduce-grads-in-fp32`, Megatron-LM's default for BF16 training), and the FP64
sum of the ranks' FP32 gradients.

Each rank holds its own seeded FP32 gradient of one TP rank's slice of the model's first layer
(correctness.grad_reduction.plan); the ranks reduce them through megatron-core's own DDP classes
(correctness.grad_reduction.megatron_sync: its grad buffer in the reduction dtype, its pre-scaling,
reduce-scatter with the distributed optimizer, else all-reduce), over DP 2, 4 and 8 and the recipe's
own DP size where it is 1 or at most 8. The CPU tier runs torch.distributed on gloo ranks forked
from a server that imported torch and megatron-core once (correctness.distributed); the GPU tier
NCCL, one GPU per rank, in spawned ranks. Without megatron-core the paths refuse (a skip). One run
of max(DP) ranks computes every path: subgroups of ranks 0 .. DP-1 reduce at each DP size, and
each rank runs the candidate twice, the default twice and the control once, so that a case starts
its ranks once. The paths then read their runs from that one run, in the order the harness
asks for them; its time is counted on the first path that asks (the candidate).

Judged tensors: each parameter's reduced gradient at each DP size, "dp<N>/<Megatron name>", in
FP32 (the BF16 result upcast, exactly, as the distributed optimizer's FP32 main grad gets it).
Secondary reference (recorded, not judged): the FP64 sum of the gradients rounded to BF16, which
separates the collective's own rounding from the rounding of the gradients into the BF16 buffer.

Format floor (BF16, `BF16_FLOOR`): the FP64 sum with each rank's scaled gradient rounded to BF16
once (as it enters the BF16 buffer) and the sum rounded to BF16 once (as the buffer holds it),
otherwise exact. The ring's rounding of every partial sum at every hop is not in the floor: BF16
does not force it (megatron-core's own reduce_scatter_with_fp32_accumulation, an all-to-all of the
BF16 shards summed in FP32 and rounded once, avoids it), so it is the candidate's, judged against
the floor (docs/levers/gradient-reduction-dtype.md).

Negative control: the candidate with one rank's gradient dropped from the sum (in each DP group
the rank with the smallest gradients, the hardest one to miss; at DP 1 the only rank, whose
gradient then never reaches the buffer). Wrong BF16 reductions: correctness.grad_reduction.wrong.
"""

import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from correctness import tiers
from correctness.distributed import run_ranks
from correctness.errors import require_megatron_core
from correctness.evidence import UPSTREAM, Evidence
from correctness.lever import Case, Control, FormatFloor, Lever, LeverOptions, NotApplicable, ImplementationOutput, Tier
from correctness.lever_spec import DATA_PARALLEL, DEFAULT_READS, GRADIENT_SYNC, LeverSpec, TierTest
from correctness.models import facts_for
from correctness.megatron.layout import RECIPE, SMOKE, ParamScale, param_slices
from correctness.provenance import megatron_core_version
from correctness.recipes import Recipe, lever_recipe
from correctness.grad_reduction.plan import (
    DP_SIZES,
    DTYPE_PATHS,
    RankPath,
    MAX_RANKS,
    ReductionPlan,
    digest,
    draw_plan,
    plan_record,
    rank_gradients,
    tensor_name,
    unpack,
)
from correctness.grad_reduction.ranks import from_portable, reduce_on_ranks
from correctness.results import CaseResult
from references.gradient_sum import fp64_sum
from references.rounding import round_to_nearest

NAME = "gradient-reduction-dtype"
VERSION = 2  # 2: the BF16 format floor; the control drops the only rank at DP 1
SEEDS = (0,)
LAYER = 0  # the model's first layer: its tensors (one TP rank's slices) are the buffer
TP_RANK = 0
EP_RANK = 0
TIMEOUT = 240.0  # seconds for a case's ranks, start-up included
ONE_GPU_PER_RANK = "one GPU per NCCL rank"
# On an emulated GPU each NCCL rank is a spawned process that imports torch and enters the emulation
# (about 4 s of CPU): DP 2 runs the GPU path's code (NCCL subgroups through gloo, a device per rank,
# the collective on GPU tensors) as DP 4 and 8 do, at a quarter of the start-ups of DP 8.
EMULATED_RANKS = 2
EMULATED_BECAUSE = (f"an emulated GPU runs at most {EMULATED_RANKS} NCCL ranks (each a process of its own: the"
                    " code path, not the numbers at larger DP)")
DESCRIPTION = (
    "the data-parallel gradient reduction in BF16 against FP32 and an FP64 sum of the ranks' gradients,"
    " over 2, 4 and 8 ranks"
)
# Arguments that make Megatron-LM build the distributed optimizer (reduce-scatter): the precision-aware
# optimizer requires it, and the CPU offload requires the precision-aware optimizer.
DISTRIBUTED_OPTIMIZER_FLAGS = ("--use-distributed-optimizer", "--use-precision-aware-optimizer", "--optimizer-cpu-offload")


@dataclass(frozen=True, kw_only=True)
class ReductionShape:
    model: str
    scale: str
    tp_size: int
    tp_rank: int
    layer: int
    layer_kind: str
    tensors: tuple[tuple[str, tuple[int, ...]], ...]
    parameters: int  # per rank
    recipe_dp: int
    dp_sizes: tuple[int, ...]
    collective: str
    collective_because: str
    per_token_loss: bool
    recipe_reduces_in: str  # "fp32" or "bf16": what the recipe itself runs
    backend: str  # "gloo" or "nccl"
    notes: tuple[str, ...] = ()

    @property
    def id(self) -> str:
        dps = "+".join(str(dp) for dp in self.dp_sizes)
        return f"{self.model}-tp{self.tp_size}r{self.tp_rank}-layer{self.layer}-{self.scale}-dp{dps}-{self.collective}"

    def record(self) -> dict[str, Any]:
        fields = asdict(self)
        fields["tensors"] = [{"name": name, "shape": list(shape)} for name, shape in self.tensors]
        return {"id": self.id, **fields}


@dataclass(eq=False, kw_only=True)
class ReductionInputs:
    """A case's inputs: its plan, the ranks' gradients (drawn here again for the reference), and
    the one distributed run every path reads its results from (made when the first path asks)."""

    shape: ReductionShape
    plan: ReductionPlan
    rank_function: Callable[..., dict[str, Any]] = reduce_on_ranks  # module-level: the ranks import it
    timeout: float = TIMEOUT
    _gradients: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    _runs: dict[str, list[dict[str, torch.Tensor]]] | None = None
    _details: dict[str, Any] = field(default_factory=dict)
    _taken: Counter = field(default_factory=Counter)

    def gradients(self, rank: int) -> dict[str, torch.Tensor]:
        if rank not in self._gradients:
            self._gradients[rank] = rank_gradients(self.plan, rank)
        return self._gradients[rank]

    def take(self, path: str, rank_path: RankPath | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any], bool]:
        """The next run of `path` (candidate, default, control), the run's details, and whether this
        call made a distributed run. A path the plan does not carry (a wrong implementation's,
        `rank_path`) gets a distributed run of its own when it first asks."""
        made = self._runs is None
        if made:
            self._runs = self._distributed_run(self.plan)
        if path not in self._runs and rank_path is not None and rank_path.name == path:
            self._runs.update(self._distributed_run(replace(self.plan, paths=(rank_path,))))
            made = True
        runs = self._runs[path]
        index = self._taken[path]
        if index >= len(runs):
            raise RuntimeError(f"path {path} asked for run {index + 1}; each rank ran it {len(runs)} times")
        self._taken[path] += 1
        return runs[index], dict(self._details, run=index + 1), made

    def _distributed_run(self, plan: ReductionPlan) -> dict[str, list[dict[str, torch.Tensor]]]:
        require_megatron_core()  # the ranks run its DDP gradient sync
        started = time.perf_counter()
        ranks = run_ranks(self.rank_function, plan.world_size, plan, timeout=self.timeout, cuda=plan.device == "cuda")
        seconds = time.perf_counter() - started
        for rank, out in enumerate(ranks):
            if out["digest"] != digest(self.gradients(rank)):
                raise RuntimeError(f"rank {rank} drew other gradients than the reference sums (digests differ)")
        runs: dict[str, list[dict[str, torch.Tensor]]] = {}
        for path in plan.paths:
            runs[path.name] = [self._assemble(plan, ranks, path.name, run) for run in range(path.runs)]
        self._details = {
            "ranks": plan.world_size, "dp_sizes": list(plan.dp_sizes), "collective": plan.collective,
            "backend": self.shape.backend, "distributed_run_seconds": round(seconds, 3),
            "timing": "one run of the ranks computes every path's collectives; its seconds count on the first path",
            "megatron_core": megatron_core_version(),
            **({"nccl_version": ranks[0]["nccl_version"]} if "nccl_version" in ranks[0] else {}),
        }
        return runs

    def _assemble(self, plan: ReductionPlan, ranks: list[dict[str, Any]], path: str, run: int) -> dict[str, torch.Tensor]:
        tensors = {}
        for dp in plan.dp_sizes:
            pieces = []
            members = [ranks[rank]["runs"][(dp, path)] for rank in range(dp)]
            if plan.distributed_optimizer:
                for member in members:
                    piece = member["tensors"][run]
                    pieces.append(from_portable(member["tensors"][0] if piece is None else piece))
                buffer = torch.cat(pieces)
            else:
                first = members[0]["tensors"]
                buffer = from_portable(first[0] if first[run] is None else first[run])
                disagree = [rank for rank, member in enumerate(members) if member["digests"][run] != members[0]["digests"][run]]
                if disagree:
                    raise RuntimeError(f"DP {dp}, {path} run {run + 1}: the all-reduce left ranks {disagree} with"
                                       " other values than rank 0")
            tensors.update(unpack(plan, dp, buffer))
        return tensors


@dataclass(frozen=True)
class GradSync:
    """A path: one of the ranks' syncs (the plan's `paths`), read from the case's run; or, with
    `rank_path` (a wrong implementation's sync, not in the plan), from a run of its own."""

    name: str
    path: str  # "candidate", "default" or "control"; a wrong implementation's rank_path.name
    dtype: str
    rank_path: RankPath | None = None

    def run(self, inputs: ReductionInputs) -> ImplementationOutput:
        tensors, details, made = inputs.take(self.path, self.rank_path)
        if made:
            details["plan"] = plan_record(inputs.plan)
        else:
            details.pop("distributed_run_seconds", None)
        return ImplementationOutput(
            tensors=tensors, backend=f"{inputs.shape.backend} {inputs.plan.collective} {self.dtype}",
            details={**details, "reduction_dtype": self.dtype},
        )


def _to_bf16(values: torch.Tensor) -> torch.Tensor:
    return round_to_nearest(values, torch.bfloat16)


@dataclass(frozen=True)
class Fp64Sum:
    """The FP64 reference: at each DP size, the scaled FP64 sum of ranks 0 .. DP-1's FP32 gradients
    (`rounded`: of those gradients rounded to BF16 first, the secondary reference). `floor`: the
    BF16 format floor instead (each scaled gradient and the sum rounded to BF16 once, FP64 between),
    handed over in FP32 as the candidate hands its BF16 result over."""

    name: str
    rounded: bool = False
    floor: bool = False

    def run(self, inputs: ReductionInputs) -> ImplementationOutput:
        plan, tensors = inputs.plan, {}
        for dp in plan.dp_sizes:
            for spec in plan.tensors:
                grads = [inputs.gradients(rank)[spec.name] for rank in range(dp)]
                if self.rounded:
                    grads = [g.to(torch.bfloat16) for g in grads]
                if self.floor:
                    summed = fp64_sum(grads, plan.scaling_factor(dp), rounding=_to_bf16).to(torch.float32)
                else:
                    summed = fp64_sum(grads, plan.scaling_factor(dp))
                tensors[tensor_name(dp, spec.name)] = summed
        return ImplementationOutput(tensors=tensors, backend=self.name)


BF16_FLOOR = FormatFloor(
    format="BF16",
    roundings=(
        "each rank's gradient, times Megatron's gradient scaling factor, to BF16 once, as it enters the BF16 grad"
        " buffer",
        "the reduced gradient to BF16 once, as the BF16 buffer holds it (not each hop's partial sum: a BF16"
        " reduction that sums the BF16 shards in FP32, as megatron-core's reduce_scatter_with_fp32_accumulation"
        " does, rounds the sum once)",
    ),
    implementation=Fp64Sum("fp64-sum through bf16 (format floor)", floor=True),
)


def _pooled(tensors, prefix: str, error: Callable[[Any], float]) -> float:
    chosen = [t for t in tensors if t.tensor.startswith(prefix)]
    norm = math.sqrt(sum(t.reference_norm ** 2 for t in chosen))
    return math.sqrt(sum((error(t) * t.reference_norm) ** 2 for t in chosen)) / norm if norm else math.nan


def _powers(tensors, prefix: str) -> dict[str, float]:
    """The largest and the least error/bound over the tensors of one DP size."""
    powers = [t.error_over_bound for t in tensors if t.tensor.startswith(prefix)]
    return {"power": max(powers), "least_tensor_power": min(powers)}


def summarize(case: CaseResult) -> dict[str, Any]:
    """Per DP size: the candidate's worst error over its bound, its error ratios to the default,
    the pooled errors (relative L2 over every tensor), the collective's own error (against the FP64
    sum of the BF16-rounded gradients) and the control's power; against the BF16 format floor: the
    floor's pooled error, the candidate's error over the format bound and the control's power."""
    dps = sorted({int(t.tensor.split("/")[0][2:]) for t in case.candidate.tensors})
    control = next((c.judgement for c in case.controls if c.judgement is not None), None)
    judged_format = case.format
    summary: dict[str, Any] = {}
    for dp in dps:
        prefix = f"dp{dp}/"
        chosen = [t for t in case.candidate.tensors if t.tensor.startswith(prefix)]
        worst = max(chosen, key=lambda t: t.error_over_bound)
        ratios = [t.ratio for t in chosen if t.ratio is not None]
        entry: dict[str, Any] = {
            "tensors": len(chosen),
            "passes": all(t.passes for t in chosen),
            "worst_error_over_bound": worst.error_over_bound,
            "worst_tensor": worst.tensor,
            "least_error_over_bound": min(t.error_over_bound for t in chosen),
            "ratio_to_default": [min(ratios), max(ratios)] if ratios else None,
            "pooled_candidate_error": _pooled(chosen, prefix, lambda t: t.error),
            "pooled_default_error": _pooled(chosen, prefix, lambda t: t.default_error),
        }
        for secondary in case.secondary:
            entry["pooled_candidate_error_against_rounded_inputs"] = _pooled(secondary.tensors, prefix, lambda t: t.error)
        if control is not None:
            powers = _powers(control.tensors, prefix)
            entry["control_power"], entry["control_least_tensor_power"] = powers["power"], powers["least_tensor_power"]
        if judged_format is not None:
            against_floor = [t for t in judged_format.candidate.tensors if t.tensor.startswith(prefix)]
            worst_format = max(against_floor, key=lambda t: t.error_over_bound)
            entry["format"] = {
                "pooled_floor_error": _pooled(judged_format.floor.tensors, prefix, lambda t: t.error),
                "floor_fails_rule_on": sum(not t.passes for t in judged_format.floor.tensors if t.tensor.startswith(prefix)),
                "worst_error_over_format_bound": worst_format.error_over_bound,
                "worst_tensor": worst_format.tensor,
                "controls": {c.name: _powers(c.judgement.tensors, prefix) for c in judged_format.controls},
            }
        summary[f"dp{dp}"] = entry
    return summary


def _first_layer_specs(recipe: Recipe, model, scale: ParamScale) -> tuple[str, tuple[tuple[str, tuple[int, ...]], ...]]:
    """TP rank 0's slices of the first layer's dense tensors (its routed experts, reduced over the
    expert data-parallel group in a buffer of their own, are left out), and the layer's kind."""
    slices = param_slices(
        model, tp=recipe.tp, tp_rank=TP_RANK, layers=(LAYER,), embedding_rows=scale.divisor, scale=scale,
        ep=recipe.positive_int("layout.ep"), ep_rank=EP_RANK, etp=recipe.positive_int("layout.etp"),
    )
    dense = [s for s in slices if s.layer == LAYER and s.kind != "expert"]
    return model.layer_kind(LAYER), tuple((s.name, s.shape) for s in dense)


@dataclass(frozen=True)
class ReductionSetup:
    """What a reduction lever needs from the recipe: its shape, its cases (seeded plans of the
    given rank paths) and the recipe's reference."""

    shape: ReductionShape
    cases: tuple[Case, ...]
    recipe_ref: Any


def reduction_setup(recipe: Recipe, *, tier: Tier, scale: ParamScale, options: LeverOptions,
                    paths: tuple[RankPath, ...] = DTYPE_PATHS, ranks_available: int = MAX_RANKS,
                    ranks_because: str = ONE_GPU_PER_RANK) -> ReductionSetup:
    """The shape and cases of a reduction lever at the recipe: TP rank 0's first-layer slices, DP
    2, 4 and 8 and the recipe's own (those up to `ranks_available`, the rest left out
    `ranks_because`), the recipe's collective and gradient scaling."""
    if recipe.precision != "bf16":
        raise NotApplicable(f"recipe {recipe.id} trains in {recipe.precision}: --grad-reduce-in-bf16 is a BF16 training lever")
    if recipe.argument("--ddp-average-in-collective") is not None:
        raise NotApplicable(f"recipe {recipe.id} averages in the collective (ReduceOp.AVG, NCCL only): not modelled")
    model = facts_for(recipe, options.model)
    recipe_dp = recipe.positive_int("layout.dp")
    flags = [flag for flag in DISTRIBUTED_OPTIMIZER_FLAGS if recipe.argument(flag) is not None]
    collective = "reduce-scatter" if flags else "all-reduce"
    because = (f"the distributed optimizer ({', '.join(flags)})" if flags
               else "no distributed optimizer (none of " + ", ".join(DISTRIBUTED_OPTIMIZER_FLAGS) + ")")
    per_token_loss = recipe.argument("--calculate-per-token-loss") is not None
    layer_kind, specs = _first_layer_specs(recipe, model, scale)
    notes = []
    dp_sizes = set(DP_SIZES)
    if recipe_dp <= MAX_RANKS:
        dp_sizes.add(recipe_dp)
    else:
        notes.append(f"the recipe's own DP {recipe_dp} is not run: more ranks than this tier spawns ({MAX_RANKS})")
    runnable = tuple(sorted(dp for dp in dp_sizes if dp <= ranks_available))
    if recipe_dp == 1:
        others = [str(dp) for dp in runnable if dp > 1] or [str(dp) for dp in sorted(dp_sizes) if dp > 1]
        listed = " and ".join([", ".join(others[:-1]), others[-1]] if len(others) > 1 else others)
        notes.append("at the recipe's own DP 1 no collective runs (dp1 tensors: the gradient rounded into the"
                     f" buffer and scaled, alone); DP {listed} show{'s' if len(others) == 1 else ''} what the lever"
                     " does at other layouts")
    skip_reason = None
    if max(runnable, default=1) < 2:
        skip_reason = (f"{tier.name} tier: an NCCL rank needs a GPU of its own and this machine has {ranks_available};"
                       " no data-parallel size of 2 or more can run")
        runnable = tuple(sorted(dp_sizes))
    elif runnable != tuple(sorted(dp_sizes)):
        notes.append(f"DP sizes above {ranks_available} not run: {ranks_because}")
    backend = "nccl" if tier.device == "cuda" else "gloo"
    shape = ReductionShape(
        model=model.short_name, scale=scale.name, tp_size=recipe.tp, tp_rank=TP_RANK, layer=LAYER,
        layer_kind=layer_kind, tensors=specs, parameters=sum(math.prod(s) for _, s in specs), recipe_dp=recipe_dp,
        dp_sizes=runnable, collective=collective, collective_because=because, per_token_loss=per_token_loss,
        recipe_reduces_in="bf16" if recipe.argument("--grad-reduce-in-bf16") is not None else "fp32",
        backend=backend, notes=tuple(notes),
    )

    def make_inputs(device, seed: int) -> ReductionInputs:
        plan = draw_plan(seed=seed, specs=specs, dp_sizes=runnable, collective=collective,
                         per_token_loss=per_token_loss, device=tier.device, paths=paths)
        return ReductionInputs(shape=shape, plan=plan)

    cases = tuple(
        Case(id=f"{shape.id}-seed{seed}", shape=shape, seed=seed, source="synthetic", variant="seeded-rank-gradients",
             make_inputs=lambda device, seed=seed: make_inputs(device, seed), skip_reason=skip_reason,
             recipe_runs="candidate" if shape.recipe_reduces_in == "bf16" else "default",
             memory_bytes=shape.parameters * RANKS_BYTES_PER_PARAMETER,
             memory_driver=f"{shape.parameters:,} parameters on each of {max(runnable)} ranks, about"
                           f" {RANKS_BYTES_PER_PARAMETER} bytes each over all ranks")
        for seed in SEEDS
    )
    return ReductionSetup(shape=shape, cases=cases, recipe_ref=recipe.ref_for(model))


# Memory of one case, all ranks together, per parameter of a rank's layer: each rank's gradients in
# FP32 and BF16 for every DP size and path, the reduced buffers, and rank 0's FP64 sums. Measured on
# Gemma's case at 1/8 and 1/4 of the recipe's dimensions (3.7M and 15.0M parameters: 2.0 and 5.5 GB
# more memory in use on this machine while it ran): 310 bytes per parameter more.
RANKS_BYTES_PER_PARAMETER = 310


def reduction_lever(recipe: Recipe, *, tier: Tier, scale: ParamScale, options: LeverOptions,
                    ranks_available: int = MAX_RANKS, ranks_because: str = ONE_GPU_PER_RANK) -> Lever:
    setup = reduction_setup(recipe, tier=tier, scale=scale, options=options, ranks_available=ranks_available,
                            ranks_because=ranks_because)
    collective = setup.shape.collective
    return Lever(
        name=NAME, version=VERSION, tier=tier, description=DESCRIPTION, recipe=setup.recipe_ref, cases=setup.cases,
        candidate=GradSync(f"bf16-{collective}", "candidate", "bf16"),
        default=GradSync(f"fp32-{collective}", "default", "fp32"),
        reference=Fp64Sum("fp64-sum"),
        secondary_references=(Fp64Sum("fp64-sum-of-bf16-rounded-gradients", rounded=True),),
        controls=(Control(name="one rank dropped",
                          implementation=GradSync(f"bf16-{collective}-rank-dropped", "control", "bf16")),),
        format_floor=BF16_FLOOR,
        summarize=summarize,
        cpu_threads=1,
    )


def cpu_tier(recipe_id: str, options: LeverOptions) -> list[Lever]:
    """megatron-core's DDP gradient sync on gloo ranks, at the smoke scale (the recipe's with --scale recipe)."""
    return [reduction_lever(lever_recipe(recipe_id, options.recipe), tier=tiers.CPU, scale=options.at_scale(SMOKE, RECIPE),
                            options=options)]


def gpu_ranks(options: LeverOptions) -> tuple[int, str]:
    """(the NCCL ranks a GPU tier may start, why no more): one per GPU of this machine; on an emulated
    GPU at most EMULATED_RANKS."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if options.emulated is not None and gpus > EMULATED_RANKS:
        return EMULATED_RANKS, EMULATED_BECAUSE
    return gpus, ONE_GPU_PER_RANK


def gpu_tier(recipe_id: str, options: LeverOptions) -> list[Lever]:
    """NCCL over this machine's GPUs (one per rank), at the smoke scale; the DP sizes above the GPU
    count are left out (on an emulated GPU, those above EMULATED_RANKS), and the case skips where
    fewer than 2 GPUs are present."""
    ranks, because = gpu_ranks(options)
    return [reduction_lever(lever_recipe(recipe_id, options.recipe), tier=tiers.GPU, scale=SMOKE, options=options,
                            ranks_available=ranks, ranks_because=because)]

SPEC = LeverSpec(
    name=NAME, version=VERSION,
    description="the data-parallel gradient reduction in BF16 against FP32 and an FP64 sum of the ranks' gradients,"
                " over 2, 4 and 8 ranks",
    titles=("gradient reduction in BF16 against FP32",),
    tests=(
        TierTest(test="test_gradient_reduction_dtype_cpu", tier="cpu", factory=cpu_tier,
                 doc="torch.distributed on gloo ranks: DP 2, 4 and 8 (and the recipe's own) in one run of 8 ranks."),
        TierTest(test="test_gradient_reduction_dtype_nccl", tier="gpu", factory=gpu_tier),
    ),
    reads=(*DEFAULT_READS, *DATA_PARALLEL, "workload.precision", *GRADIENT_SYNC),
    evidence=Evidence(klass=UPSTREAM, tier="cpu",
                      what="megatron-core's own DDP gradient sync, BF16 against FP32 buffers, on 2 to 8 gloo ranks"))
