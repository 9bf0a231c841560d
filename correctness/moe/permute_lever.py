"""The permute-fusion lever (`--moe-permute-fusion`): TE's fused permute and unpermute against
megatron-core's torch ones (fused=False, the default) and the FP64 permutation
(references/moe_experts.py), forward and backward (correctness/moe/permutation.py says what each
computes). Two levers, one per rule:

- `moe-permute-fusion`: the gathers (the permuted tokens and probs, the probs' gradient put back,
  the combine's row gradient), which move values and compute nothing. Rule(factor 1, slack 0): the
  candidate's error may not exceed the default's, which is zero, so every element must equal FP64's
  (the reference rounds nothing: FP64 holds every BF16 and FP32 value exactly).
- `moe-permute-fusion-sums`: what adds a token's top-k values (permute's token gradient, the
  combine with and without merging probs, the weighted rows' gradient and the merging probs'
  gradient), in an order and a precision each implementation chooses: the suite's rule.

Tiers: `megatron-cpu`, a torch stand-in of TE's kernels' arithmetic (IndexPermutation: a row map,
FP32 accumulation, one rounding) against Megatron's torch functions, smoke scale (TE's Triton kernels
do not run on a CPU); the recipe's GPU with `megatron`, Megatron's functions with fused=True (TE's
moe_permute_with_probs / moe_unpermute) against fused=False on CUDA, recipe scale.
Inputs: one GPU's tokens routed by a seeded router over all the model's experts with its top-k (the
dispatcher's first permutation, before the all-to-all); the width is the experts' input (Nemotron's
latent size: the layer projects before dispatch).
Controls: a token sent to a neighbour expert, the two busiest experts' rows swapped, a token dropped,
the routing weights not applied (ones).
"""

from dataclasses import replace
from typing import Any
from functools import partial

from correctness import tiers
from correctness.evidence import BOOKKEEPING, Evidence
from correctness.lever import Case, Control, Lever, LeverOptions, Mutated, Tier
from correctness.lever_spec import RECIPE_GPU, SHAPE_READS, LeverSpec, TierTest
from correctness.recipe_sets import NEMOTRON, QWEN3_MOE
from correctness.models import facts_for
from correctness.moe import permutation
from correctness.moe.shapes import MoeShape, moe_shape
from correctness.recipes import Recipe, lever_recipe
from correctness.rule import Rule

EXACT_NAME = "moe-permute-fusion"
SUMS_NAME = "moe-permute-fusion-sums"
VERSION = 1
SEEDS = (0,)
FLAG = "--moe-permute-fusion"
EXACT_RULE = Rule(factor=1.0, slack=0.0)
EXACT_REASON = ("a permutation moves values and computes none: the gathered tensors must equal FP64's bit for bit,"
                " which the default's zero error makes the bound (the rule's slack would let a wrong row pass)")
MUTATIONS = (
    ("a token sent to a neighbour expert", permutation.token_to_neighbour),
    ("the two busiest experts' rows swapped", permutation.experts_swapped),
    ("a token dropped", permutation.token_dropped),
    ("routing weights not applied", permutation.probs_not_applied),
)
DESCRIPTIONS = {
    EXACT_NAME: ("MoE permute fusion, the gathers: fused permute and unpermute against Megatron's torch permutation"
                 " and FP64, permuted tokens and probs and their gradients, bit for bit"),
    SUMS_NAME: ("MoE permute fusion, the top-k sums: fused unpermute against Megatron's torch combine and FP64,"
                " combined tokens with and without merging probs and the permuted tokens' gradient"),
}


# Peak bytes per element of the case's largest tensors, all paths together: the FP32 draws, the
# inputs in their dtype, each path's outputs and gradients, and the FP64 reference's copies of
# them (an estimate from what the paths allocate, not measured; correctness.memory).
ELEMENT_BYTES = 48


def permute_memory(shape: MoeShape) -> dict[str, Any]:
    """A case's estimated peak bytes (Case.memory_bytes, memory_driver): every token's top-k copies of
    its expert input, with their gradients."""
    return {"memory_bytes": ELEMENT_BYTES * shape.tokens * shape.top_k * shape.expert_input,
            "memory_driver": f"tokens {shape.tokens} x top-k {shape.top_k} x {shape.expert_input}"}


