"""The gradient-accumulation-fusion lever (`--no-gradient-accumulation-fusion`): one linear
layer's weight gradient accumulated over a step's microbatches into the FP32 gradient buffer
(main_grad) by Megatron without the fusion (candidate: each microbatch's gradient rounded to BF16
by its GEMM, then added to main_grad by DDP's hook) against Megatron with the fusion (default,
Megatron-LM's: the wgrad GEMM accumulates into main_grad in FP32) and the FP64 sum of the FP64
products (references/weight_gradient.py). Paths: correctness/grad_accumulation/megatron_wgrad.py
(and te_wgrad.py on a GPU without apex); inputs and shapes: correctness/grad_accumulation/inputs.py.

Judged: `main_grad_after_<k>`, the buffer after the step's k microbatches (what the optimizer then
reads, before the data-parallel reduction), FP32; under dynamic batching, where a step may hold
fewer, after 1, 2, 4, ... as well. Two cases: microbatch gradients uncorrelated (noise-dominated,
the usual regime of a microbatch of a few rows) and correlated 0.3 (a shared signal). The candidate is
always the unfused path; the record's shape says whether the recipe itself fuses
(`recipe_fuses`).

Format floor (`wgrad_floor`): the FP64 sum of the microbatches' FP64 weight gradients, each rounded
once to BF16 (the recipe's dtype), as the unfused wgrad GEMM rounds its output; otherwise exact.
One correct rounding is 1.66e-3 relative, above the rule's 1e-3 slack: where the floor fails the
rule, the candidate is judged against it (format-limited where within 2 x its error + 1e-3 and
unbiased against it). The floor is also a secondary reference: the slope BF16's round to nearest
even leaves in a sum of many rounded terms (a shrinkage of a few 1e-6) is the floor's too, not the
candidate's own. Wrong BF16 implementations: correctness.grad_accumulation.wrong.

Negative controls: the candidate with one microbatch's gradient dropped (the one with the smallest
gradient, the hardest to miss); the candidate accumulating into a BF16 main_grad (as with
--grad-reduce-in-bf16: every addition rounded to BF16); the candidate starting from a main_grad
not zeroed (the previous step's gradient left in).

Tiers: "megatron-cpu" (megatron-core's autograd function on the CPU with the shims of
megatron_wgrad.py, smoke scale) and "megatron" (a CUDA GPU: the candidate Megatron's unfused
function on cuBLAS; the default Megatron's fused branch where apex's extension is installed, else
TE's Linear with fuse_wgrad_accumulation; the recipe's scale).
"""

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from correctness import tiers
from correctness.grad_accumulation.inputs import (
    CORRELATIONS, DTYPES, AccumulationInputs, AccumulationShape, accumulation_shape, make_inputs, tensor_name,
)
from correctness.grad_accumulation.megatron_wgrad import DROPPED, STALE, MegatronWgrad, fused_extension
from correctness.grad_accumulation.te_wgrad import TeWgrad
from correctness.evidence import UPSTREAM, Evidence
from correctness.lever import Case, Control, FormatFloor, Lever, LeverOptions, ImplementationOutput, Tier
from correctness.lever_spec import DATA_PARALLEL, SHAPE_READS, LeverSpec, TierTest
from correctness.models import facts_for
from correctness.recipes import Recipe, lever_recipe
from references.rounding import round_to_nearest
from references.weight_gradient import accumulated_weight_gradient

NAME = "gradient-accumulation-fusion"
VERSION = 2  # 2: the format floor (each microbatch's weight gradient rounded to BF16 once)
FORMAT_NAMES = {torch.bfloat16: "BF16", torch.float16: "FP16"}
SEEDS = (0,)
DESCRIPTION = ("gradient accumulation without the fusion: a linear layer's weight gradient rounded to BF16 per"
               " microbatch and added to the FP32 main_grad, against the fused FP32 accumulation and an FP64 sum")

CANDIDATE = MegatronWgrad(fused=False)
MEGATRON_FUSED = MegatronWgrad(fused=True)


