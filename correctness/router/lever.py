"""The moe-router-dtype lever (`--moe-router-dtype fp32|fp64`): Megatron's own MoE router
(TopKRouter, correctness/router/megatron_router.py) with its logits in BF16 against the same router
with its logits in the recipe's router dtype, and FP64 routing from the formula
(references/router.py), at the recipe's router shape (hidden size, experts, top-k, score function,
expert bias, scaling factor and expert groups: correctness/router/settings.py).

Candidate and default follow the recipe, as the attention-softmax-precision lever does: the default
is what the recipe runs where it sets `--moe-router-dtype` (fp32 or fp64; Nemotron-3-Super's
recipe runs fp32, which Megatron-Bridge's Nemotron-H provider sets), and the candidate is the other
setting, the flag left out: logits in the input's BF16. Where a recipe leaves the flag out, the
candidate is what it runs (BF16) and the default is fp32. A factory may take another candidate
dtype (fp64 against a recipe's fp32, say).

Judged per case, all dense: `logits` [tokens, experts] (the router dtype); `combination_weights`
[tokens, experts], Megatron's routing_probs, zero where an expert is not chosen: a token whose
choice differs from FP64's is compared with FP64's own routing, so an expert swapped for another is
an error at both columns and nothing is dropped; `grad_router_weight` and `grad_hidden`, the
gradients of sum(weights x upstream) (Megatron's backward: autograd through its routing and the
gating linear's own backward, each in the parameter's and the input's dtype, BF16). Each case's
summary records the fraction of tokens whose expert set differs from FP64's, for the candidate and
the default, and how near to a tie those tokens were in FP64.

Format floor (correctness/router/floor.py), where the candidate's logits are BF16: FP64 routing from
the logits rounded to BF16 once, everything after them exact, its outputs rounded to BF16. The
case is `format-limited` where the candidate fails the rule only as a BF16 router must: its logits
and its score tensor in BF16 (docs/levers/moe-router-dtype.md).

Negative controls, built from the candidate (Megatron's router with one thing wrong), each judged
against the rule and against the format bound (2 x the floor's error + 1e-3), which every one
fails on every case measured: the expert bias ignored in the choice (where the recipe enables it),
top-k one less (an expert dropped per token; up to top-8, see TOP_K_ONE_LESS_MAX), the scaling factor left out (where there is one), the
weights not normalised over the chosen experts, and the score function swapped (softmax for a
sigmoid router, as Megatron's sequence aux loss once did, or sigmoid for a softmax one).

Tiers: "megatron-cpu" (smoke scale: SMOKE_TOKENS tokens at the recipe's hidden size and experts;
the CPU shims of megatron_router.py) and "megatron" (a CUDA GPU with TE: TopKRouter as the recipe
runs it, recipe scale: a microbatch's tokens; its gating GEMM is torch.mm, as megatron-core 0.16.1
runs it beside TE 2.17: megatron_router.py). A model
without experts (Gemma-4) is NotApplicable.
"""

from dataclasses import replace
from functools import partial
from typing import Any

import torch

from correctness import tiers
from correctness.evidence import UPSTREAM, Evidence
from correctness.lever import Case, Control, FormatFloor, Lever, LeverOptions, Tier
from correctness.lever_spec import SHAPE_READS, LeverSpec, TierTest
from correctness.recipe_sets import GPT_OSS, MOONLIGHT, NEMOTRON, QWEN3_MOE
from correctness.models import ModelFacts, facts_for
from correctness.recipes import Recipe, lever_recipe
from correctness.router.floor import Fp64Routing, logits_floor
from correctness.router.inputs import RouterShape, make_inputs
from correctness.router.megatron_router import ROUTER_DTYPE_NAMES, MegatronRouter
from correctness.router.settings import RouterSettings, router_settings

NAME = "moe-router-dtype"
VERSION = 2  # 2: the BF16 format floor (logits and scores); the controls judged against it
SMOKE_TOKENS = 1024
SEEDS = (0,)
# One expert fewer per token moves a token's weights by about 1/k of them. Above this k that is
# within what a BF16 router's own rounding moves them (Nemotron, top-22 of 512: the control sits at
# 0.85 of the format bound, where BF16 routing changes 22% of the tokens' expert sets), so the format
# bound cannot tell the control from an honest router there; the case's other controls judge it.
TOP_K_ONE_LESS_MAX = 8
DESCRIPTION = "Megatron's MoE router with its logits in {candidate} against {default} and FP64 routing"


