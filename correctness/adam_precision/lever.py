"""The precision-aware Adam lever (`--use-precision-aware-optimizer` with `--main-params-dtype`,
`--exp-avg-dtype`, `--exp-avg-sq-dtype`): TE FusedAdam with its state in lowered precision against
TE FusedAdam with FP32 state and the FP64 AdamW reference (references/adamw.py), over the recipe's
GPU share of the optimizer, for STEPS steps at the recipe's schedule.

What the flags do (megatron-core 0.16.1; the recipes' commit radixark/Megatron-LM 37f91617 has the
same code): without CPU offload the distributed optimizer hands the BF16 parameter shards to TE
FusedAdam with `master_weights=True`, `master_weight_dtype`, `exp_avg_dtype`, `exp_avg_sq_dtype` and
`store_param_remainders` (optimizer/__init__.py 365-387). Under `--optimizer-cpu-offload` Megatron
builds a HybridDeviceOptimizer instead (__init__.py 306-346) with only lr, weight decay, betas, eps,
bias correction and `fused`, and FP32 copies (`param_update_in_fp32=True`, 344); its GPU share's
FusedAdam is built from the parameter groups alone (hybrid_optimizer.py 212), so it keeps FP32
masters and moments: the three dtype flags are ignored there (optimizer_config.py 389-390 returns
before the TE check). `--main-grads-dtype` is not this lever's: it reaches megatron-core only in an
assertion (optimizer_config.py 415-417); Megatron-LM turns `bf16` into a BF16 gradient buffer
(training/arguments.py 780-787 -> training.py 1316 `grad_reduce_in_fp32`), the
gradient-reduction-dtype lever's change.

So the lever applies to a recipe that offloads with a GPU share (the offload lever's setting: same
slices, split, units and gradients) and measures, on exactly the tensors FusedAdam updates there,
what the lowered dtypes would change where Megatron honours them; each case's shape records
whether the recipe asks for its dtypes and that Megatron ignores them under offload.

Cases (one per dtype combination; why these): both moments BF16 (the saving Megatron's MoE
documentation and DeepSeek-V3 use; TE's fused-unscale kernel path), both moments FP8 (Megatron's
documented "minimum-memory optimizer"), both moments FP16 (the scaled 16-bit format), FP16 masters
(the only lowered master TE and Megatron accept: `--main-params-dtype` takes fp32 or fp16, TE raises
for BF16 masters), and FP32 masters kept as BF16 parameters plus int16 remainders (what
`--use-precision-aware-optimizer` alone gives without offload: Megatron's `store_param_remainders`
defaults to True), plus the recipe's own combination where it asks for another one.

Tiers: "cpu" (smoke scale: `EmulatedFusedAdam`, a named stand-in for TE's kernel) and the recipe's
GPU (recipe scale: TE FusedAdam itself). Negative controls: no bias correction (not on FP16-master
cases, below), the moments re-initialised to zero before every step (the state lost between steps
instead of rounded), and, on cases with FP16 or FP8 moments, the moments stored without their
per-tensor scale.

Format floor (correctness.adam_precision.floor, both tiers): each case's own state dtypes applied
to the FP64 reference, every state stored as the candidate stores it between steps and nothing else
rounded. A case whose candidate fails the rule only as its format must (BF16 and FP8 moments, FP16
masters) is `format-limited`. With FP16 masters the update is lost in the masters' own rounding (the
floor's update error is 1.3-1.7 times the update pooled), so a mistake of the update's own size is
within the format bound: the no-bias-correction control, whose power against that bound is 0.50-0.51
(as a candidate it is format-limited itself), is not applied there; the moments-zeroed control
keeps a power of 900 or more. Wrong implementations in the same format: correctness.adam_precision.wrong.
"""

import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from correctness import tiers
from correctness.adam.inputs import (
    DEFAULT_PRECLIP_NORMS, OptimizerUnit, gradient_scales, raw_gradient, row_blocks, streamed_memory,
)
from correctness.adam.offload_setting import OffloadSetting, offload_setting
from correctness.adam.reference import Fp64AdamW
from correctness.adam.share_summary import share_summary
from correctness.adam.split import GPU
from correctness.adam.synthetic_values import synthetic_slice
from correctness.adam_precision.floor import FORMAT, ROUNDINGS, Fp64StoredAdamW
from correctness.adam_precision.paths import EmulatedFusedAdam, StateDtypes, TeFusedAdamState
from correctness.adam_precision.state import MASTER_FORMATS, MOMENT_FORMATS
from correctness.errors import RecipeError
from correctness.evidence import STAND_IN, Evidence
from correctness.lever import (
    Case, Control, FormatFloor, Implementation, Lever, LeverOptions, NotApplicable, Streamed, Tier,
)
from correctness.lever_spec import OPTIMIZER_READS, RECIPE_GPU, LeverSpec, TierTest
from correctness.megatron.layout import RECIPE, SMOKE, ParamScale
from correctness.recipes import Recipe

