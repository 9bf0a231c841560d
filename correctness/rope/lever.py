"""The rope-fusion lever (`--no-rope-fusion`): q and k rotated by Megatron's unfused
`apply_rotary_pos_emb` (the candidate: what the flag selects) against TE's fused RoPE kernel (the
default: Megatron-LM's `apply_rope_fusion` is on unless the flag is given) and an FP64 RoPE
(references/rope.py), forward and backward, per attention kind with a rotary embedding, at the
recipe's rank-local heads, head dims, rotary fraction and base, in the recipe's precision, in the
recipe's token layout (BSHD rows, or THD: its rows packed with cumulative lengths).

What the flag changes (megatron-core 0.16.1 rope_utils.py, TE 2.17): unfused, Megatron casts
cos(freqs) and sin(freqs) to the inputs' dtype and computes `t * cos + rotate_half(t) * sin` as
BF16 tensor operations (each product and the sum rounded to BF16; autograd's backward likewise);
fused, TE's kernel computes each element in FP32 from the FP32 frequencies and rounds once
(transformer_engine/common/fused_rope/fused_rope.cu). Both copy the dims past the rotary fraction.

Tiers:
- "megatron-cpu" (`cpu_tier`, smoke scale): the candidate is Megatron's own unfused function on
  the CPU. TE's kernel is CUDA only, so the default is `FusedRopeArithmetic`
  (correctness/rope/paths.py), a small named stand-in for the kernel's arithmetic (FP32 rotation,
  one rounding), written from fused_rope.cu. Why a stand-in rather than Megatron's unfused function
  as the default: the seed recipe with RoPE (Gemma-4) does not give `--no-rope-fusion`, so its
  path is the fused one; the unfused function against itself would be "no kernel change" and
  measure nothing the flag changes. What the CPU tier proves: Megatron's unfused RoPE, as
  installed, is within the rule of the fused kernel's arithmetic at the recipe's head geometry,
  rotary fraction, base and layout; not TE's CUDA code (the GPU tier's). tests/test_rope_lever.py
  holds the stand-in against TE 2.17's own unfused RoPE Python on the CPU (`TeUnfusedRope` in FP32:
  bitwise, forward and backward, in both layouts and pairings and at a rotary fraction below 1),
  and against TE's kernel on a GPU.
- the recipe's GPU with TE and megatron-core (`recipe_gpu_tier`, recipe scale): Megatron's unfused
  function on CUDA against Megatron's fused path, TE's FusedRoPEFunc.

Judged: the rotary dims of q and k after the rotation and of their gradients (q, k, dq, dk),
whole and per head and block of 128 positions, and the passed dims apart (q_pass, ...). Exact
invariants: the passed dims are the inputs (gradients: the upstream gradients) unchanged, and a
token at position 0 (a THD row's first, or a BSHD row from 0) is unrotated.

Negative controls, the candidate with: the positions off by one (frequencies one position later);
the rotary fraction ignored (the whole head rotated; kinds with a fraction below 1); the other
pairing (adjacent dims where the model pairs halves, or the reverse); the angles rounded to BF16
before cos and sin; and, in THD with two rows or more, the packed rows' positions run on across the
boundary (one row of all tokens).
"""

from dataclasses import replace
from typing import Any
from functools import partial

import torch

from correctness import tiers
from correctness.compare import Slicing
from correctness.evidence import UPSTREAM, Evidence, HeldEqual
from correctness.lever import Case, Control, Implementation, Invariant, Lever, LeverOptions, Mutated, Tier
from correctness.lever_spec import RECIPE_GPU, SHAPE_READS, LeverSpec, TierTest
from correctness.models import facts_for
from correctness.recipe_sets import GEMMA, NEMOTRON, QWEN3_MOE
from correctness.recipes import Recipe, lever_recipe
from correctness.rope.paths import (
    FormulaRope, Fp64Rope, FusedRopeArithmetic, MegatronRope, RopeInputs, make_inputs, megatron_freqs, outputs,
)
from correctness.rope.shapes import RopeShape, rope_kinds, rope_shape

NAME = "rope-fusion"
VERSION = 1
ARGUMENTS = ("--no-rope-fusion",)
SEEDS = (0,)
SLICING = Slicing(block=128)
UNFUSED = MegatronRope(fused=False)
TE_FUSED = MegatronRope(fused=True)


def describe(default: Implementation) -> str:
    fused = "TE's fused RoPE kernel" if default == TE_FUSED else "TE 2.17's fused RoPE arithmetic (CPU stand-in)"
    return f"rope fusion: Megatron's unfused RoPE against {fused} and FP64, q and k rotated, forward and backward"


def _shifted(inputs: RopeInputs) -> RopeInputs:
    return inputs.with_freqs(megatron_freqs(inputs.shape, inputs.q.device, position_shift=1))


