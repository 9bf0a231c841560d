"""The grouped-GEMM lever (`--moe-grouped-gemm`): the experts' GEMMs grouped (one GEMM for all of
an EP rank's experts, fc1 and fc2 each) against one GEMM per expert (megatron-core's
SequentialMLP, the default without the flag) and the FP64 experts (references/moe_experts.py),
forward and backward: the output rows, the rows' gradient, the routing weights' gradient and each
expert's fc1 and fc2 weight gradient, judged per expert (an expert with no token included: its
weight gradients must be zero).

Tiers: `megatron-cpu`, torch's CPU grouped matmul (`torch.nn.functional.grouped_mm`, torch 2.13)
against megatron-core's SequentialMLP on the CPU, smoke scale; the recipe's GPU with `megatron`
(TE's GroupedLinear, what TEGroupedMLP runs, against SequentialMLP on CUDA), recipe scale.
Inputs: tokens routed by a seeded router over all the model's experts with its top-k (uneven loads,
one local expert with none), EP rank 0's experts; the weights std 1/sqrt(fan-in).
Controls: a token counted in its neighbour expert, two experts' weights swapped, a token dropped,
the routing weights not applied.
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
from correctness.moe import experts
from correctness.moe.shapes import MoeShape, moe_shape
from correctness.recipes import Recipe, lever_recipe

NAME = "moe-grouped-gemm"
VERSION = 1
SEEDS = (0,)
FLAG = "--moe-grouped-gemm"
DESCRIPTION = ("MoE grouped GEMM: the experts' GEMMs grouped against one GEMM per expert (Megatron's SequentialMLP)"
               " and FP64, output and input, routing-weight and per-expert weight gradients")


def flag_in_run(recipe: Recipe) -> str:
    """How the recipe sets the flag: in its run, or not shown (model arguments from an array
    expansion or a Bridge provider, which sets moe_grouped_gemm for the suite's MoE families)."""
    return "in the run" if recipe.argument(FLAG) is not None else "not in the run (the model's provider)"


# Peak bytes per element of the case's largest tensors, all paths together: the FP32 draws, the
# inputs in their dtype, each path's outputs and gradients, and the FP64 reference's copies of
# them. Measured on Moonlight's smoke case (4 local experts, 2,048 x 1,408, 171 tokens): 1.06 GB
# against an estimate of 1.71 GB.
ELEMENT_BYTES = 48


def experts_memory(shape: MoeShape) -> dict[str, Any]:
    """A case's estimated peak bytes (Case.memory_bytes, memory_driver): the routed tokens' inputs and
    FFN activations, and the local experts' weights, with their gradients."""
    projections = 3 if shape.gated else 2
    elements = (shape.tokens * (shape.expert_input + projections * shape.ffn)
                + shape.local_experts * projections * shape.expert_input * shape.ffn)
    return {"memory_bytes": ELEMENT_BYTES * elements,
            "memory_driver": f"{shape.local_experts} experts x {shape.expert_input} x ffn {shape.ffn}, tokens {shape.tokens}"}


def grouped_gemm_lever(recipe: Recipe, *, tier: Tier, scale: str, options: LeverOptions, candidate) -> Lever:
    model = facts_for(recipe, options.model)
    shape = moe_shape(recipe, model, scale, "experts")
    cases = tuple(
        Case(id=f"{shape.id}-seed{seed}", shape=shape, seed=seed, source="synthetic", variant="routed-uneven",
             make_inputs=partial(experts.make_experts_inputs, shape, model, seed), **experts_memory(shape))
        for seed in SEEDS
    )
    controls = (
        Control(name="a token counted in its neighbour expert",
                implementation=Mutated(base=candidate, mutation="a token in the neighbour expert",
                                       mutate=experts.token_to_neighbour)),
        Control(name="two experts' weights swapped",
                implementation=Mutated(base=candidate, mutation="two experts' weights swapped",
                                       mutate=experts.weights_swapped)),
        Control(name="a token dropped",
                implementation=Mutated(base=candidate, mutation="a token dropped", mutate=experts.token_dropped)),
        Control(name="routing weights not applied",
                implementation=Mutated(base=candidate, mutation="routing weights 1", mutate=experts.probs_not_applied)),
    )
    return Lever(
        name=NAME, version=VERSION, tier=tier, description=DESCRIPTION, recipe=recipe.ref_for(model), cases=cases,
        candidate=candidate, default=experts.MegatronSequentialMLP(), reference=experts.Fp64Experts(),
        controls=controls, summarize=partial(summarize, flag_in_run(recipe)),
    )


def summarize(flag: str, result) -> dict:
    """The rows each local expert received (the candidate's record of them) and how the recipe sets the flag."""
    counts = result.candidate.run.details.get("counts") if result.candidate else None
    return {"rows_per_expert": counts, "flag": flag}


def cpu_tier(recipe_id: str, options: LeverOptions) -> list[Lever]:
    """torch's CPU grouped matmul against megatron-core's SequentialMLP, at the smoke scale (the
    recipe's with --scale recipe)."""
    recipe = lever_recipe(recipe_id, options.recipe)
    return [grouped_gemm_lever(recipe, tier=tiers.MEGATRON_CPU, scale=options.at_scale("smoke", "recipe"), options=options,
                               candidate=experts.TorchGroupedMM())]


def recipe_gpu_tier(recipe_id: str, options: LeverOptions) -> list[Lever]:
    """TE's GroupedLinear (TEGroupedMLP's) against SequentialMLP on the recipe's GPU, recipe scale."""
    recipe = lever_recipe(recipe_id, options.recipe)
    tier = tiers.recipe_gpu_tier(recipe.gpu)
    tier = replace(tier, markers=(*tier.markers, "megatron"))
    return [grouped_gemm_lever(recipe, tier=tier, scale=options.gpu_at_scale("smoke", "recipe"), options=options,
                               candidate=experts.TeGroupedLinear())]

SPEC = LeverSpec(
    name=NAME, version=VERSION,
    description="the experts' GEMMs grouped (torch's grouped matmul on the CPU, TE's GroupedLinear on the GPU) against"
                " one GEMM per expert (Megatron's SequentialMLP) and FP64, output and input, routing-weight and"
                " per-expert weight gradients",
    titles=("MoE grouped GEMM",),
    tests=(
        TierTest(test="test_moe_grouped_gemm_on_cpu", tier="megatron-cpu", factory=cpu_tier,
                 recipes=(NEMOTRON, QWEN3_MOE), doc="torch's CPU grouped matmul against Megatron's SequentialMLP."),
        TierTest(test="test_moe_grouped_gemm_with_te", tier=RECIPE_GPU, factory=recipe_gpu_tier,
                 recipes=(NEMOTRON, QWEN3_MOE)),
    ),
    reads=(*SHAPE_READS, "layout.ep", "--moe-grouped-gemm", "--moe-router-dtype"),
    evidence=Evidence(klass=BOOKKEEPING, tier="megatron-cpu",
                      what="torch's CPU grouped_mm is bitwise Megatron's SequentialMLP: offsets, an empty expert and"
                           " per-expert gradients, not TE's grouped GEMM's rounding"))