NAME = "precision-aware-adam"
VERSION = 2
SYNTHETIC_SEED = 0
# Iterations 1-5 of the recipe's schedule (lr 0, the warmup to the peak, then the cosine): five
# roundings of each moment and four updates, each step reading the state the last one rounded, so
# that the rounding compounds; few enough for the CPU tier's time (20 s for both recipes). Gradients
# at the offload lever's pre-clip norms, repeated (8, 4, 2, 8, 4): clipped at every step, by a
# different factor from one step to the next.
STEPS = 5
PRECLIP_NORMS = tuple(itertools.islice(itertools.cycle(DEFAULT_PRECLIP_NORMS), STEPS))
CASE_DTYPES = (
    StateDtypes(exp_avg="bf16", exp_avg_sq="bf16"),
    StateDtypes(exp_avg="fp8", exp_avg_sq="fp8"),
    StateDtypes(exp_avg="fp16", exp_avg_sq="fp16"),
    StateDtypes(master="fp16"),
    StateDtypes(remainders=True),
)
DESCRIPTION = (
    "TE FusedAdam with lowered-precision optimizer state (--main-params-dtype, --exp-avg-dtype, --exp-avg-sq-dtype)"
    " against FP32 state and FP64 over the recipe's GPU share, several steps"
)
DTYPE_FLAGS = (("master", "--main-params-dtype", MASTER_FORMATS), ("exp_avg", "--exp-avg-dtype", MOMENT_FORMATS),
               ("exp_avg_sq", "--exp-avg-sq-dtype", MOMENT_FORMATS))
# A case's peak memory above the process's (Case.memory_bytes), estimated from the GPU share before
# anything is drawn, so that a case over the machine's memory is refused when the lever is built.
# Kept (below the recipe's scale): 200 bytes per GPU-share parameter and 100 MB; measured peak
# (VmHWM) against it: Gemma at the smoke scale 0.12 GB (estimate 0.19, 1.5 x), at 1/8 and 1/4 of the
# recipe's dimensions 0.30 and 1.36 GB (0.45 and 1.48); Nemotron at the smoke scale 0.16 GB (0.27,
# 1.7 x). Streamed (each case its own units, one at a time): 1,100 bytes per element of the largest
# unit (eight paths over five steps, FP64 references and floor included), measured Gemma 0.20, 0.79,
# 1.60 and 1.59 GB at 1/16, 1/8, 1/4 and 1/2 (estimates 0.29, 0.86, 2.42 and 2.45), Nemotron 0.10
# and 1.01 GB at 1/16 and 1/4 (0.25, 2.41); at the recipe's scale 2.58 GB (Gemma) and 2.54 (Nemotron).
# The fixed part: 150 MB, the allocator's arenas and the threads' scratch a case leaves behind, which
# varied by 80 MB between runs of Gemma's smoke case (0.10 to 0.18 GB measured after a first case).
STREAMED_BYTES_PER_UNIT_ELEMENT = 1100
KEPT_BYTES_PER_PARAMETER = 200
FIXED_BYTES = 150_000_000


@dataclass(frozen=True, kw_only=True)
class AdamPrecisionShape:
    """What one case updates (the recipe's GPU share of the optimizer) and the state it keeps."""

    model: str
    scale: str
    tp_size: int
    fraction: float
    tensors: int  # on the GPU share
    parameters: int  # on the GPU share
    inventory_parameters: int  # every slice the offload lever splits
    gpu_tensors: tuple[str, ...]
    steps: int
    first_iteration: int
    preclip_norms: tuple[float, ...]
    master_dtype: str
    exp_avg_dtype: str
    exp_avg_sq_dtype: str
    store_param_remainders: bool
    flags: str  # the arguments that ask for this state
    recipe_dtypes: tuple[str, str, str]  # what the recipe asks for: (master, exp_avg, exp_avg_sq)
    recipe_requests: bool  # the recipe asks for this case's lowered dtypes
    honoured_under_offload: bool  # whether Megatron applies them when offloading (0.16: never)

    @property
    def id(self) -> str:
        remainders = "-remainders" if self.store_param_remainders else ""
        return (
            f"{self.model}-tp{self.tp_size}-gpu-share-f{self.fraction:g}-{self.scale}-{self.steps}steps"
            f"-p{self.master_dtype}{remainders}-m{self.exp_avg_dtype}-v{self.exp_avg_sq_dtype}"
        )

    def record(self) -> dict[str, Any]:
        return {"id": self.id, **asdict(self), "gpu_share": self.parameters / self.inventory_parameters}


