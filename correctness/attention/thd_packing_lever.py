"""The THD-packing lever: attention over rows packed into one THD sequence (cumulative sequence
lengths, no attention across a row boundary) against the same rows attended one at a time in BSHD,
and an FP64 reference; forward and backward.

The Nemotron-3-Super recipe packs two 8,192-token rows per microbatch where its reference ran one
row at a time. Tiers: "cpu" (smoke scale: torch SDPA's flash CPU kernel and the eager unfused path,
each packed against itself row by row), "gpu" (recipe scale, fused SDPA backends) and the recipe's
GPU with Transformer Engine (qkv_format thd, auto and forced fused). Negative controls: packing
without the boundary (the second row sees the first) and the boundary one token late.
"""

from dataclasses import dataclass, replace

import torch

from correctness.attention.backend_lever import attention_memory
from correctness.attention.eager import EagerUnfused
from correctness.attention.inputs import AttentionInputs, synthetic_inputs
from correctness.attention.judging import SINGLE_KEY_ROWS, SLICING
from correctness.attention.reference import Fp64Reference
from correctness.attention.sdpa import Sdpa
from correctness.attention.te import TransformerEngine
from correctness import tiers
from correctness.evidence import UPSTREAM, Evidence
from correctness.lever import (Case, Control, Implementation, ImplementationOutput, Lever, LeverOptions, Mutated,
                               NotApplicable, Tier)
from correctness.lever_spec import RECIPE_GPU, SHAPE_READS, LeverSpec, TierTest
from correctness.recipe_sets import NEMOTRON
from correctness.models import facts_for
from correctness.recipes import Recipe, lever_recipe
from correctness.attention.shapes import AttentionShape, attention_shape
from correctness.shapes import qkv_format, RECIPE_SCALE, Scale

NAME = "thd-packing"
VERSION = 1
SEEDS = (0, 1)
# The recipe's rows per microbatch (two), each 384 tokens: packing needs rows, not long ones. The
# boundary falls inside one of the 512-key blocks of torch's CPU flash kernel, not on its edge,
# where a mask handled block by block would be easiest to get right.
PACKING_SMOKE_SCALE = Scale(name="smoke", kv_groups=2, seq_len=384)
GPU_SDPA_BACKENDS = ("efficient", "cudnn")  # flash takes no mask, and packed rows need one


@dataclass(frozen=True)
class PerRow:
    """A path run on each packed row on its own, in BSHD, its outputs packed back (dsink, a sum over
    every query, summed over the rows): no packing."""

    base: Implementation

    @property
    def name(self) -> str:
        return f"{self.base.name}-per-row"

    def run(self, inputs: AttentionInputs) -> ImplementationOutput:
        shape = inputs.shape
        bounds = shape.cu_seqlens
        pieces: dict[str, list[torch.Tensor]] = {}
        backends: dict[str, None] = {}
        for start, end in zip(bounds, bounds[1:]):
            row = AttentionInputs(
                shape=shape.with_changes(qkv_format="bshd", batch=1, seq_len=end - start, boundaries=None),
                q=inputs.q[start:end].unsqueeze(0),
                k=inputs.k[start:end].unsqueeze(0),
                v=inputs.v[start:end].unsqueeze(0),
                grad_out=inputs.grad_out[start:end].unsqueeze(0),
                sinks=inputs.sinks,
            )
            output = self.base.run(row)
            backends[output.backend] = None
            for name, tensor in output.tensors.items():
                pieces.setdefault(name, []).append(tensor if name == "dsink" else tensor.squeeze(0))
        return ImplementationOutput(
            tensors={name: torch.stack(parts).sum(dim=0) if name == "dsink" else torch.cat(parts)
                     for name, parts in pieces.items()},
            backend=" | ".join(backends) + f", {len(bounds) - 1} rows one at a time",
            details={"rows": len(bounds) - 1},
        )


def packing_case(shape: AttentionShape, seed: int) -> Case:
    memory_bytes, memory_driver = attention_memory(shape)
    return Case(
        id=f"{shape.id}-seed{seed}", shape=shape, seed=seed, source="synthetic", variant="model-like",
        make_inputs=lambda device: synthetic_inputs(shape, seed, device, "model-like"),
        memory_bytes=memory_bytes, memory_driver=memory_driver,
    )


def without_boundary(shape: AttentionShape) -> tuple[int, ...]:
    return (0, shape.tokens)


def boundary_one_late(shape: AttentionShape) -> tuple[int, ...]:
    bounds = list(shape.cu_seqlens)
    bounds[1] += 1
    return tuple(bounds)


def needs_two_rows(case: Case) -> str | None:
    rows = len(case.shape.cu_seqlens or (0, 0)) - 1
    return None if rows >= 2 else f"{rows} packed row: no boundary to get wrong"


