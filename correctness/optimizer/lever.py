"""The optimizer-offload lever: Megatron's CPU optimizer offload at the recipe's fraction F against
fraction 1.0 (every parameter on the CPU's torch AdamW) and an FP64 reference.

The parameters are TP rank 0's slices of the first layer of each attention kind (Gemma-4-31B:
layers 0 and 5) and of the embedding's first EMBEDDING_ROWS rows, as the Gemma recipe's component
test takes them. Three steps at the recipe's schedule (iterations 1-3: lr 0, then warmup), with
seeded gradients at given pre-clip norms; every tensor's master, update, BF16 weights and moments
are compared, streamed one block of rows at a time so that the recipe scale fits a small machine.

Tiers: "cpu" (smoke scale: the GPU share on an eager AdamW with TE FusedAdam's FP32 arithmetic),
the recipe's GPU ("h100": recipe scale, the GPU share on TE FusedAdam), "megatron" (Megatron's own
HybridDeviceOptimizer on the whole inventory, on a GPU with TE FusedAdam) and "megatron-cpu" (the
same upstream code on the CPU, its GPU share on TE FusedAdam's arithmetic). Every tier is one call
of `offload_lever` with its candidate and the candidate's wrong variants. Negative controls: no
bias correction, BF16 masters, and no gradient clipping.
"""

import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import Any

import torch

from correctness import tiers
from correctness.adam.inputs import DEFAULT_PRECLIP_NORMS, OptimizerUnit, optimizer_units, streamed_memory
from correctness.adam.offload_setting import EMBEDDING_ROWS, TP_RANK, OffloadSetting, offload_setting
from correctness.adam.reference import Fp64AdamW
from correctness.adam.share_summary import share_summary
from correctness.adam.split import GPU, offload_summary
from correctness.adam.synthetic_values import synthetic_slice
from correctness.evidence import UPSTREAM, Evidence
from correctness.lever import Case, Control, Implementation, Invariant, Lever, LeverOptions, Mutated, Streamed, Tier
from correctness.lever_spec import OPTIMIZER_READS, RECIPE_GPU, LeverSpec, TierTest
from correctness.wording import optimizer_offload
from correctness.optimizer.checkpoint_values import load_slice
from correctness.megatron.layout import RECIPE, SMOKE, ParamScale, first_layer_of_each_kind
from correctness.optimizer.megatron import AllUnits, MegatronHybrid, WholeInventory
from correctness.optimizer.paths import EagerAdamW, OffloadSplit, TeFusedAdam, TorchAdamW

NAME = "optimizer-offload"
VERSION = 1
SYNTHETIC_SEED = 0


@dataclass(frozen=True, kw_only=True)
class OffloadShape:
    """What one case updates: the slices, their split at the fraction, and the steps."""

    model: str
    scale: str
    tp_size: int
    tp_rank: int
    layers: tuple[int, ...]
    layer_kinds: tuple[str, ...]
    embedding_rows: int
    fraction: float
    tensors: int
    parameters: int
    gpu_parameters: int
    gpu_tensors: tuple[str, ...]
    vector_tensors: tuple[str, ...]  # the 1-D tensors (norm gains, biases, Mamba's A_log, D, dt_bias)
    optimizers: dict[str, dict[str, Any]]  # per optimizer (dense, expert): its own split
    inventory: tuple[tuple[str, tuple[int, ...], str, str], ...]  # (name, shape, optimizer, share) per tensor
    steps: int
    preclip_norms: tuple[float, ...]
    overlap_cpu_optimizer_d2h_h2d: bool  # the recipe's --overlap-cpu-optimizer-d2h-h2d, as Megatron gets it

    @property
    def id(self) -> str:
        layers = "+".join(f"{layer}" for layer in self.layers)
        return (
            f"{self.model}-tp{self.tp_size}r{self.tp_rank}-layers{layers}-emb{self.embedding_rows}-{self.scale}"
            f"-f{self.fraction:g}-{self.steps}steps"
        )

    def record(self) -> dict[str, Any]:
        fields = asdict(self)
        fields["inventory"] = [
            {"name": name, "shape": list(shape), "optimizer": optimizer, "share": share}
            for name, shape, optimizer, share in self.inventory
        ]
        return {"id": self.id, **fields, "gpu_share": self.gpu_parameters / self.parameters}