def _whole_head(inputs: RopeInputs) -> RopeInputs:
    return inputs.with_freqs(megatron_freqs(inputs.shape, inputs.q.device, whole_head=True))


def other_pairing(inputs: RopeInputs) -> RopeInputs:
    flipped = inputs.shape.with_changes(interleaved=not inputs.shape.interleaved)
    return inputs.with_freqs(megatron_freqs(flipped, inputs.q.device), interleaved=flipped.interleaved)


def _bf16_angles(inputs: RopeInputs) -> RopeInputs:
    return inputs.with_freqs(inputs.freqs.to(torch.bfloat16).float())


def rows_as_one(inputs: RopeInputs) -> RopeInputs:
    tokens = inputs.shape.cu_seqlens[-1]
    merged = inputs.shape.with_changes(boundaries=(0, tokens))
    freqs = megatron_freqs(merged, inputs.q.device)
    return replace(inputs, shape=merged, freqs=freqs,
                   cu_seqlens=torch.tensor((0, tokens), dtype=torch.int32, device=inputs.q.device))


def _needs_fraction(case: Case) -> str | None:
    shape = case.shape
    return None if shape.rotary_dims < shape.head_dim else "the whole head rotates already (rotary fraction 1)"


def _needs_rows(case: Case) -> str | None:
    bounds = case.shape.cu_seqlens
    if bounds is None:
        return "BSHD: no packed rows"
    return None if len(bounds) > 2 else "one packed row: no boundary to run across"


def controls(candidate: Implementation) -> tuple[Control, ...]:
    def mutated(what, mutate):
        return Mutated(base=candidate, mutation=what, mutate=mutate)

    return (
        Control(name="positions off by one", implementation=mutated("frequencies one position later", _shifted)),
        Control(name="rotary fraction ignored", implementation=mutated("whole head rotated", _whole_head),
                why_inapplicable=_needs_fraction),
        Control(name="other pairing",
                implementation=mutated("adjacent dims paired where the model pairs halves, or the reverse",
                                                   other_pairing)),
        Control(name="angles in BF16",
                implementation=mutated("frequencies rounded to BF16 before cos and sin", _bf16_angles)),
        Control(name="positions run across packed rows",
                implementation=mutated("packed rows rotated as one row", rows_as_one),
                why_inapplicable=_needs_rows),
    )


def _unchanged(inputs: RopeInputs) -> dict[str, torch.Tensor]:
    """The inputs and upstream gradients laid out and split as the judged tensors are."""
    return outputs(inputs.shape, inputs.q, inputs.k, inputs.grad_q, inputs.grad_k)


def passed_dims_unchanged(inputs: RopeInputs, tensors) -> str | None:
    if inputs.shape.rotary_dims == inputs.shape.head_dim:
        return None
    expected = _unchanged(inputs)
    wrong = [name for name in ("q_pass", "k_pass", "dq_pass", "dk_pass")
             if not torch.equal(tensors[name], expected[name])]
    return f"dims past the rotary fraction changed in {', '.join(wrong)}" if wrong else None


def position_zero_unrotated(inputs: RopeInputs, tensors) -> str | None:
    shape = inputs.shape
    if shape.first_position != 0:
        return None
    expected = _unchanged(inputs)
    wrong = []
    for name in ("q", "k", "dq", "dk"):
        if shape.qkv_format == "thd":
            starts = list(shape.cu_seqlens[:-1])
            got, want = tensors[name][starts], expected[name][starts]
        else:
            got, want = tensors[name][:, 0], expected[name][:, 0]
        if not torch.equal(got, want.to(got.dtype)):
            wrong.append(name)
    return f"tokens at position 0 rotated in {', '.join(wrong)}" if wrong else None


INVARIANTS = (
    Invariant(name="passed dims unchanged", check=passed_dims_unchanged),
    Invariant(name="position 0 unrotated", check=position_zero_unrotated),
)


# Peak bytes per element of the case's largest tensors, all paths together: the FP32 draws, the
# inputs in their dtype, each path's outputs and gradients, and the FP64 reference's copies of
# them (an estimate from what the paths allocate, not measured; correctness.memory).
ELEMENT_BYTES = 48


def rope_memory(shape: RopeShape) -> dict[str, Any]:
    """A case's estimated peak bytes (Case.memory_bytes, memory_driver): the query and key heads of
    every position, with their gradients."""
    elements = shape.rows * shape.positions * (shape.heads + shape.groups) * shape.head_dim
    return {"memory_bytes": ELEMENT_BYTES * elements,
            "memory_driver": f"{shape.rows} rows x positions {shape.positions} x {shape.heads + shape.groups} heads"
                             f" x head_dim {shape.head_dim}"}


