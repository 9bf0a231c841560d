"""The deterministic-mode lever (`--deterministic-mode`): Megatron's deterministic configuration
must give the same bits on every run of the same inputs. Rule: bitwise repeatability over RUNS
runs (correctness.rule: `bitwise_repeatable`), and the default accuracy rule as well (deterministic
kernels may round differently from the default's, and must not round worse than twice as badly).

Two computations, each a Lever of its own per tier, for attention forward and backward and for
the data-parallel gradient reduction:

- attention: the recipe's attention path (CPU: torch SDPA's flash CPU kernel; GPU: each torch
  SDPA backend that runs under deterministic algorithms at the recipe's shapes, never cuDNN's,
  flash on packed rows one row at a time (correctness.attention.combinations); recipe GPU: TE's
  auto backend) run with the switches of --deterministic-mode on
  (correctness.composites.determinism.mode.InMode) against the same path with them off, and the FP64
  reference, at the attention lever's smoke or recipe shapes, one model-like case per layer kind;
- gradient reduction: the recipe's reduction (its dtype, reduce-scatter or all-reduce, Megatron's
  buffer and scaling: correctness.grad_reduction) on gloo ranks (CPU) or NCCL (GPU) with torch's
  deterministic switch and, on NCCL, NCCL_ALGO=Ring as Megatron requires, against the same
  reduction without them, and the FP64 sum, at DP 2, 4 and 8.

The default (nondeterminism allowed) runs RUNS times too; its spread is recorded (on a GPU,
flash attention's backward and NVLS reductions may show one), never judged.

Negative controls, run RUNS times each: for the repeatability half, a path whose runs differ: in
attention, the candidate with one element of dq, dk and dv moved by one unit in the last place,
another element on each run (the least a kernel with atomic accumulation changes between runs:
it shows the check's resolution); in the reduction, the ranks' buffers summed in an order that
moves with the run (as an accumulation whose order depends on arrival would; at DP 2 the two
orders give the same sum, at DP 4 and 8 they differ). For the accuracy half, the attention
lever's wrong softmax scale and the reduction lever's dropped rank.

On the CPU every kernel here is deterministic with the switches off too: the CPU tier runs the
harness, the switches and the controls on real kernels, and its verdict is that of these CPU
kernels; the GPU tiers judge the kernels the recipe's claim is about.
"""

from dataclasses import dataclass, field
from typing import Any

import torch

from correctness import tiers
from correctness.attention import backend_lever as attention
from correctness.attention.judging import SLICING
from correctness.attention.reference import Fp64Reference
from correctness.attention.sdpa import Sdpa
from correctness.shapes import RECIPE_SCALE, Scale
from correctness.attention.te import TransformerEngine
from correctness.composites.determinism.mode import InMode
from correctness.attention.combinations import gpu_sdpa_levers
from correctness.evidence import BOOKKEEPING, Evidence
from correctness.lever import (Case, Control, Implementation, ImplementationOutput, Lever, LeverOptions, NotApplicable,
                               Tier)
from correctness.lever_spec import DATA_PARALLEL, GRADIENT_SYNC, RECIPE_GPU, SHAPE_READS, LeverSpec, TierTest
from correctness.models import facts_for
from correctness.megatron.layout import RECIPE, SMOKE
from correctness.recipes import Recipe, lever_recipe
from correctness.grad_reduction import lever as reduction
from correctness.grad_reduction.plan import ORDER_VARIES, RANK_DROPPED, RankPath
from correctness.rule import Rule

NAME = "deterministic-mode"
VERSION = 1
RUNS = 3
RULE = Rule(runs=RUNS, bitwise_repeatable=True)
RULE_REASON = (
    f"--deterministic-mode claims bitwise repeatability: the candidate must give the same bits on each of {RUNS}"
    " runs of the same inputs; its accuracy is held to the default rule as well"
)
SEEDS = (0,)
# The CPU tier's attention: one key-value group and shorter sequences than the attention lever's
# smoke scale. Twelve runs of SDPA's BF16 backward per case (three each for the candidate, the
# default and two controls) cost 70 s on one case at the smoke scale on a CPU without BF16
# hardware; repeatability needs no more than the kernels' own block structure (a global kind's
# 512 keys are one block of the CPU flash kernel's, the window's edge still runs).
CPU_SCALE = Scale(name="smoke-one-group", kv_groups=1, seq_len=512, past_window=128, rows=1)
ATTENTION_DESCRIPTION = ("attention under deterministic mode against the same kernels with nondeterminism allowed"
                         " and an FP64 reference, bitwise repeatable over {runs} runs")
REDUCTION_DESCRIPTION = ("the gradient reduction under deterministic mode against the same reduction with"
                         " nondeterminism allowed and an FP64 sum, bitwise repeatable over {runs} runs")