def packing_controls(candidate: Implementation) -> tuple[Control, ...]:
    return (
        Control(
            name="no row boundary",
            implementation=Mutated(base=candidate, mutation="rows packed without a boundary",
                         mutate=lambda inputs: inputs.with_shape(boundaries=without_boundary(inputs.shape))),
            why_inapplicable=needs_two_rows,
        ),
        Control(
            name="boundary one token late",
            implementation=Mutated(base=candidate, mutation="first boundary one token late",
                         mutate=lambda inputs: inputs.with_shape(boundaries=boundary_one_late(inputs.shape))),
            why_inapplicable=needs_two_rows,
        ),
    )


def packing_cases(recipe: Recipe, scale: Scale, options: LeverOptions) -> tuple[Case, ...]:
    """Two seeded cases per packed (THD) layer kind; NotApplicable where the recipe does not pack rows."""
    model = facts_for(recipe, options.model)
    if qkv_format(recipe) != "thd":
        raise NotApplicable(f"recipe {recipe.id} does not pack rows (its attention runs BSHD, not THD)")
    cases = []
    for kind in model.attention_kinds:
        shape = attention_shape(recipe, model, kind, scale)
        if shape.qkv_format != "thd":
            continue
        cases += [packing_case(shape, seed) for seed in SEEDS]
    return tuple(cases)


def packing_lever(
    *, recipe: Recipe, tier: Tier, scale: Scale, packed: Implementation, description: str, options: LeverOptions
) -> Lever:
    model = facts_for(recipe, options.model)
    return Lever(
        name=NAME, version=VERSION, tier=tier, description=description, recipe=recipe.ref_for(model),
        cases=packing_cases(recipe, scale, options), candidate=packed, default=PerRow(packed), reference=Fp64Reference(),
        controls=packing_controls(packed), slicing=SLICING, invariants=(SINGLE_KEY_ROWS,),
    )


def cpu_tier(recipe_id: str, options: LeverOptions) -> list[Lever]:
    recipe = lever_recipe(recipe_id, options.recipe)
    return [
        packing_lever(
            recipe=recipe, tier=tiers.CPU, scale=options.at_scale(PACKING_SMOKE_SCALE, RECIPE_SCALE), packed=path,
            description=f"{label} over two packed rows (THD) against the same rows one at a time (BSHD)"
            " and an FP64 reference", options=options,
        )
        for path, label in ((Sdpa("flash"), "torch SDPA's flash CPU kernel"), (EagerUnfused(), "eager unfused attention"))
    ]


def gpu_sdpa_tier(recipe_id: str, options: LeverOptions) -> list[Lever]:
    """The packed call on each fused SDPA backend torch's dispatch rules let run at these shapes
    (correctness.attention.combinations)."""
    from correctness.attention.combinations import gpu_sdpa_levers  # it imports PerRow from here

    recipe = lever_recipe(recipe_id, options.recipe)
    scale = options.gpu_at_scale(PACKING_SMOKE_SCALE, RECIPE_SCALE)

    def build(path: Implementation, judged: tuple[Case, ...]) -> Lever:
        lever = packing_lever(
            recipe=recipe, tier=tiers.GPU, scale=scale, packed=path,
            description=f"torch SDPA's {path.backend} backend over packed rows (THD) against the same rows one at a"
            " time (BSHD) and an FP64 reference", options=options,
        )
        return replace(lever, cases=judged)

    return gpu_sdpa_levers(GPU_SDPA_BACKENDS, packing_cases(recipe, scale, options), build)


def recipe_gpu_tier(recipe_id: str, options: LeverOptions) -> list[Lever]:
    recipe = lever_recipe(recipe_id, options.recipe)
    return [
        packing_lever(
            recipe=recipe, tier=tiers.recipe_gpu_tier(recipe.gpu), scale=options.gpu_at_scale(PACKING_SMOKE_SCALE, RECIPE_SCALE),
            packed=TransformerEngine(backend),
            description=f"TE's {backend} attention over two packed rows (THD) against the same rows one at a time"
            " (BSHD) and an FP64 reference", options=options,
        )
        for backend in ("auto", "fused")
    ]

SPEC = LeverSpec(
    name=NAME, version=VERSION,
    description="attention over rows packed into one THD microbatch (cumulative sequence lengths) against the same"
                " rows one at a time and FP64",
    titles=(r"packed rows \(THD\)",),
    tests=(
        TierTest(test="test_thd_packing_cpu", tier="cpu", factory=cpu_tier, recipes=(NEMOTRON,)),
        TierTest(test="test_thd_packing_with_sdpa_fused_backends", tier="gpu", factory=gpu_sdpa_tier,
                 recipes=(NEMOTRON,)),
        TierTest(test="test_thd_packing_with_te", tier=RECIPE_GPU, factory=recipe_gpu_tier, recipes=(NEMOTRON,)),
    ),
    reads=(*SHAPE_READS, "--qkv-format"),
    evidence=Evidence(klass=UPSTREAM, tier="cpu",
                      what="torch SDPA's flash CPU kernel over packed rows against the same kernel row by row (the"
                           " eager path, also run, is bitwise its rows)"))