@dataclass(frozen=True)
class Fp64Accumulation:
    """The FP64 reference; with `wgrad_in` (the format floor), each microbatch's FP64 weight gradient
    rounded once to that dtype before the FP64 sum, handed over in FP32 as main_grad is."""

    wgrad_in: torch.dtype | None = None

    @property
    def name(self) -> str:
        if self.wgrad_in is None:
            return "fp64-weight-gradient-sum"
        return f"fp64-weight-gradient-sum of {FORMAT_NAMES[self.wgrad_in]} microbatch gradients (format floor)"

    def run(self, inputs: AccumulationInputs) -> ImplementationOutput:
        shape, narrow = inputs.shape, self.wgrad_in
        microbatches = (inputs.microbatch(m) for m in range(shape.microbatches))
        rounding = None if narrow is None else partial(round_to_nearest, dtype=narrow)
        sums = accumulated_weight_gradient(microbatches, shape.counts, rounding=rounding)
        tensors = {tensor_name(count): sums[count] for count in shape.counts}
        if narrow is not None:
            tensors = {name: total.to(torch.float32) for name, total in tensors.items()}
        return ImplementationOutput(tensors=tensors, backend=self.name)


def wgrad_floor(dtype: str) -> FormatFloor:
    """The format floor of the unfused path at the recipe's `dtype`: each microbatch's weight
    gradient rounded to it once, as the unfused wgrad GEMM's output is, then summed exactly."""
    narrow = DTYPES[dtype]
    name = FORMAT_NAMES[narrow]
    return FormatFloor(
        format=name,
        roundings=(f"each microbatch's weight gradient to {name} once (round to nearest even), as the unfused wgrad"
                   f" GEMM writes it, before it is added to the FP32 main_grad",),
        implementation=Fp64Accumulation(wgrad_in=narrow),
    )


def _dropped_inapplicable(case: Case) -> str | None:
    return None if case.shape.microbatches > 1 else "one microbatch per step: dropping it leaves nothing to judge"


CONTROLS = (
    Control(name="one microbatch's gradient dropped", implementation=MegatronWgrad(fused=False, mutation=DROPPED),
            why_inapplicable=_dropped_inapplicable),
    Control(name="accumulated into a BF16 main_grad", implementation=MegatronWgrad(fused=False, buffer="bf16")),
    Control(name="main_grad not zeroed before the step", implementation=MegatronWgrad(fused=False, mutation=STALE)),
)


def summarize(result: Any) -> dict[str, Any]:
    """Per microbatch count: the candidate's, the default's and the format floor's errors and the
    candidate's error over its bound and over the format bound; each control's power (its largest
    error over the bound) and its power against the format bound, whole and per count."""
    if result.candidate is None:
        return {}
    against_floor = {t.tensor: t for t in result.format.candidate.tensors} if result.format else {}
    per_count = {}
    for comparison in result.candidate.tensors:
        figures = {"candidate_error": comparison.error, "default_error": comparison.default_error,
                   "error_over_bound": comparison.error_over_bound, "passes": comparison.passes}
        floor = against_floor.get(comparison.tensor)
        if floor is not None:
            figures.update(floor_error=floor.default_error, error_over_format_bound=floor.error_over_bound)
        per_count[comparison.tensor] = figures
    format_controls = {control.name: control for control in result.format.controls} if result.format else {}
    controls = {}
    for control in result.controls:
        if control.judgement is None:
            controls[control.name] = {"inapplicable": control.inapplicable_reason}
            continue
        powers = {comparison.tensor: comparison.error_over_bound for comparison in control.judgement.tensors}
        controls[control.name] = {"power": control.power, "per_count": powers}
        if control.name in format_controls:
            judged = format_controls[control.name]
            controls[control.name].update(format_power=judged.power, format_per_count={
                comparison.tensor: comparison.error_over_bound for comparison in judged.judgement.tensors})
    return {"per_count": per_count, "controls": controls}


# Peak bytes per element of the weight gradient (FP32 and FP64 accumulators, each path's result) and
# per element of the microbatches' activations and output gradients, which a case draws whole in
# their dtype and reads one microbatch at a time. Measured on Gemma's smoke case (128 microbatches of
# 256 tokens, 512 x 336): 320 MB against an estimate of 453 MB.
WEIGHT_BYTES = 48
ACTIVATION_BYTES = 16


