"""The attention-backend lever: a candidate attention path against the default (TE's unfused
numerics) and the FP64 reference, at a recipe's rank-local shapes.

Tiers, each a Lever of its own:
- "cpu": smoke scale on the CPU; torch SDPA's flash CPU kernel against the eager unfused path;
- "te-cpu": the same candidate against TE 2.17's own unfused attention, its Python on the CPU;
- "gpu": recipe scale on any CUDA GPU, without TE; each fused SDPA backend against the eager path,
  where torch's dispatch rules let it run (correctness.attention.combinations: flash is dropped at
  Gemma's masked and d512 layers, cuDNN's d512 cases are optional and skip with the rule);
- the recipe's GPU ("h100"): recipe scale; TE's auto backend against TE's forced unfused backend.

Cases: two seeded model-like synthetic cases per layer kind, one window-edge case per windowed
kind and one beyond-cap case per softcapped kind (all required), and four captured checkpoint cases
(the first and last layer of each kind), optional: they skip without a folder of captures (made by
`correctness capture-attention`).
Negative controls: the candidate with a window one key too wide and one key too narrow (on the
window-edge case, whose inputs make both edges decisive), with the softmax scale 1/sqrt(head_dim)
where the model uses another (Gemma: 1.0; Gemma 2's query_pre_attn_scalar ** -0.5 too) and 1.0
where it uses 1/sqrt(head_dim), without the logit softcap (on the beyond-cap case) and without the
sinks (dsink then zero, as a kernel that ignores them gives; on every case with sinks). Every
tensor is judged whole and per head and block of 128 positions; a single visible key must give its
value exactly where there are no sinks (correctness/attention/judging.py).

On the recipe's GPU each case expects the TE backend the recipe says runs on its layer kind
(correctness/attention/claims.py); where TE's auto choice is the default's own unfused kernel the
case is "no kernel change" (bitwise identical), never evidence for a fused kernel.
"""

import math
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

import torch

from correctness.attention.claims import expected_te_backends
from correctness.attention.eager import SCORE_BYTES, EagerUnfused, pairs_per_chunk
from correctness.attention.judging import SINGLE_KEY_ROWS, SLICING
from correctness.attention.inputs import AttentionInputs, checkpoint_file, checkpoint_inputs, synthetic_inputs
from correctness.attention.reference import Fp64Reference
from references.attention import WORKING_SET_BYTES
from correctness.attention.sdpa import Sdpa
from correctness.attention.te import TransformerEngine
from correctness import tiers
from correctness.evidence import UPSTREAM, Evidence, HeldEqual
from correctness.lever import Case, Control, Lever, LeverOptions, Mutated, Implementation, Tier
from correctness.lever_spec import RECIPE_GPU, SHAPE_READS, LeverSpec, TierTest
from correctness.recipe_sets import GEMMA
from correctness.wording import attention_backend
from correctness.models import ModelFacts, facts_for
from correctness.recipes import Recipe, lever_recipe
from correctness.attention.shapes import AttentionShape, attention_shape
from correctness.shapes import RECIPE_SCALE, Scale, SMOKE_SCALE

NAME = "attention-backend"
VERSION = 2  # 2: the recipe's backend claim per layer kind, "no kernel change", optional checkpoint cases
SYNTHETIC_SEEDS = (0, 1)
WINDOW_EDGE_SEED = 0
BEYOND_CAP_SEED = 0
CHECKPOINT_GRAD_SEED = 0
GPU_SDPA_BACKENDS = ("flash", "efficient", "cudnn")


# Peak bytes per element of a token-sized tensor (q, k, v, the output and their gradients): the
# seeded FP32 draws, the inputs, each path's outputs (the FP64 reference's at 8 bytes) and the
# judge's FP64 copies; and per score of the S x S masks every path shares (the boolean visibility,
# SDPA's float copy of it). The score-sized arrays are eager.SCORE_BYTES each. Measured on the CPU
# (8 heads, d 128, BSHD): 391 MB, 865 MB and 2.96 GB at 1,024, 2,048 and 4,096 tokens, against
# estimates of 436 MB, 1.14 GB and 3.76 GB.
TOKEN_BYTES = 96
MASK_BYTES = 5