NCCL_DETERMINISTIC_ENV = (("NCCL_ALGO", "Ring"),)  # one of the algorithms Megatron-LM accepts in deterministic mode
ACCUMULATED = ("dq", "dk", "dv")


@dataclass(eq=False)
class LastBitMovesEachRun:
    """`base`, with one element of each of `tensors` moved to the next representable value, another
    element on each call: outputs that differ between runs by one unit in the last place."""

    base: Implementation
    tensors: tuple[str, ...] = ACCUMULATED
    calls: int = field(default=0)

    @property
    def name(self) -> str:
        return f"{self.base.name} (one last bit moved, another element each run)"

    def run(self, inputs: Any) -> ImplementationOutput:
        output = self.base.run(inputs)
        self.calls += 1
        tensors = dict(output.tensors)
        for name in self.tensors:
            moved = tensors[name].clone()
            flat = moved.view(-1)
            index = (self.calls * 7919) % flat.numel()  # a prime stride: elements far apart, none repeated soon
            flat[index] = torch.nextafter(flat[index], torch.tensor(float("inf"), dtype=flat.dtype))
            tensors[name] = moved
        return ImplementationOutput(tensors=tensors, backend=f"{output.backend} (mutated: last bit moved each run)",
                          details={**output.details, "mutation": "one last bit moved, another element each run",
                                   "call": self.calls})


def attention_controls(candidate: Implementation) -> tuple[Control, ...]:
    wrong_scale = next(control for control in attention.controls(candidate) if control.name == "wrong softmax scale")
    return (
        Control(name="accumulation order varies between runs", implementation=LastBitMovesEachRun(candidate)),
        wrong_scale,
    )


def attention_lever_cases(recipe: Recipe, scale: Scale, options: LeverOptions) -> tuple[Case, ...]:
    """One model-like case per layer kind, at the attention lever's shapes."""
    model = facts_for(recipe, options.model)
    return tuple(case for case in attention.attention_cases(recipe, model, scale, options, {}, seeds=SEEDS)
                 if case.variant == "model-like")


def attention_lever(recipe: Recipe, *, tier: Tier, scale: Scale, base: Implementation, options: LeverOptions,
                    cases: tuple[Case, ...] | None = None) -> Lever:
    """`cases`: those to judge (default: attention_lever_cases)."""
    model = facts_for(recipe, options.model)
    candidate = InMode(base, deterministic=True, device=tier.device)
    cases = cases if cases is not None else attention_lever_cases(recipe, scale, options)
    return Lever(
        name=NAME, version=VERSION, tier=tier, description=ATTENTION_DESCRIPTION.format(runs=RUNS),
        recipe=recipe.ref_for(model), cases=cases, candidate=candidate,
        default=InMode(base, deterministic=False, device=tier.device), reference=Fp64Reference(),
        controls=attention_controls(candidate), rule=RULE, rule_reason=RULE_REASON, slicing=SLICING,
    )


def reduction_paths(recipe: Recipe, device: str) -> tuple[RankPath, ...]:
    dtype = "bf16" if recipe.argument("--grad-reduce-in-bf16") is not None else "fp32"
    env = NCCL_DETERMINISTIC_ENV if device == "cuda" else ()
    return (
        RankPath(name="candidate", dtype=dtype, runs=RUNS, deterministic=True, env=env),
        RankPath(name="default", dtype=dtype, runs=RUNS),
        RankPath(name="order-varies", dtype=dtype, runs=RUNS, variant=ORDER_VARIES),
        RankPath(name="rank-dropped", dtype=dtype, runs=RUNS, variant=RANK_DROPPED),
    )


# On an emulated GPU the NCCL lever starts at most this many ranks (DP 1, 2 and 4; each rank a process
# of its own, its reduction carrying the emulation's cost per operator): the order-varies control
# needs DP 4 to change a sum, and DP 8 takes twice as long (21 s a case on 2 cores, against 10 s).
EMULATED_RANKS = 4


def reduction_determinism_lever(recipe: Recipe, *, tier: Tier, options: LeverOptions,
                                ranks_available: int = reduction.MAX_RANKS,
                                ranks_because: str = reduction.ONE_GPU_PER_RANK) -> Lever:
    paths = reduction_paths(recipe, tier.device)
    scale = options.at_scale(SMOKE, RECIPE) if tier.device == "cpu" else SMOKE
    setup = reduction.reduction_setup(recipe, tier=tier, scale=scale, options=options, paths=paths,
                                      ranks_available=ranks_available, ranks_because=ranks_because)
    dtype, collective = paths[0].dtype, setup.shape.collective
    ran = "nccl (NCCL_ALGO=Ring)" if tier.device == "cuda" else "gloo"
    return Lever(
        name=NAME, version=VERSION, tier=tier, description=REDUCTION_DESCRIPTION.format(runs=RUNS),
        recipe=setup.recipe_ref, cases=setup.cases,
        candidate=reduction.GradSync(f"{dtype}-{collective} (deterministic mode, {ran})", "candidate", dtype),
        default=reduction.GradSync(f"{dtype}-{collective} (nondeterminism allowed)", "default", dtype),
        reference=reduction.Fp64Sum("fp64-sum"),
        controls=(
            Control(name="ranks summed in another order each run",
                    implementation=reduction.GradSync(f"{dtype}-{collective}-order-varies", "order-varies", dtype)),
            Control(name="one rank dropped", implementation=reduction.GradSync(f"{dtype}-{collective}-rank-dropped",
                                                                     "rank-dropped", dtype)),
        ),
        rule=RULE, rule_reason=RULE_REASON, cpu_threads=1,
    )