def offload_shape(setting: OffloadSetting, preclip_norms: tuple[float, ...]) -> OffloadShape:
    on_gpu = [p for p in setting.slices if setting.shares[p.name] == GPU]
    summary = offload_summary(setting.slices, setting.fraction)
    optimizers = {
        name: {"tensors": part.tensors, "parameters": part.parameters, "gpu_parameters": part.gpu_numel,
               "gpu_share": part.gpu_share, "gpu_tensors": list(part.gpu)}
        for name, part in summary.optimizers.items()
    }
    return OffloadShape(
        model=setting.model.short_name, scale=setting.scale.name, tp_size=setting.recipe.tp, tp_rank=TP_RANK,
        layers=first_layer_of_each_kind(setting.model),
        layer_kinds=tuple(setting.model.layer_kind(layer) for layer in first_layer_of_each_kind(setting.model)),
        embedding_rows=EMBEDDING_ROWS, vector_tensors=tuple(p.name for p in setting.slices if len(p.shape) == 1),
        fraction=setting.fraction, tensors=len(setting.slices), parameters=sum(p.numel for p in setting.slices),
        gpu_parameters=sum(p.numel for p in on_gpu), gpu_tensors=tuple(p.name for p in on_gpu),
        optimizers=optimizers, steps=len(preclip_norms), preclip_norms=preclip_norms,
        overlap_cpu_optimizer_d2h_h2d=setting.config.overlap_cpu_optimizer_d2h_h2d,
        inventory=tuple((p.name, p.shape, p.optimizer, setting.shares[p.name]) for p in setting.slices),
    )


def offload_cases(setting: OffloadSetting, options: LeverOptions, whole: bool) -> tuple[Case, ...]:
    """A synthetic-weights case, and a checkpoint-weights case (recipe scale, with a checkpoint).
    Inputs are streamed unit by unit, or held whole (`whole`) for a path that needs every parameter."""
    shape = offload_shape(setting, DEFAULT_PRECLIP_NORMS)

    def inputs(weights) -> Streamed | WholeInventory:
        units = optimizer_units(
            setting.slices, seed=SYNTHETIC_SEED, preclip_norms=DEFAULT_PRECLIP_NORMS, weights=weights,
            config=setting.config,
        )
        return WholeInventory(units=tuple(units)) if whole else Streamed(units=units)

    checkpoint = options.model_checkpoint
    held = whole_inventory_memory(shape) if whole else streamed_memory(
        setting.slices, per_unit_element=STREAMED_BYTES_PER_UNIT_ELEMENT, fixed=STREAMED_FIXED_BYTES)
    return (
        Case(
            id=f"{shape.id}-synthetic-seed{SYNTHETIC_SEED}", shape=shape, seed=SYNTHETIC_SEED, source="synthetic",
            variant="synthetic-weights",
            make_inputs=lambda device: inputs(lambda param: synthetic_slice(param, SYNTHETIC_SEED)), **held,
        ),
        Case(
            id=f"{shape.id}-checkpoint-seed{SYNTHETIC_SEED}", shape=shape, seed=SYNTHETIC_SEED, source="checkpoint",
            variant="checkpoint-weights",
            make_inputs=lambda device: inputs(lambda param: load_slice(checkpoint, param)), **held,
            skip_reason=None if checkpoint is not None and setting.scale == RECIPE
            else "checkpoint weights run at the recipe scale with a model checkpoint"
            " (--model-checkpoint DIR or CORRECTNESS_MODEL_CHECKPOINT)",
            required=False,
        ),
    )


# Resident bytes per parameter of a case whose paths hold every parameter at once (Megatron's
# HybridDeviceOptimizer steps the whole inventory): its inputs, the optimizer's state, and each path's
# outputs beside the FP64 reference's. Measured on the megatron-cpu cases at 1/8 and 1/4 of the
# recipe's dimensions, peak against peak: Gemma 156 bytes per parameter more (8.7M and 34.8M
# parameters, 2.74 and 6.52 GB), Nemotron 200 (7.2M and 28.2M, 1.76 and 5.66 GB); the larger is
# taken.
WHOLE_INVENTORY_BYTES_PER_PARAMETER = 200
# A streamed case holds one unit at a time (correctness.adam.inputs.streamed_memory): 700 bytes per
# element of the largest unit over its nine paths, the two FP64 references' outputs and the
# comparisons, and 100 MB besides. Measured peak above the process's own (VmHWM), against this
# estimate: Gemma at the smoke scale 0.25 GB (estimate 0.42, 1.7 x), at 1/8, 1/4 and 1/2 of the
# recipe's dimensions 0.82, 1.32 and 1.21 GB, at the recipe's 1.25 GB (556M parameters; 2.03 GB,
# 1.6 x); Nemotron at the smoke scale 0.17 GB (0.19, 1.15 x), at 1/4 and 1/2 0.59 and 1.46 GB, at the
# recipe's 1.57 GB (444M parameters, 147 tensors; 1.70 GB, 1.08 x).
STREAMED_BYTES_PER_UNIT_ELEMENT = 700
STREAMED_FIXED_BYTES = 100_000_000