def router_shape(recipe: Recipe, model: ModelFacts, settings: RouterSettings, scale: str) -> RouterShape:
    rows = recipe.rows_per_microbatch
    seq = recipe.row_tokens if scale == "recipe" else max(1, SMOKE_TOKENS // rows)
    return RouterShape(
        model=model.short_name, scale=scale, seq_len=seq, batch=rows, hidden=int(model.field("hidden_size")),
        experts=settings.experts, top_k=settings.top_k, score_function=settings.score_function,
        scaling_factor=settings.scaling_factor, expert_bias=settings.expert_bias, router_bias=settings.router_bias,
        pre_softmax=settings.pre_softmax, num_groups=settings.num_groups, group_topk=settings.group_topk,
        dtype=recipe.precision, recipe_router_dtype=settings.router_dtype, settings_sources=settings.sources,
    )


def top_k_one_less_inapplicable(shape: RouterShape) -> str | None:
    if shape.top_k < 2:
        return "the recipe's router has no second expert per token"
    if shape.top_k > TOP_K_ONE_LESS_MAX:
        return (f"at top-{shape.top_k} one expert fewer moves a token's weights by about 1/{shape.top_k}, within what"
                " BF16 routing itself moves them: the format bound cannot tell it from an honest router")
    return None


def controls(candidate: MegatronRouter) -> tuple[Control, ...]:
    def needs(what: str, present):
        return lambda case: None if present(case.shape) else f"the recipe's router has no {what}"

    return (
        Control(name="expert bias ignored in the choice",
                implementation=replace(candidate, mutation="expert bias ignored"),
                why_inapplicable=needs("expert bias", lambda s: s.expert_bias)),
        Control(name="top-k one less", implementation=replace(candidate, mutation="top-k - 1"),
                why_inapplicable=lambda case: top_k_one_less_inapplicable(case.shape)),
        Control(name="scaling factor left out", implementation=replace(candidate, mutation="scaling factor left out"),
                why_inapplicable=needs("scaling factor", lambda s: s.scaling_factor not in (None, 1.0))),
        Control(name="weights not normalised over the chosen experts",
                implementation=replace(candidate, mutation="weights not normalised"),
                why_inapplicable=needs("normalisation (top-1 sigmoid)",
                                       lambda s: s.top_k > 1 or s.score_function == "softmax")),
        Control(name="score function swapped", implementation=replace(candidate, mutation="score function swapped")),
    )


def summarize(result: Any) -> dict[str, Any]:
    """The fraction of tokens whose expert set differs from FP64's, candidate and default."""
    figures = {}
    for role, run in (("candidate", result.candidate.run if result.candidate else None), ("default", result.default)):
        if run is not None and "routing" in run.details:
            figures[role] = run.details["routing"]
    return {"expert_set_vs_fp64": figures} if figures else {}


def format_floor(candidate: MegatronRouter, shape: RouterShape) -> FormatFloor | None:
    """The floor of logits in the input's dtype (BF16), where the candidate's router runs with them."""
    if candidate.router_dtype is not None:
        return None
    return logits_floor(shape.torch_dtype, candidate.judged_dtype)


def choose(settings: RouterSettings, candidate_dtype: str | None = None) -> tuple[MegatronRouter, MegatronRouter]:
    """(candidate, default): the default the recipe's router dtype where it sets one (else fp32),
    the candidate BF16 logits (the flag left out) unless another is given."""
    default = settings.router_dtype or "fp32"
    if candidate_dtype == default:
        raise ValueError(f"moe-router-dtype: the candidate dtype {candidate_dtype} is the default's")
    judged = torch.float64 if "fp64" in (candidate_dtype, default) else torch.float32
    return MegatronRouter(candidate_dtype, judged_dtype=judged), MegatronRouter(default, judged_dtype=judged)


# Peak bytes per element of the case's largest tensors, all paths together: the FP32 draws, the
# inputs in their dtype, each path's outputs and gradients, and the FP64 reference's copies of
# them (an estimate from what the paths allocate, not measured; correctness.memory).
ELEMENT_BYTES = 48


def router_memory(shape: RouterShape) -> dict[str, Any]:
    """A case's estimated peak bytes (Case.memory_bytes, memory_driver): the hidden states, the router's
    weight and the tokens' logits over the experts, with their gradients."""
    tokens = shape.seq_len * shape.batch
    elements = tokens * (shape.hidden + shape.experts) + shape.hidden * shape.experts
    return {"memory_bytes": ELEMENT_BYTES * elements,
            "memory_driver": f"tokens {tokens} x hidden {shape.hidden} and {shape.experts} experts"}


def router_lever(recipe: Recipe, *, tier: Tier, scale: str, options: LeverOptions,
                 candidate_dtype: str | None = None) -> Lever:
    model = facts_for(recipe, options.model)
    settings = router_settings(recipe, model)
    candidate, default = choose(settings, candidate_dtype)
    shape = router_shape(recipe, model, settings, scale)
    runs = {candidate.router_dtype: "candidate", default.router_dtype: "default"}.get(settings.router_dtype, "neither")
    cases = tuple(
        Case(id=f"{shape.id}-seed{seed}", shape=shape, seed=seed, source="synthetic", variant="model-like",
             make_inputs=partial(make_inputs, shape, seed), recipe_runs=runs, **router_memory(shape))
        for seed in SEEDS
    )
    names = {None: "BF16", "fp32": "FP32", "fp64": "FP64"}
    return Lever(
        name=NAME, version=VERSION, tier=tier, recipe=recipe.ref_for(model), cases=cases,
        description=DESCRIPTION.format(candidate=names[candidate.router_dtype], default=names[default.router_dtype]),
        candidate=candidate, default=default, reference=Fp64Routing(), controls=controls(candidate),
        summarize=summarize, format_floor=format_floor(candidate, shape),
    )


def cpu_tier(recipe_id: str, options: LeverOptions, candidate_dtype: str | None = None) -> list[Lever]:
    """Megatron's TopKRouter on the CPU, at the smoke scale (the recipe's with --scale recipe)."""
    recipe = lever_recipe(recipe_id, options.recipe)
    return [router_lever(recipe, tier=tiers.MEGATRON_CPU, scale=options.at_scale("smoke", "recipe"), options=options,
                         candidate_dtype=candidate_dtype)]


def megatron_gpu_tier(recipe_id: str, options: LeverOptions, candidate_dtype: str | None = None) -> list[Lever]:
    """Megatron's TopKRouter on a CUDA GPU with TE, at a microbatch's tokens."""
    recipe = lever_recipe(recipe_id, options.recipe)
    return [router_lever(recipe, tier=tiers.MEGATRON_GPU, scale=options.gpu_at_scale("smoke", "recipe"), options=options,
                         candidate_dtype=candidate_dtype)]


def recipe_runs_bf16_logits(shape: RouterShape) -> bool:
    return shape.recipe_router_dtype is None


__all__ = ["NAME", "VERSION", "ROUTER_DTYPE_NAMES", "cpu_tier", "megatron_gpu_tier", "router_lever"]

SPEC = LeverSpec(
    name=NAME, version=VERSION,
    description="Megatron's MoE router (TopKRouter) with its logits in BF16 against the recipe's router dtype (FP32"
                " or FP64) and FP64 routing, dense combination weights and gradients at the recipe's router shape",
    titles=("MoE router with its logits in",),
    tests=(
        TierTest(test="test_moe_router_bf16_logits_against_fp32_cpu", tier="megatron-cpu", factory=cpu_tier,
                 recipes=(NEMOTRON, QWEN3_MOE, GPT_OSS, MOONLIGHT),
                 doc="Megatron's own TopKRouter on the CPU (shims: correctness/router/megatron_router.py)."),
        TierTest(test="test_moe_router_bf16_logits_against_fp32_gpu", tier="megatron", factory=megatron_gpu_tier,
                 recipes=(NEMOTRON,)),
    ),
    reads=(*SHAPE_READS, "--megatron-to-hf-mode", "--num-experts", "--moe-router-dtype",
           "--moe-router-enable-expert-bias", "--moe-router-group-topk", "--moe-router-num-groups",
           "--moe-router-pre-softmax", "--moe-router-score-function", "--moe-router-topk",
           "--moe-router-topk-scaling-factor"),
    evidence=Evidence(klass=UPSTREAM, tier="megatron-cpu",
                      what="Megatron's TopKRouter with its logits in BF16 against FP32"))