def attention_memory(shape: AttentionShape, whole_head_scores: bool = False) -> tuple[int, str]:
    """A case's estimated peak bytes and the shape field that makes them: the S x S scores (one packed
    sequence of all rows in THD) of the eager path's chunk of heads (eager.pairs_per_chunk), or
    with `whole_head_scores` of every head at once (TE's and Megatron's unfused attention hold them
    all), the masks, the token-sized tensors, and the FP64 reference's query blocks
    (references.attention.WORKING_SET_BYTES, P and dP/dS)."""
    rows = shape.batch if shape.qkv_format == "bshd" else 1
    keys = shape.tokens + (1 if shape.sinks else 0)
    pairs = rows * shape.heads
    held = pairs if whole_head_scores else pairs_per_chunk(pairs, shape.tokens, keys)
    tokens = shape.batch * shape.seq_len * shape.heads * max(shape.head_dim, shape.v_head_dim)
    estimate = (SCORE_BYTES * held * shape.tokens * keys + MASK_BYTES * shape.tokens * shape.tokens
                + TOKEN_BYTES * tokens + 2 * WORKING_SET_BYTES)
    what = f"{shape.heads} heads'" if held == pairs else f"{held} of {pairs} heads' (a chunk at a time)"
    return estimate, f"seq_len {shape.seq_len}: {what} {shape.tokens} x {shape.tokens} scores"


def synthetic_case(shape: AttentionShape, seed: int, variant: str, expected_backend: str | None = None,
                   whole_head_scores: bool = False) -> Case:
    suffix = "" if variant == "model-like" else f"-{variant}"
    memory_bytes, memory_driver = attention_memory(shape, whole_head_scores)
    return Case(
        id=f"{shape.id}{suffix}-seed{seed}",
        shape=shape,
        seed=seed,
        source="synthetic",
        variant=variant,
        make_inputs=lambda device: synthetic_inputs(shape, seed, device, variant),
        expected_backend=expected_backend,
        memory_bytes=memory_bytes,
        memory_driver=memory_driver,
    )


def checkpoint_layers(model: ModelFacts, kind: str) -> tuple[int, ...]:
    """The checkpoint cases' layers of one kind: its first and its last (one where they coincide)."""
    layers = model.attention_layers(kind)
    return tuple(dict.fromkeys((layers[0], layers[-1])))


def checkpoint_case(
    shape: AttentionShape, layer: int, folder: Path | None, recipe_groups: int | None = None,
    expected_backend: str | None = None, whole_head_scores: bool = False,
) -> Case:
    """A case on captured inputs (correctness capture-attention). `recipe_groups`: the key-value groups
    of the recipe-scale rank-local slice the capture holds (None: the shape's own, a recipe-scale shape)."""
    path = None if folder is None else checkpoint_file(folder, layer)
    memory_bytes, memory_driver = attention_memory(shape, whole_head_scores)
    return Case(
        id=f"{shape.id}-layer{layer:02d}",
        shape=shape,
        seed=CHECKPOINT_GRAD_SEED,
        source="checkpoint",
        variant="captured",
        make_inputs=lambda device: checkpoint_inputs(
            shape, path, CHECKPOINT_GRAD_SEED, device, layer=layer, recipe_groups=recipe_groups
        ),
        skip_reason=None
        if folder is not None
        else "no captured checkpoint inputs given (--checkpoint-cases DIR or CORRECTNESS_CHECKPOINT_CASES)",
        required=False,
        expected_backend=expected_backend,
        memory_bytes=memory_bytes,
        memory_driver=memory_driver,
    )