def recipe_dtypes(recipe: Recipe) -> StateDtypes:
    """The state dtypes the recipe's arguments ask for (Megatron's defaults, fp32, where absent)."""
    chosen = {}
    for field, flag, allowed in DTYPE_FLAGS:
        values = recipe.argument(flag)
        value = "fp32" if values is None else " ".join(values)
        if value not in allowed:
            raise RecipeError(f"recipe {recipe.id}: {flag} {value!r} is not one of Megatron's choices {list(allowed)}")
        chosen[field] = value
    return StateDtypes(**chosen)


def case_dtypes(requested: StateDtypes) -> tuple[StateDtypes, ...]:
    """The lever's dtype combinations, and the recipe's own where it asks for another lowered one."""
    known = {(d.master, d.exp_avg, d.exp_avg_sq) for d in CASE_DTYPES if not d.remainders}
    own = (requested.master, requested.exp_avg, requested.exp_avg_sq)
    return CASE_DTYPES if requested.all_fp32 or own in known else (*CASE_DTYPES, requested)


def gpu_share_setting(recipe_id: str, scale: ParamScale, options: LeverOptions) -> OffloadSetting:
    setting = offload_setting(recipe_id, scale, options)
    if not any(share == GPU for share in setting.shares.values()):
        raise NotApplicable(
            f"recipe {setting.recipe.id}: offload fraction {setting.fraction:g} leaves no parameter on the GPU's"
            " FusedAdam (every one goes to the CPU's torch AdamW)"
        )
    return setting


def gpu_share_units(setting: OffloadSetting, seed: int, preclip_norms: tuple[float, ...]) -> Iterator[OptimizerUnit]:
    """The GPU share's units, as the offload lever makes them (correctness.adam.inputs.
    optimizer_units: the same weights and gradients, the clip's global norm over every slice),
    without drawing the CPU share's values."""
    scales, norms = gradient_scales(setting.slices, seed, preclip_norms)
    for param in setting.slices:
        if setting.shares[param.name] != GPU:
            continue
        values = synthetic_slice(param, seed)
        for rows in row_blocks(param):
            yield OptimizerUnit(
                param=param, rows=rows, weights=values[rows[0] : rows[1]],
                grads=tuple(raw_gradient(param, rows, step, seed) * scales[step] for step in range(len(scales))),
                grad_norms=tuple(norms), config=setting.config,
            )


class _UnitsOnce:
    """The GPU share's units drawn once and shared by the `uses` cases of one lever (the CPU tier:
    a few MB at the smoke scale), let go after the last of them; at the recipe scale (`keep` off)
    each case streams its own."""

    def __init__(self, setting: OffloadSetting, keep: bool, uses: int):
        self.setting = setting
        self.keep = keep
        self.uses = uses
        self._units: tuple[OptimizerUnit, ...] | None = None
        self._served = 0

    def __call__(self) -> Iterable[OptimizerUnit]:
        if not self.keep:
            return gpu_share_units(self.setting, SYNTHETIC_SEED, PRECLIP_NORMS)
        units = self._units or tuple(gpu_share_units(self.setting, SYNTHETIC_SEED, PRECLIP_NORMS))
        self._served += 1
        self._units = None if self._served % self.uses == 0 else units
        return units


class SharedAcrossCases:
    """A deterministic path (the FP64 references) run once per unit, its outputs shared by the
    `uses` cases of the lever, which differ only in the candidate's state dtypes and so run on the
    same unit objects (`_UnitsOnce`); each output is let go after its last use, and a unit asked
    for again is computed again."""

    def __init__(self, path: Implementation, uses: int):
        self.path = path
        self.name = path.name
        self.uses = uses
        self._outputs: dict[int, list] = {}  # id(unit) -> [unit (keeps the id unique), output, uses left]

    def run(self, unit: "CaseUnit"):
        entry = self._outputs.get(id(unit.unit))
        if entry is None:
            entry = self._outputs[id(unit.unit)] = [unit.unit, self.path.run(unit.unit), self.uses]
        entry[2] -= 1
        if entry[2] == 0:
            del self._outputs[id(unit.unit)]
        return entry[1]