def rope_cases(recipe: Recipe, options: LeverOptions, scale: str) -> tuple[Case, ...]:
    model = facts_for(recipe, options.model)
    cases = []
    for kind in rope_kinds(recipe, model):
        shape = rope_shape(recipe, model, kind, scale)
        cases += [Case(id=f"{shape.id}-seed{seed}", shape=shape, seed=seed, source="synthetic",
                       variant="standard-normal",
                       make_inputs=partial(make_inputs, shape, seed), **rope_memory(shape)) for seed in SEEDS]
    return tuple(cases)


def rope_lever(*, recipe: Recipe, tier: Tier, scale: str, candidate: Implementation, default: Implementation,
               options: LeverOptions) -> Lever:
    cases = rope_cases(recipe, options, scale)
    formula = all(isinstance(case.shape, RopeShape) and case.shape.formula_angles for case in cases)
    return Lever(
        name=NAME, version=VERSION, tier=tier, description=describe(default),
        recipe=recipe.ref_for(facts_for(recipe, options.model)), cases=cases, candidate=candidate,
        default=default, reference=Fp64Rope(), controls=controls(candidate),
        secondary_references=(FormulaRope(),) if formula else (), slicing=SLICING, invariants=INVARIANTS,
        cpu_threads=1,  # elementwise work on tensors of a few million elements: a second thread only contends
    )


def cpu_tier(recipe_id: str, options: LeverOptions, candidate: Implementation = UNFUSED) -> list[Lever]:
    """On the CPU at the smoke scale (the recipe's with --scale recipe): Megatron's unfused RoPE (or
    `candidate`) against the fused kernel's arithmetic (the stand-in)."""
    recipe = lever_recipe(recipe_id, options.recipe)
    return [rope_lever(recipe=recipe, tier=tiers.MEGATRON_CPU, scale=options.at_scale("smoke", "recipe"), candidate=candidate,
                       default=FusedRopeArithmetic(), options=options)]


def recipe_gpu_tier(recipe_id: str, options: LeverOptions) -> list[Lever]:
    """The recipe's GPU, recipe scale: Megatron's unfused RoPE against its fused path, TE's kernel."""
    recipe = lever_recipe(recipe_id, options.recipe)
    tier = tiers.recipe_gpu_tier(recipe.gpu)
    tier = replace(tier, markers=(*tier.markers, "megatron"))
    return [rope_lever(recipe=recipe, tier=tier, scale=options.gpu_at_scale("smoke", "recipe"), candidate=UNFUSED,
                       default=TE_FUSED, options=options)]

ROPE_HELD_TO_TE = HeldEqual(test="tests/test_rope_lever.py::test_fused_arithmetic_stands_in_for_tes_kernel",
                            upstream="TE's FusedRoPEFunc", needs_gpu=True)
ROPE_HELD_TO_TE_UNFUSED = HeldEqual(
    test="tests/test_rope_lever.py::test_fused_arithmetic_is_tes_unfused_rope_in_fp32_bitwise",
    upstream="TE 2.17's unfused apply_rotary_pos_emb (fused=False) in FP32, its Python on the CPU (bitwise)",
    needs_gpu=False)

# The seed recipes (Gemma-4's BSHD rows; Nemotron-3-Super has no RoPE) and Qwen3-30B-A3B for THD: its
# two packed rows per microbatch take Megatron's `_thd` route (and TE's on a GPU) and the packed-rows control.
RECIPES = (GEMMA, NEMOTRON, QWEN3_MOE)

SPEC = LeverSpec(
    name=NAME, version=VERSION,
    description="Megatron's unfused RoPE (--no-rope-fusion) against TE's fused RoPE kernel and FP64, q and k rotated,"
                " forward and backward, at the recipe's heads, rotary fraction and layout",
    titles=("rope fusion",),
    tests=(
        TierTest(test="test_rope_fusion_on_cpu", tier="megatron-cpu", factory=cpu_tier, recipes=RECIPES,
                 doc="Megatron's own unfused RoPE on the CPU against the fused kernel's arithmetic."),
        TierTest(test="test_rope_fusion_te_on_gpu", tier=RECIPE_GPU, factory=recipe_gpu_tier, recipes=RECIPES),
    ),
    reads=(*SHAPE_READS, "--position-embedding-type", "--qkv-format", "--rotary-interleaved",
           "--rotary-seq-len-interpolation-factor", "--use-rope-scaling", "--rope-scaling-factor"),
    evidence=Evidence(klass=UPSTREAM, tier="megatron-cpu", held_equal_by=(ROPE_HELD_TO_TE_UNFUSED, ROPE_HELD_TO_TE),
                      what="Megatron's unfused apply_rotary_pos_emb against this project's stand-in of TE's fused"
                           " RoPE kernel's arithmetic (FP32, one rounding)"))