def cpu_tier(recipe_id: str, options: LeverOptions) -> list[Lever]:
    """torch SDPA's flash CPU kernel and gloo ranks, at the smoke scale (the recipe's with --scale recipe)."""
    recipe = lever_recipe(recipe_id, options.recipe)
    return [
        attention_lever(recipe, tier=tiers.CPU, scale=options.at_scale(CPU_SCALE, RECIPE_SCALE), base=Sdpa("flash"),
                        options=options),
        reduction_determinism_lever(recipe, tier=tiers.CPU, options=options),
    ]


def gpu_attention_levers(recipe: Recipe, options: LeverOptions) -> list[Lever]:
    """Each torch SDPA backend at the recipe's scale that torch's dispatch lets run under deterministic
    algorithms (correctness.attention.combinations: cuDNN attention never does; flash runs packed
    plain-causal rows one at a time, as it takes no mask); none where no backend can."""
    scale = options.gpu_at_scale(CPU_SCALE, RECIPE_SCALE)
    cases = attention_lever_cases(recipe, scale, options)

    def build(path: Implementation, judged: tuple[Case, ...]) -> Lever:
        return attention_lever(recipe, tier=tiers.GPU, scale=scale, base=path, options=options, cases=judged)

    try:
        return gpu_sdpa_levers(attention.GPU_SDPA_BACKENDS, cases, build, deterministic=True, rows_apart=True)
    except NotApplicable:
        return []


def gpu_tier(recipe_id: str, options: LeverOptions) -> list[Lever]:
    """The torch SDPA backends that can run at the recipe's scale (gpu_attention_levers), and NCCL over
    this machine's GPUs (smoke scale; its cases skip at once, with the reason, with fewer than 2 GPUs)."""
    recipe = lever_recipe(recipe_id, options.recipe)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    because = reduction.ONE_GPU_PER_RANK
    if options.emulated is not None and gpus > EMULATED_RANKS:
        gpus, because = EMULATED_RANKS, (f"an emulated GPU runs at most {EMULATED_RANKS} NCCL ranks (each a process of"
                                         " its own: the code path, not the numbers at larger DP)")
    return [
        *gpu_attention_levers(recipe, options),
        reduction_determinism_lever(recipe, tier=tiers.GPU, options=options, ranks_available=gpus,
                                    ranks_because=because),
    ]


def recipe_gpu_tier(recipe_id: str, options: LeverOptions) -> list[Lever]:
    """TE's auto attention backend at the recipe's scale: what NVTE_ALLOW_NONDETERMINISTIC_ALGO=0
    makes it select, against what it selects otherwise."""
    recipe = lever_recipe(recipe_id, options.recipe)
    return [attention_lever(recipe, tier=tiers.recipe_gpu_tier(recipe.gpu), scale=options.gpu_at_scale(CPU_SCALE, RECIPE_SCALE),
                            base=TransformerEngine("auto"), options=options)]

SPEC = LeverSpec(
    name=NAME, version=VERSION,
    description="attention forward and backward and the data-parallel gradient reduction with --deterministic-mode's"
                " switches on, bitwise repeatable over three runs, against the same kernels with nondeterminism"
                " allowed and FP64",
    titles=("under deterministic mode",),
    tests=(
        TierTest(test="test_deterministic_mode_on_cpu", tier="cpu", factory=cpu_tier,
                 doc="torch SDPA's flash CPU kernel, and gloo ranks at DP 2, 4 and 8."),
        TierTest(test="test_deterministic_mode_on_gpu", tier="gpu", factory=gpu_tier,
                 doc="Each torch SDPA backend, and NCCL with NCCL_ALGO=Ring over this machine's GPUs."),
        TierTest(test="test_deterministic_mode_te_attention", tier=RECIPE_GPU, factory=recipe_gpu_tier),
    ),
    reads=(*SHAPE_READS, *DATA_PARALLEL, *GRADIENT_SYNC, "--qkv-format"),
    evidence=Evidence(klass=BOOKKEEPING, tier="cpu",
                      what="SDPA's flash CPU kernel and the gloo reduction are deterministic with the switches off"
                           " too: the switches and the repeat check run, no kernel changes"))