def attention_cases(
    recipe: Recipe, model: ModelFacts, scale: Scale, options: LeverOptions, expected: Mapping[str, str],
    seeds: tuple[int, ...] = SYNTHETIC_SEEDS, whole_head_scores: bool = False,
) -> tuple[Case, ...]:
    """`expected`: layer kind -> the backend the candidate must run there (empty: no claim);
    `seeds`: those of the model-like cases; `whole_head_scores`: a path of the lever holds every
    head's scores at once (attention_memory)."""
    cases = []
    for kind in model.attention_kinds:
        shape = attention_shape(recipe, model, kind, scale)
        made = [(seed, "model-like") for seed in seeds] + [(WINDOW_EDGE_SEED, "window-edge")] * (shape.window is not None)
        made += [(BEYOND_CAP_SEED, "beyond-cap")] * (shape.softcap is not None)
        cases += [synthetic_case(shape, seed, variant, expected.get(kind), whole_head_scores) for seed, variant in made]
    for kind in model.attention_kinds:
        shape = attention_shape(recipe, model, kind, scale)
        recipe_groups = model.attention_kind(kind).kv_heads // recipe.tp
        cases += [
            checkpoint_case(shape, layer, options.checkpoint_dir, recipe_groups, expected.get(kind), whole_head_scores)
            for layer in checkpoint_layers(model, kind)
        ]
    return tuple(cases)


def window_too_wide(shape: AttentionShape) -> tuple[int, int]:
    left, right = shape.window
    return (left + 1, right)


def window_too_narrow(shape: AttentionShape) -> tuple[int, int]:
    left, right = shape.window
    return (left - 1, right)


def window_control_inapplicable(case: Case) -> str | None:
    """The window control runs on the cases built to expose a wrong window. On model-like inputs
    one extra key among a window's worth of keys with random logits moves the output by about the
    default's own error (measured 0.8-1.04 x the bound at smoke scale): too thin to be evidence."""
    shape = case.shape
    if shape.window is None:
        return f"{shape.layer_kind} layers have no window"
    if shape.seq_len <= shape.window[0] + 1:
        return f"sequence {shape.seq_len} is not longer than the window"
    if case.variant != "window-edge":
        return f"{case.variant} inputs do not expose the window edge; the window-edge case carries this control"
    return None


def wrong_scale(shape: AttentionShape) -> float:
    """1/sqrt(head_dim) where the model uses another scale (Gemma: 1.0), else 1.0."""
    usual = 1.0 / math.sqrt(shape.head_dim)
    return usual if not math.isclose(shape.softmax_scale, usual) else 1.0


def window_changed(change: Callable[[AttentionShape], tuple[int, int]]) -> Callable[[AttentionInputs], AttentionInputs]:
    """A mutation of the inputs: the window changed by `change`; a shape without a window stays as it is."""
    return lambda inputs: inputs if inputs.shape.window is None else inputs.with_shape(window=change(inputs.shape))


def _window_control(name: str, mutation: str, change: Callable[[AttentionShape], tuple[int, int]],
                    candidate: Implementation) -> Control:
    return Control(name=name, implementation=Mutated(base=candidate, mutation=mutation, mutate=window_changed(change)),
                   why_inapplicable=window_control_inapplicable)


def softcap_control_inapplicable(case: Case) -> str | None:
    """Model-like logits (RMS about softmax_scale sqrt(head_dim): Gemma 2's 1 against a cap of 50)
    stay where tanh is the identity to a part in thousands: ignoring the cap there changes nothing
    the bound could see. The beyond-cap case, whose logits reach past the cap, carries the control."""
    if case.shape.softcap is None:
        return f"{case.shape.layer_kind} layers have no logit softcap"
    if case.variant != "beyond-cap":
        return f"{case.variant} logits stay far below the cap; the beyond-cap case carries this control"
    return None


def sink_control_inapplicable(case: Case) -> str | None:
    return None if case.shape.sinks else f"{case.shape.layer_kind} layers have no attention sinks"