def case_shape(setting: OffloadSetting, dtypes: StateDtypes, requested: StateDtypes) -> AdamPrecisionShape:
    on_gpu = [p for p in setting.slices if setting.shares[p.name] == GPU]
    asks = ((requested.master, requested.exp_avg, requested.exp_avg_sq) == (dtypes.master, dtypes.exp_avg,
            dtypes.exp_avg_sq) and not requested.all_fp32)
    return AdamPrecisionShape(
        model=setting.model.short_name, scale=setting.scale.name, tp_size=setting.recipe.tp, fraction=setting.fraction,
        tensors=len(on_gpu), parameters=sum(p.numel for p in on_gpu),
        inventory_parameters=sum(p.numel for p in setting.slices), gpu_tensors=tuple(p.name for p in on_gpu),
        steps=STEPS, first_iteration=1, preclip_norms=PRECLIP_NORMS,
        master_dtype=dtypes.master, exp_avg_dtype=dtypes.exp_avg, exp_avg_sq_dtype=dtypes.exp_avg_sq,
        store_param_remainders=dtypes.remainders, flags=dtypes.flags(),
        recipe_dtypes=(requested.master, requested.exp_avg, requested.exp_avg_sq), recipe_requests=asks,
        honoured_under_offload=False,
    )


@dataclass(frozen=True)
class ByCase:
    """A path whose state dtypes are the case's: each case's units carry them (`CaseUnit`)."""

    make: Callable[[StateDtypes], Implementation]
    label: str

    @property
    def name(self) -> str:
        return self.label

    def run(self, unit: "CaseUnit"):
        return self.make(unit.dtypes).run(unit.unit)


@dataclass(frozen=True)
class CaseUnit:
    """One unit and the state dtypes of the case it belongs to."""

    unit: OptimizerUnit
    dtypes: StateDtypes


@dataclass(frozen=True)
class OnUnit:
    """A path that needs only the unit (the default, the references)."""

    path: Implementation

    @property
    def name(self) -> str:
        return self.path.name

    def run(self, unit: CaseUnit):
        return self.path.run(unit.unit)


def _case_inputs(units: _UnitsOnce, dtypes: StateDtypes) -> Streamed:
    return Streamed(units=(CaseUnit(unit=unit, dtypes=dtypes) for unit in units()))


def _unscaled_inapplicable(case: Case) -> str | None:
    shape = case.shape
    if {shape.exp_avg_dtype, shape.exp_avg_sq_dtype} & {"fp16", "fp8"}:
        return None
    return (f"no moment has a per-tensor scale here (exp_avg {shape.exp_avg_dtype}, exp_avg_sq"
            f" {shape.exp_avg_sq_dtype}): only FP16 and FP8 moments are scaled")


def _bias_correction_unseen(case: Case) -> str | None:
    if case.shape.master_dtype != "fp16":
        return None
    return ("with FP16 masters each step's update (5e-6 to 1e-5 of the weights) is below the masters' own FP16"
            " rounding (the format floor's update error is 0.58 to 75 times the update, per tensor), and the bias"
            " correction changes only the update, by about its own size: within the format bound (power 0.50-0.51"
            " against it as measured); the moments-zeroed control keeps its power here")


def case_memory(setting: OffloadSetting, keep_units: bool) -> dict[str, Any]:
    """Case.memory_bytes and memory_driver: the GPU share's units and FP64 references kept for every
    case (`keep_units`), else one unit's streamed at a time."""
    on_gpu = [p for p in setting.slices if setting.shares[p.name] == GPU]
    if not keep_units:
        return streamed_memory(on_gpu, per_unit_element=STREAMED_BYTES_PER_UNIT_ELEMENT, fixed=FIXED_BYTES)
    parameters = sum(p.numel for p in on_gpu)
    return {"memory_bytes": FIXED_BYTES + KEPT_BYTES_PER_PARAMETER * parameters,
            "memory_driver": f"the GPU share's {parameters:,} parameters' units and FP64 references kept for every"
                             f" case, about {KEPT_BYTES_PER_PARAMETER} bytes each"}


