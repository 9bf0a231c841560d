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
(`recipe_fuses`), which decides whether a failure is about the recipe (component test).

Negative controls: the candidate with one microbatch's gradient dropped (the one with the smallest
gradient, the hardest to miss); the candidate accumulating into a BF16 main_grad (as with
--grad-reduce-in-bf16: every addition rounded to BF16); the candidate starting from a main_grad
not zeroed (the previous step's gradient left in).

Tiers: "megatron-cpu" (megatron-core's autograd function on the CPU with the shims of
megatron_wgrad.py, smoke scale) and "megatron" (a CUDA GPU: the candidate Megatron's unfused
function on cuBLAS; the default Megatron's fused branch where apex's extension is installed, else
TE's Linear with fuse_wgrad_accumulation; the recipe's scale).
"""

from functools import partial
from typing import Any

from correctness import tiers
from correctness.grad_accumulation.inputs import (
    CORRELATIONS, AccumulationInputs, accumulation_shape, make_inputs, tensor_name,
)
from correctness.grad_accumulation.megatron_wgrad import DROPPED, STALE, MegatronWgrad, fused_extension
from correctness.grad_accumulation.te_wgrad import TeWgrad
from correctness.lever import Case, Control, Lever, LeverOptions, PathOutput, Tier
from correctness.models import facts_for
from correctness.recipes import Recipe, lever_recipe
from references.weight_gradient import accumulated_weight_gradient

NAME = "gradient-accumulation-fusion"
VERSION = 1
SEEDS = (0,)
DESCRIPTION = ("gradient accumulation without the fusion: a linear layer's weight gradient rounded to BF16 per"
               " microbatch and added to the FP32 main_grad, against the fused FP32 accumulation and an FP64 sum")

CANDIDATE = MegatronWgrad(fused=False)
MEGATRON_FUSED = MegatronWgrad(fused=True)


class Fp64Accumulation:
    name = "fp64-weight-gradient-sum"

    def run(self, inputs: AccumulationInputs) -> PathOutput:
        shape = inputs.shape
        microbatches = (inputs.microbatch(m) for m in range(shape.microbatches))
        sums = accumulated_weight_gradient(microbatches, shape.counts)
        return PathOutput(tensors={tensor_name(count): sums[count] for count in shape.counts}, backend=self.name)


def _dropped_inapplicable(case: Case) -> str | None:
    return None if case.shape.microbatches > 1 else "one microbatch per step: dropping it leaves nothing to judge"


CONTROLS = (
    Control(name="one microbatch's gradient dropped", path=MegatronWgrad(fused=False, mutation=DROPPED),
            why_inapplicable=_dropped_inapplicable),
    Control(name="accumulated into a BF16 main_grad", path=MegatronWgrad(fused=False, buffer="bf16")),
    Control(name="main_grad not zeroed before the step", path=MegatronWgrad(fused=False, mutation=STALE)),
)


def summarize(result: Any) -> dict[str, Any]:
    """Per microbatch count: the candidate's and the default's errors and the candidate's error over
    its bound; each control's power, whole and least over the counts it changes."""
    if result.candidate is None:
        return {}
    per_count = {
        comparison.tensor: {"candidate_error": comparison.error, "default_error": comparison.default_error,
                            "error_over_bound": comparison.error_over_bound, "passes": comparison.passes}
        for comparison in result.candidate.tensors
    }
    controls = {}
    for control in result.controls:
        if control.judgement is None:
            controls[control.name] = {"inapplicable": control.inapplicable_reason}
            continue
        powers = {comparison.tensor: comparison.error_over_bound for comparison in control.judgement.tensors}
        controls[control.name] = {"power": control.power, "per_count": powers}
    return {"per_count": per_count, "controls": controls}


def accumulation_lever(recipe: Recipe, *, tier: Tier, scale: str, options: LeverOptions, default=MEGATRON_FUSED,
                       candidate=CANDIDATE) -> Lever:
    model = facts_for(recipe.model, options.model)
    shapes = [(accumulation_shape(recipe, model, scale, shared), variant) for shared, variant in CORRELATIONS]
    cases = tuple(
        Case(id=f"{shape.id}-seed{seed}", shape=shape, seed=seed, source="synthetic", variant=variant,
             make_inputs=partial(make_inputs, shape, seed))
        for shape, variant in shapes for seed in SEEDS
    )
    return Lever(
        name=NAME, version=VERSION, tier=tier, description=DESCRIPTION, recipe=recipe.ref_for(model), cases=cases,
        candidate=candidate, default=default, reference=Fp64Accumulation(), controls=CONTROLS, summarize=summarize,
        cpu_threads=1,  # small GEMMs: a second thread on a shared 2-core host made every path 20-50x slower
    )


def cpu_tier(recipe_id: str, options: LeverOptions, candidate=CANDIDATE) -> list[Lever]:
    """Megatron's linear autograd function and DDP's hook on the CPU (shims: megatron_wgrad.py), smoke scale."""
    recipe = lever_recipe(recipe_id, options.recipe)
    return [accumulation_lever(recipe, tier=tiers.MEGATRON_CPU, scale="smoke", options=options, candidate=candidate)]


def megatron_gpu_tier(recipe_id: str, options: LeverOptions) -> list[Lever]:
    """On a CUDA GPU at the recipe's scale: Megatron's unfused function on cuBLAS against Megatron's
    fused branch (apex's wgrad_gemm_accum_fp32) where apex is installed, else TE's Linear with
    fuse_wgrad_accumulation."""
    recipe = lever_recipe(recipe_id, options.recipe)
    default = MEGATRON_FUSED if fused_extension() is not None else TeWgrad(fused=True)
    return [accumulation_lever(recipe, tier=tiers.MEGATRON_GPU, scale="recipe", options=options, default=default)]


def recipe_fuses(shape) -> bool:
    return shape.recipe_fuses


__all__ = ["NAME", "VERSION", "DESCRIPTION", "cpu_tier", "megatron_gpu_tier", "accumulation_lever", "recipe_fuses"]