def zero_dsink(inputs: AttentionInputs, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a path that ignores the sinks gives for their gradient: zero (they do not change its output)."""
    return {**tensors, "dsink": torch.zeros(inputs.shape.heads, dtype=torch.float32, device=tensors["out"].device)}


def controls(candidate: Implementation) -> tuple[Control, ...]:
    return (
        _window_control("window off by one", "window one key too wide", window_too_wide, candidate),
        _window_control("window one short", "window one key too narrow", window_too_narrow, candidate),
        Control(
            name="wrong softmax scale",
            implementation=Mutated(
                base=candidate,
                mutation="softmax scale 1/sqrt(d) or 1.0",
                mutate=lambda inputs: inputs.with_shape(softmax_scale=wrong_scale(inputs.shape)),
            ),
        ),
        Control(
            name="softcap ignored",
            implementation=Mutated(base=candidate, mutation="no logit softcap",
                         mutate=lambda inputs: inputs.with_shape(softcap=None)),
            why_inapplicable=softcap_control_inapplicable,
        ),
        Control(
            name="sink ignored",
            implementation=Mutated(base=candidate, mutation="no attention sinks",
                         mutate=lambda inputs: inputs.without_sinks(), change_outputs=zero_dsink),
            why_inapplicable=sink_control_inapplicable,
        ),
    )


def attention_backend_lever(
    *, recipe: Recipe, tier: Tier, scale: Scale, candidate: Implementation, default: Implementation,
    options: LeverOptions, description: str, claims: bool = False, whole_head_scores: bool = False,
) -> Lever:
    """`claims`: the candidate must run the backend the recipe says runs on each layer kind;
    `whole_head_scores`: the default holds every head's scores at once (attention_memory)."""
    model = facts_for(recipe, options.model)
    expected = expected_te_backends(recipe, model) if claims else {}
    return Lever(
        name=NAME,
        version=VERSION,
        tier=tier,
        description=description,
        recipe=recipe.ref_for(model),
        cases=attention_cases(recipe, model, scale, options, expected, whole_head_scores=whole_head_scores),
        candidate=candidate,
        default=default,
        reference=Fp64Reference(),
        controls=controls(candidate),
        compares_kernels=True,
        slicing=SLICING,
        invariants=(SINGLE_KEY_ROWS,),
    )


def cpu_tier(recipe_id: str, options: LeverOptions, candidate: Implementation | None = None) -> list[Lever]:
    """On the CPU at the smoke scale (the recipe's with --scale recipe): SDPA's flash CPU kernel
    (FP32 logits), or the given candidate (any path taking AttentionInputs), against the eager
    unfused path."""
    recipe = lever_recipe(recipe_id, options.recipe)
    what = "torch SDPA's flash CPU kernel" if candidate is None else candidate.name
    return [
        attention_backend_lever(
            recipe=recipe, tier=tiers.CPU, scale=options.at_scale(SMOKE_SCALE, RECIPE_SCALE),
            candidate=candidate or Sdpa("flash"), default=EagerUnfused(), options=options,
            description=f"{what} against an eager unfused attention and an FP64 reference",
        )
    ]


def te_cpu_tier(recipe_id: str, options: LeverOptions) -> list[Lever]:
    """On the CPU at the smoke scale (the recipe's with --scale recipe) with Transformer Engine 2.17's
    own Python (correctness.te_on_cpu): the CPU tier's candidate against TE's DotProductAttention forced to its unfused backend, the
    reference recipe's own path (--attention-backend unfused). TE has no logit softcap on any
    backend: a softcapped layer kind's cases are optional here and skip saying so."""
    recipe = lever_recipe(recipe_id, options.recipe)
    lever = attention_backend_lever(
        recipe=recipe, tier=tiers.TE_CPU, scale=options.at_scale(SMOKE_SCALE, RECIPE_SCALE),
        candidate=Sdpa("flash"), default=TransformerEngine("unfused", on_cpu=True), options=options,
        whole_head_scores=True,
        description="torch SDPA's flash CPU kernel against Transformer Engine 2.17's own unfused attention (its Python"
                    " on the CPU) and an FP64 reference",
    )
    return [replace(lever, cases=tuple(without_softcap(case) for case in lever.cases))]


def without_softcap(case: Case) -> Case:
    """A softcapped case made optional, with TE's reason; any other case as it is."""
    if case.shape.softcap is None or not case.required:
        return case
    return replace(case, required=False, skip_reason=f"{case.shape.layer_kind} layers cap their logits (softcap"
                   f" {case.shape.softcap:g}); Transformer Engine 2.17 has no softcap on any backend")


def gpu_sdpa_tier(recipe_id: str, options: LeverOptions) -> list[Lever]:
    """Recipe scale on any CUDA GPU without TE: each fused SDPA backend against the eager path, where
    torch's dispatch rules let it run (correctness.attention.combinations: a backend refused on every
    case is dropped, a case it refuses is optional and skips with the rule)."""
    from correctness.attention.combinations import gpu_sdpa_levers  # it imports the packing lever, which imports this

    recipe = lever_recipe(recipe_id, options.recipe)
    scale = options.gpu_at_scale(SMOKE_SCALE, RECIPE_SCALE)
    cases = attention_cases(recipe, facts_for(recipe, options.model), scale, options, {})

    def build(path: Implementation, judged: tuple[Case, ...]) -> Lever:
        lever = attention_backend_lever(
            recipe=recipe, tier=tiers.GPU, scale=scale, candidate=path, default=EagerUnfused(), options=options,
            description=f"torch SDPA's {path.backend} backend against an eager unfused attention and an FP64 reference",
        )
        return replace(lever, cases=judged)

    return gpu_sdpa_levers(GPU_SDPA_BACKENDS, cases, build)


def recipe_gpu_tier(recipe_id: str, options: LeverOptions) -> list[Lever]:
    """Recipe scale on the recipe's GPU: TE's auto backend against TE forced to unfused."""
    recipe = lever_recipe(recipe_id, options.recipe)
    return [
        attention_backend_lever(
            recipe=recipe, tier=tiers.recipe_gpu_tier(recipe.gpu), scale=options.gpu_at_scale(SMOKE_SCALE, RECIPE_SCALE),
            candidate=TransformerEngine("auto"), default=TransformerEngine("unfused"), options=options,
            description="TE's auto attention backend against its unfused attention and an FP64 reference",
            claims=True,
        )
    ]

EAGER_HELD_TO_MEGATRON = HeldEqual(
    test="tests/test_softmax_precision_lever.py::test_fp32_softmax_is_bitwise_the_eager_unfused_path",
    upstream="Megatron's DotProductAttention with its FP32 softmax (bitwise)", needs_gpu=False)
EAGER_HELD_TO_TE = HeldEqual(
    test="tests/test_te_on_cpu.py::test_the_eager_path_is_bitwise_tes_unfused_attention",
    upstream="TE 2.17's UnfusedDotProductAttention, its Python on the CPU (bitwise)", needs_gpu=False)

SPEC = LeverSpec(
    name=NAME, version=VERSION,
    description="TE's attention backend (cuDNN fused, flash, unfused) against the default path and FP64, at the"
                " recipe's shape",
    titles=("attention backend", r"(fused|flash|unfused|cudnn) attention(?! over (two )?packed rows)"),
    tests=(
        TierTest(test="test_sdpa_flash_cpu_against_eager_unfused", tier="cpu", factory=cpu_tier, recipes=(GEMMA,)),
        TierTest(test="test_sdpa_flash_cpu_against_te_unfused_on_cpu", tier="te-cpu", factory=te_cpu_tier,
                 recipes=(GEMMA,)),
        TierTest(test="test_sdpa_fused_against_eager_unfused", tier="gpu", factory=gpu_sdpa_tier, recipes=(GEMMA,)),
        TierTest(test="test_te_auto_against_te_unfused", tier=RECIPE_GPU, factory=recipe_gpu_tier, recipes=(GEMMA,)),
    ),
    reads=(*SHAPE_READS, "layout.summary", "--attention-backend", "--qkv-format"),
    evidence=Evidence(klass=UPSTREAM, tier="cpu", held_equal_by=(EAGER_HELD_TO_MEGATRON, EAGER_HELD_TO_TE),
                      what="torch SDPA's flash CPU kernel (not TE's cuDNN or flash) against this project's eager"
                           " unfused attention, bitwise TE 2.17's own unfused attention (te-cpu runs TE's)"),
    entry_text=attention_backend.entry_text)