def precision_lever(
    setting: OffloadSetting, *, tier: Tier, path: Callable[..., Implementation], keep_units: bool,
    options: LeverOptions,
) -> Lever:
    """The lever of both tiers: `path` (a path class taking the state dtypes and the control
    switches) with the case's dtypes against the same class with FP32 state, and FP64."""
    requested = recipe_dtypes(setting.recipe)
    combinations = case_dtypes(requested)
    units = _UnitsOnce(setting, keep=keep_units, uses=len(combinations))
    shared = (lambda path: SharedAcrossCases(path, len(combinations))) if keep_units else OnUnit
    memory = case_memory(setting, keep_units)
    cases = []
    for dtypes in combinations:
        shape = case_shape(setting, dtypes, requested)
        cases.append(Case(
            id=f"{shape.id}-synthetic-seed{SYNTHETIC_SEED}", shape=shape, seed=SYNTHETIC_SEED, source="synthetic",
            variant="synthetic-weights", make_inputs=lambda device, dtypes=dtypes: _case_inputs(units, dtypes),
            **memory,
        ))
    family = path.family
    gpu_names = {name: GPU for name, share in setting.shares.items() if share == GPU}
    return Lever(
        name=NAME, version=VERSION, tier=tier, description=DESCRIPTION, recipe=setting.recipe.ref_for(setting.model),
        cases=tuple(cases), candidate=ByCase(make=path, label=f"{family}-lowered-state"),
        default=OnUnit(path(StateDtypes())), reference=shared(Fp64AdamW()),
        controls=(
            Control(name="no bias correction", implementation=ByCase(
                make=lambda dtypes: path(dtypes, bias_correction=False), label=f"{family} (no bias correction)"),
                why_inapplicable=_bias_correction_unseen),
            Control(name="moments zeroed before each step", implementation=ByCase(
                make=lambda dtypes: path(dtypes, zero_moments=True),
                label=f"{family} (moments zeroed before each step)")),
            Control(name="moments stored unscaled", implementation=ByCase(
                make=lambda dtypes: path(dtypes, scaled=False), label=f"{family} (moments stored unscaled)"),
                why_inapplicable=_unscaled_inapplicable),
        ),
        secondary_references=(shared(Fp64AdamW(fp32_hyperparameters=True)),),
        format_floor=FormatFloor(format=FORMAT, roundings=ROUNDINGS, implementation=ByCase(
            make=Fp64StoredAdamW, label="fp64-adamw-state-stored-in-the-case-dtypes")),
        summarize=share_summary(gpu_names, {p.name: p.numel for p in setting.slices}),
        # on the CPU (the emulated GPU's too), one thread is as fast on blocks of at most 2.1M elements
        cpu_threads=1 if tier.device == "cpu" or options.emulated is not None else None,
    )


def cpu_tier(recipe_id: str, options: LeverOptions, scale: ParamScale | None = None) -> list[Lever]:
    """On the CPU (smoke scale, or the recipe's with --scale recipe): TE FusedAdam's storage emulated
    (EmulatedFusedAdam). The units and FP64 references are kept for the five cases below the recipe's
    scale only: there Gemma's GPU share (110M parameters) would hold about 22 GB at once, where
    streaming each case's own holds one unit."""
    setting = gpu_share_setting(recipe_id, scale or options.at_scale(SMOKE, RECIPE), options)
    return [precision_lever(setting, tier=tiers.CPU, path=EmulatedFusedAdam, keep_units=setting.scale != RECIPE,
                            options=options)]


def recipe_gpu_tier(recipe_id: str, options: LeverOptions) -> list[Lever]:
    """Recipe scale on the recipe's GPU: TE FusedAdam itself, both the lowered and the FP32 state. On the
    emulated GPU (the smoke scale) the units and the FP64 references are shared by the cases, as on the CPU."""
    setting = gpu_share_setting(recipe_id, options.gpu_at_scale(SMOKE, RECIPE), options)
    return [precision_lever(
        setting, tier=tiers.recipe_gpu_tier(setting.recipe.gpu), path=TeFusedAdamState,
        keep_units=options.emulated is not None, options=options,
    )]

SPEC = LeverSpec(
    name=NAME, version=VERSION,
    description="TE FusedAdam with lowered-precision optimizer state (--main-params-dtype, --exp-avg-dtype,"
                " --exp-avg-sq-dtype) against FP32 state and FP64 over the recipe's GPU share, several steps",
    titles=("lowered-precision optimizer state",),
    tests=(
        TierTest(test="test_precision_aware_adam_cpu", tier="cpu", factory=cpu_tier,
                 doc="TE FusedAdam's state storage emulated on the CPU (EmulatedFusedAdam), at the smoke scale."),
        TierTest(test="test_precision_aware_adam_te", tier=RECIPE_GPU, factory=recipe_gpu_tier),
    ),
    reads=(*OPTIMIZER_READS, "--main-params-dtype", "--exp-avg-dtype", "--exp-avg-sq-dtype"),
    evidence=Evidence(klass=STAND_IN, tier="cpu",
                      what="EmulatedFusedAdam, a CPU stand-in for TE FusedAdam's kernel and state storage, checked"
                           " against TE's source worked by hand"))