def whole_inventory_memory(shape: OffloadShape) -> dict[str, Any]:
    """Case.memory_bytes and memory_driver of a case held whole."""
    return {"memory_bytes": shape.parameters * WHOLE_INVENTORY_BYTES_PER_PARAMETER,
            "memory_driver": f"{shape.parameters:,} parameters held at once by Megatron's optimizer, about"
                             f" {WHOLE_INVENTORY_BYTES_PER_PARAMETER} bytes each"}


def unclipped(unit: OptimizerUnit) -> OptimizerUnit:
    return unit.with_config(clip_grad=math.inf)


@dataclass(frozen=True, kw_only=True)
class OffloadCandidate:
    """A tier's candidate and its two deliberately wrong variants (the third control, no clipping,
    runs the candidate on unclipped gradients). `whole`: its paths run on the whole inventory at
    once (Megatron's own optimizer makes its own split); the default and references then join
    their per-unit runs."""

    path: Implementation
    no_bias_correction: Implementation
    bf16_masters: Implementation
    whole: bool = False


def split_candidate(setting: OffloadSetting, device_share: Callable[..., Implementation]) -> OffloadCandidate:
    """The modelled split: each parameter on its share's optimizer, `device_share` (a path class
    taking `bias_correction` and `master`) on the GPU share. The controls swap in wrong optimizers
    on both shares (on the CPU share, an eager AdamW, as torch's AdamW has no switch for either)."""
    split = partial(OffloadSplit, fraction=setting.fraction, shares=setting.shares)
    return OffloadCandidate(
        path=split(cpu=TorchAdamW(), device=device_share()),
        no_bias_correction=split(cpu=EagerAdamW(bias_correction=False), device=device_share(bias_correction=False)),
        bf16_masters=split(cpu=EagerAdamW(master=torch.bfloat16), device=device_share(master=torch.bfloat16)),
    )


def megatron_candidate(setting: OffloadSetting, device: str) -> OffloadCandidate:
    """Megatron's own HybridDeviceOptimizer; its controls are the same optimizer with bias
    correction off (it reaches the GPU share's FusedAdam only) and with BF16 masters."""
    hybrid = partial(MegatronHybrid, setting.fraction, device=device)
    return OffloadCandidate(
        path=hybrid(), no_bias_correction=hybrid(bias_correction=False), bf16_masters=hybrid(fp32_masters=False),
        whole=True,
    )


def bf16_weights_are_rounded_masters(inputs: Any, tensors: Mapping[str, torch.Tensor]) -> str | None:
    """Each parameter's BF16 weights after the steps equal its FP32 master rounded to nearest even:
    the copy the next forward pass reads. A copy not refreshed after a step, truncated instead of
    rounded, or rounded from another value breaks it exactly; no bound is needed."""
    broken, checked = [], 0
    for name, bf16 in tensors.items():
        if not name.endswith(":bf16"):
            continue
        master = tensors.get(name.removesuffix(":bf16") + ":master")
        if master is None or master.dtype != torch.float32 or bf16.dtype != torch.bfloat16:
            continue
        checked += 1
        differ = bf16.cpu() != master.cpu().to(torch.bfloat16)
        if bool(differ.any()):
            broken.append(f"{name.removesuffix(':bf16')} ({int(differ.sum())} of {bf16.numel()} elements)")
    if not broken:
        return None
    return f"{len(broken)} of {checked} parameters' BF16 weights are not their FP32 masters rounded: {', '.join(broken[:3])}"


BF16_WEIGHTS_ARE_ROUNDED_MASTERS = Invariant(
    name="BF16 weights are the FP32 masters rounded to nearest", check=bf16_weights_are_rounded_masters
)


def _unclipped_whole(inputs: WholeInventory) -> WholeInventory:
    return inputs.mutated(unclipped)


def offload_lever(
    setting: OffloadSetting, *, tier: Tier, options: LeverOptions, candidate: OffloadCandidate
) -> Lever:
    """The lever of every tier: `candidate` against fraction 1.0 (torch AdamW on the CPU) and the
    FP64 reference, with the three negative controls."""
    join = AllUnits if candidate.whole else (lambda path: path)
    return Lever(
        name=NAME, version=VERSION, tier=tier, description=describe(setting), recipe=setting.recipe.ref_for(setting.model),
        cases=offload_cases(setting, options, whole=candidate.whole), candidate=candidate.path,
        default=join(TorchAdamW()), reference=join(Fp64AdamW()),
        controls=(
            Control(name="no bias correction", implementation=candidate.no_bias_correction),
            Control(name="BF16 masters", implementation=candidate.bf16_masters),
            Control(name="no clipping", implementation=Mutated(
                base=candidate.path, mutation="gradients not clipped",
                mutate=_unclipped_whole if candidate.whole else unclipped,
            )),
        ),
        secondary_references=(join(Fp64AdamW(fp32_hyperparameters=True)),),
        summarize=share_summary(setting.shares, {p.name: p.numel for p in setting.slices}),
        # blocks of at most 2.1M elements: one thread is as fast (on the CPU, the emulated GPU's too)
        cpu_threads=1 if tier.device == "cpu" or options.emulated is not None else None,
        invariants=(BF16_WEIGHTS_ARE_ROUNDED_MASTERS,),
    )