def accumulation_memory(shape: AccumulationShape) -> dict[str, Any]:
    """A case's estimated peak bytes (Case.memory_bytes, memory_driver): the weight gradient and every
    microbatch's activations and output gradients."""
    tokens = shape.seq_len * shape.batch * shape.microbatches
    estimate = WEIGHT_BYTES * shape.rows * shape.cols + ACTIVATION_BYTES * tokens * (shape.rows + shape.cols)
    return {"memory_bytes": estimate,
            "memory_driver": f"{shape.microbatches} microbatches of {shape.seq_len * shape.batch} tokens x"
                             f" {shape.rows} x {shape.cols}"}


def accumulation_lever(recipe: Recipe, *, tier: Tier, scale: str, options: LeverOptions, default=MEGATRON_FUSED,
                       candidate=CANDIDATE) -> Lever:
    model = facts_for(recipe, options.model)
    shapes = [(accumulation_shape(recipe, model, scale, shared), variant) for shared, variant in CORRELATIONS]
    cases = tuple(
        Case(id=f"{shape.id}-seed{seed}", shape=shape, seed=seed, source="synthetic", variant=variant,
             make_inputs=partial(make_inputs, shape, seed), recipe_runs="default" if shape.recipe_fuses else "candidate",
             **accumulation_memory(shape))
        for shape, variant in shapes for seed in SEEDS
    )
    floor = wgrad_floor(recipe.precision)
    return Lever(
        name=NAME, version=VERSION, tier=tier, description=DESCRIPTION, recipe=recipe.ref_for(model), cases=cases,
        candidate=candidate, default=default, reference=Fp64Accumulation(), controls=CONTROLS,
        format_floor=floor, secondary_references=(floor.implementation,), summarize=summarize,
        cpu_threads=1,  # small GEMMs: a second thread on a shared 2-core host made every path 20-50x slower
    )


def cpu_tier(recipe_id: str, options: LeverOptions, candidate=CANDIDATE) -> list[Lever]:
    """Megatron's linear autograd function and DDP's hook on the CPU (shims: megatron_wgrad.py), at
    the smoke scale (the recipe's with --scale recipe)."""
    recipe = lever_recipe(recipe_id, options.recipe)
    return [accumulation_lever(recipe, tier=tiers.MEGATRON_CPU, scale=options.at_scale("smoke", "recipe"),
                               options=options, candidate=candidate)]


def megatron_gpu_tier(recipe_id: str, options: LeverOptions) -> list[Lever]:
    """On a CUDA GPU at the recipe's scale: Megatron's unfused function on cuBLAS against Megatron's
    fused branch (apex's wgrad_gemm_accum_fp32) where apex is installed, else TE's Linear with
    fuse_wgrad_accumulation."""
    recipe = lever_recipe(recipe_id, options.recipe)
    default = MEGATRON_FUSED if fused_extension() is not None else TeWgrad(fused=True)
    return [accumulation_lever(recipe, tier=tiers.MEGATRON_GPU, scale=options.gpu_at_scale("smoke", "recipe"),
                               options=options, default=default)]


__all__ = ["NAME", "VERSION", "DESCRIPTION", "cpu_tier", "megatron_gpu_tier", "accumulation_lever", "wgrad_floor"]

SPEC = LeverSpec(
    name=NAME, version=VERSION,
    description="gradient accumulation without the fusion: a linear layer's weight gradient rounded to BF16 per"
                " microbatch and added to the FP32 main_grad, against the fused FP32 accumulation and an FP64 sum",
    titles=("gradient accumulation without the fusion",),
    tests=(
        TierTest(test="test_gradient_accumulation_fusion_cpu", tier="megatron-cpu", factory=cpu_tier,
                 doc="Megatron's linear autograd function and DDP's hook on the CPU (shims:"
                     " grad_accumulation/megatron_wgrad.py)."),
        TierTest(test="test_gradient_accumulation_fusion_gpu", tier="megatron", factory=megatron_gpu_tier),
    ),
    reads=(*SHAPE_READS, *DATA_PARALLEL, "workload.global_batch", "--grad-reduce-in-bf16",
           "--no-gradient-accumulation-fusion"),
    evidence=Evidence(klass=UPSTREAM, tier="megatron-cpu",
                      what="Megatron's linear autograd function and DDP's hook, BF16 wgrad per microbatch, against its"
                           " fused branch on apex's FP32 GEMM-accumulate arithmetic"))