def _lever(recipe: Recipe, name: str, judged: tuple[str, ...], *, tier: Tier, scale: str, options: LeverOptions,
           candidate) -> Lever:
    model = facts_for(recipe, options.model)
    shape = moe_shape(recipe, model, scale, "permute")
    cases = tuple(
        Case(id=f"{shape.id}-seed{seed}", shape=shape, seed=seed, source="synthetic", variant="routed-top-k",
             make_inputs=partial(permutation.make_permute_inputs, shape, model, seed), **permute_memory(shape))
        for seed in SEEDS
    )
    judged_candidate = permutation.Judged(candidate, judged)
    controls = tuple(Control(name=label, implementation=Mutated(base=judged_candidate, mutation=label, mutate=mutate))
                     for label, mutate in MUTATIONS)
    exact = name == EXACT_NAME
    return Lever(
        name=name, version=VERSION, tier=tier, description=DESCRIPTIONS[name], recipe=recipe.ref_for(model), cases=cases,
        candidate=judged_candidate, default=permutation.Judged(permutation.MegatronPermutation(fused=False), judged),
        reference=permutation.Judged(permutation.Fp64Permutation(), judged), controls=controls,
        rule=EXACT_RULE if exact else Rule(), rule_reason=EXACT_REASON if exact else None,
        summarize=partial(summarize, "in the run" if recipe.argument(FLAG) is not None
                          else "not in the run (the model's provider)"),
    )


def summarize(flag: str, result) -> dict:
    """How the recipe sets the flag, and each control's largest error (its power is infinite
    against a zero bound, so the error itself says how far it is)."""
    errors = {}
    for control in result.controls:
        if control.judgement is not None:
            errors[control.name] = max(tensor.error for tensor in control.judgement.tensors)
    return {"flag": flag, "control_largest_error": errors}


def permute_levers(recipe: Recipe, *, tier: Tier, scale: str, options: LeverOptions, candidate) -> list[Lever]:
    return [_lever(recipe, EXACT_NAME, permutation.EXACT_TENSORS, tier=tier, scale=scale, options=options, candidate=candidate),
            _lever(recipe, SUMS_NAME, permutation.SUM_TENSORS, tier=tier, scale=scale, options=options, candidate=candidate)]


def cpu_tier(recipe_id: str, options: LeverOptions) -> list[Lever]:
    """The torch stand-in of TE's kernels' arithmetic against Megatron's torch permutation, at the
    smoke scale (the recipe's with --scale recipe)."""
    recipe = lever_recipe(recipe_id, options.recipe)
    return permute_levers(recipe, tier=tiers.MEGATRON_CPU, scale=options.at_scale("smoke", "recipe"),
                          options=options, candidate=permutation.IndexPermutation())


def recipe_gpu_tier(recipe_id: str, options: LeverOptions) -> list[Lever]:
    """Megatron's permutation with fused=True (TE's kernels) against fused=False on the recipe's GPU."""
    recipe = lever_recipe(recipe_id, options.recipe)
    tier = tiers.recipe_gpu_tier(recipe.gpu)
    tier = replace(tier, markers=(*tier.markers, "megatron"))
    return permute_levers(recipe, tier=tier, scale=options.gpu_at_scale("smoke", "recipe"), options=options,
                          candidate=permutation.MegatronPermutation(fused=True))

# One factory builds both levers: they share their tests.
TESTS = (
    TierTest(test="test_moe_permute_fusion_on_cpu", tier="megatron-cpu", factory=cpu_tier,
             recipes=(NEMOTRON, QWEN3_MOE),
             doc="The torch stand-in of TE's permutation arithmetic against Megatron's torch permute and unpermute."),
    TierTest(test="test_moe_permute_fusion_with_te", tier=RECIPE_GPU, factory=recipe_gpu_tier,
             recipes=(NEMOTRON, QWEN3_MOE)),
)
READS = (*SHAPE_READS, "layout.ep", "--moe-permute-fusion", "--moe-router-dtype")

EXACT_SPEC = LeverSpec(
    name=EXACT_NAME, version=VERSION,
    description="the gathers of the MoE token permutation, fused against Megatron's torch permutation and FP64, bit"
                " for bit",
    titles=("MoE permute fusion, the gathers",),
    tests=TESTS, reads=READS,
    evidence=Evidence(klass=BOOKKEEPING, tier="megatron-cpu",
                      what="the gathers of a torch stand-in of TE's permutation against Megatron's torch permute:"
                           " bitwise by the lever's rule"))
SUMS_SPEC = LeverSpec(
    name=SUMS_NAME, version=VERSION,
    description="the top-k sums of the MoE unpermute, fused against Megatron's torch combine and FP64",
    titles=("MoE permute fusion, the top-k sums",),
    tests=TESTS, reads=READS,
    evidence=Evidence(klass=BOOKKEEPING, tier="megatron-cpu",
                      what="the stand-in's FP32-accumulated top-k sums are bitwise Megatron's torch combine on the"
                           " CPU; they differ on CUDA (atomic BF16 adds)"))