def describe(setting: OffloadSetting) -> str:
    return f"CPU optimizer offload fraction {setting.fraction:g} against fraction 1.0 and an FP64 reference"


def cpu_tier(
    recipe_id: str, options: LeverOptions, scale: ParamScale | None = None, candidate: Implementation | None = None
) -> list[Lever]:
    """On the CPU (smoke scale in CI; the benchmark runs it at the recipe scale): the GPU share on an
    eager AdamW with TE FusedAdam's FP32 arithmetic, or `candidate` (any path taking an
    OptimizerUnit) in place of the whole split; the controls stay the split's."""
    setting = offload_setting(recipe_id, scale or options.at_scale(SMOKE, RECIPE), options)
    split = split_candidate(setting, EagerAdamW)
    return [
        offload_lever(
            setting, tier=tiers.CPU, options=options,
            candidate=split if candidate is None else replace(split, path=candidate),
        )
    ]


def recipe_gpu_tier(recipe_id: str, options: LeverOptions) -> list[Lever]:
    """Recipe scale on the recipe's GPU: the GPU share on TE FusedAdam."""
    setting = offload_setting(recipe_id, options.gpu_at_scale(SMOKE, RECIPE), options)
    return [
        offload_lever(
            setting, tier=tiers.recipe_gpu_tier(setting.recipe.gpu), options=options,
            candidate=split_candidate(setting, TeFusedAdam),
        )
    ]


def megatron_tier(recipe_id: str, options: LeverOptions, scale: ParamScale = SMOKE) -> list[Lever]:
    """Megatron's own HybridDeviceOptimizer on a GPU (megatron-core, TE, CUDA) on the whole inventory."""
    setting = offload_setting(recipe_id, scale, options)
    return [
        offload_lever(
            setting, tier=tiers.MEGATRON_GPU, options=options,
            candidate=megatron_candidate(setting, tiers.MEGATRON_GPU.device),
        )
    ]


def megatron_cpu_tier(recipe_id: str, options: LeverOptions, scale: ParamScale | None = None) -> list[Lever]:
    """Megatron's own HybridDeviceOptimizer on the CPU (megatron-core only): upstream's code makes
    the split and steps both shares, under the shims of correctness.optimizer.megatron_on_cpu, with
    TE FusedAdam's arithmetic on the GPU share."""
    setting = offload_setting(recipe_id, scale or options.at_scale(SMOKE, RECIPE), options)
    return [
        offload_lever(
            setting, tier=tiers.MEGATRON_CPU, options=options,
            candidate=megatron_candidate(setting, tiers.MEGATRON_CPU.device),
        )
    ]

SPEC = LeverSpec(
    name=NAME, version=VERSION,
    description="the CPU optimizer offload at the candidate's fraction (GPU share on TE FusedAdam) against fraction"
                " 1.0 (all torch AdamW on the CPU) and FP64",
    titles=("optimizer offload", "offload fraction"),
    tests=(
        TierTest(test="test_offload_fraction_cpu", tier="cpu", factory=cpu_tier),
        TierTest(test="test_offload_with_megatron_hybrid_optimizer_on_cpu", tier="megatron-cpu",
                 factory=megatron_cpu_tier,
                 doc="Megatron's own HybridDeviceOptimizer makes the split and steps both shares, on the CPU."),
        TierTest(test="test_offload_with_megatron_hybrid_optimizer", tier="megatron", factory=megatron_tier),
        TierTest(test="test_offload_with_te_fused_adam", tier=RECIPE_GPU, factory=recipe_gpu_tier),
    ),
    reads=OPTIMIZER_READS,
    evidence=Evidence(klass=UPSTREAM, tier="megatron-cpu",
                      what="Megatron's own HybridDeviceOptimizer splits and steps both shares: torch AdamW on the CPU"
                           " share, a stand-in of TE FusedAdam's FP32 arithmetic on the GPU share"),
    entry_text=optimizer_offload.entry_text)
