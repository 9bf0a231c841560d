"""The attention-softmax-precision lever (`--attention-softmax-in-fp32`, `--no-masked-softmax-fusion`):
Megatron's own core attention (`DotProductAttention`, correctness/attention/megatron_softmax.py)
with its softmax in BF16 (candidate: `attention_softmax_in_fp32=False`) against the same module
with its softmax in FP32 (default: what the seed recipes run, `--attention-softmax-in-fp32`), and
the FP64 reference, at the recipe's rank-local attention shapes. Candidate and default differ in
that one flag (in the fusion tier, in masked-softmax fusion alone).

Tiers, each a Lever of its own:
- "megatron-cpu": smoke scale on the CPU; masked-softmax fusion off (its kernel is CUDA only), so
  FusedScaleMaskSoftmax takes its torch path, under the CUDA shims of megatron_softmax.py;
- "gpu" (`gpu_tier`): recipe scale (or a given scale) on a CUDA GPU, masked-softmax fusion as the recipe says
  (on unless `--no-masked-softmax-fusion`): where Megatron's fused kernel takes the shape (16 < keys
  <= 4096, ...) it runs for candidate and default alike, reading no precision flag (their backends
  are then the same: "no kernel change", which must be bitwise identical); elsewhere (Gemma-4's
  8,192 keys) torch's CUDA softmax runs in the precision the flag says;
- "gpu" (`fusion_gpu_tier`, not in the component test): the fused kernel against the torch softmax,
  both FP32 by the flag, at the smoke scale, where the kernel takes the shapes: what
  `--no-masked-softmax-fusion` changes on a GPU.

Cases: the attention lever's kinds of case, with one model-like seed per layer kind where it has
two (SEEDS): the window-edge case per windowed kind, the beyond-cap case per softcapped kind and
the checkpoint cases (optional: they skip without captured inputs). One seed: on the CPU tier the
two seeds' figures differ by less than 0.2% of the default's error (README), and the tier stays
near 30 s on two cores. Negative controls, built from the candidate: the attention lever's (window
one key too wide and one too narrow on the window-edge case, the wrong softmax scale; softcap and
sinks where a model has them) and this lever's own, the mask ignored (Megatron's mask function
replaced by one that fills nothing: every query attends every key, the later ones included; with
masked-softmax fusion off, since the fused kernel takes no mask function). Judged whole and per
head and block of 128 positions, with the single-key invariant (correctness/attention/judging.py).

Where the flag reaches: only Megatron's local DotProductAttention reads `attention_softmax_in_fp32`
and `masked_softmax_fusion` (megatron-core 0.16.1: TEDotProductAttention reads neither; TE's
unfused attention builds its softmax without such a flag and computes it in FP32). A recipe on TE
attention (both seed recipes: `--attention-backend auto`) runs no code the flags change; this lever
measures what they change where they take effect, `--attention-backend local` or
`--transformer-impl local`. With `--apply-query-key-layer-scaling` Megatron forces the softmax to
FP32 (TransformerConfig), so the lever does not apply.
"""

from dataclasses import replace

from correctness import tiers
from correctness.attention import backend_lever as attention
from correctness.attention.judging import SINGLE_KEY_ROWS, SLICING
from correctness.attention.megatron_softmax import MegatronAttention
from correctness.attention.reference import Fp64Reference
from correctness.shapes import RECIPE_SCALE, Scale, SMOKE_SCALE
from correctness.evidence import GPU_ONLY, UPSTREAM, Evidence
from correctness.lever import Case, Control, Lever, LeverOptions, NotApplicable, Tier
from correctness.results import CaseResult
from correctness.lever_spec import SHAPE_READS, LeverSpec, TierTest
from correctness.recipe_sets import GEMMA
from correctness.models import facts_for
from correctness.recipes import Recipe, lever_recipe

NAME = "attention-softmax-precision"
VERSION = 1
ARGUMENTS = ("--attention-softmax-in-fp32", "--no-masked-softmax-fusion")
SEEDS = (0,)
DESCRIPTION = "Megatron's core attention with its softmax in BF16 against its softmax in FP32 and an FP64 reference"


def masked_softmax_fusion(recipe: Recipe) -> bool:
    """Megatron-LM's `masked_softmax_fusion`: on unless the recipe says `--no-masked-softmax-fusion`."""
    return recipe.argument("--no-masked-softmax-fusion") is None


def recipe_side(recipe: Recipe, candidate: MegatronAttention, default: MegatronAttention) -> str:
    """Which path the recipe runs, by the settings in which candidate and default differ."""
    settings = {"softmax_in_fp32": recipe.argument("--attention-softmax-in-fp32") is not None,
                "masked_softmax_fusion": masked_softmax_fusion(recipe)}
    differ = [name for name in settings if getattr(candidate, name) != getattr(default, name)]
    for side, path in (("candidate", candidate), ("default", default)):
        if all(getattr(path, name) == settings[name] for name in differ):
            return side
    return "neither"


def applies(recipe: Recipe) -> None:
    """Raises NotApplicable where the recipe leaves the flag no BF16 softmax to choose."""
    if recipe.argument("--apply-query-key-layer-scaling") is not None:
        raise NotApplicable(
            f"recipe {recipe.id}: --apply-query-key-layer-scaling makes Megatron compute the attention softmax"
            " in FP32 whatever --attention-softmax-in-fp32 says (TransformerConfig)"
        )
    if recipe.precision not in ("bf16", "fp16"):
        raise NotApplicable(f"recipe {recipe.id}: precision {recipe.precision}; the flag applies to BF16 and FP16 inputs")


def mask_ignored(candidate: MegatronAttention) -> Control:
    """The candidate with Megatron's mask function filling nothing (masked keys leak), on
    FusedScaleMaskSoftmax's torch path: the fused kernel makes its causal mask itself."""
    return Control(name="mask ignored",
                   implementation=replace(candidate, mask_ignored=True, masked_softmax_fusion=False))


def controls(candidate: MegatronAttention) -> tuple[Control, ...]:
    return (*attention.controls(candidate), mask_ignored(candidate))


FUSED_KERNEL = "megatron-fused-softmax"  # how MegatronAttention names the fused kernel's run
WINDOW_IGNORED = (
    "megatron-core 0.16.1's fused masked softmax takes no window: FusedScaleMaskSoftmax.forward chooses the"
    " kernel for 16 < keys <= 4096 whatever window_size says (fusions/fused_softmax.py 233-236), so on a"
    " sliding-window layer the window is lost where the kernel runs")


def window_lost(case: Case, result: CaseResult) -> str | None:
    """An upstream limitation, not this suite's: a windowed case on which Megatron's fused kernel ran
    (in the candidate or the default) loses its window, so it fails."""
    if case.shape.window is None:
        return None
    ran = [judged.run.backend for judged in (result.candidate, result.default_repeat) if judged is not None]
    ran += [result.default.backend] if result.default is not None else []
    return WINDOW_IGNORED if any(backend.startswith(FUSED_KERNEL) for backend in ran) else None


def softmax_precision_lever(
    *, recipe: Recipe, tier: Tier, scale: Scale, candidate: MegatronAttention, default: MegatronAttention,
    options: LeverOptions, description: str = DESCRIPTION,
) -> Lever:
    applies(recipe)
    model = facts_for(recipe, options.model)
    return Lever(
        name=NAME,
        version=VERSION,
        tier=tier,
        description=description,
        recipe=recipe.ref_for(model),
        cases=tuple(replace(case, recipe_runs=recipe_side(recipe, candidate, default))
                    for case in attention.attention_cases(recipe, model, scale, options, {}, seeds=SEEDS,
                                                          whole_head_scores=True)),
        candidate=candidate,
        default=default,
        reference=Fp64Reference(),
        controls=controls(candidate),
        compares_kernels=True,  # on a GPU the fused kernel ignores the flag: "no kernel change"
        slicing=SLICING,
        invariants=(SINGLE_KEY_ROWS,),
        known_failure=window_lost,
    )


def cpu_tier(
    recipe_id: str, options: LeverOptions, candidate: MegatronAttention | None = None, scale: Scale | None = None,
) -> list[Lever]:
    """On the CPU at the smoke scale (the recipe's with --scale recipe): Megatron's
    DotProductAttention, FusedScaleMaskSoftmax's torch path, softmax in BF16 (or the given candidate) against FP32."""
    recipe = lever_recipe(recipe_id, options.recipe)
    return [
        softmax_precision_lever(
            recipe=recipe, tier=tiers.MEGATRON_CPU, scale=scale or options.at_scale(SMOKE_SCALE, RECIPE_SCALE),
            candidate=candidate or MegatronAttention(softmax_in_fp32=False),
            default=MegatronAttention(softmax_in_fp32=True), options=options,
        )
    ]


def gpu_tier(recipe_id: str, options: LeverOptions, scale: Scale | None = None) -> list[Lever]:
    """On a CUDA GPU, masked-softmax fusion as the recipe says: softmax in BF16 against FP32 (at the
    recipe's scale, or the given one; the smoke scale on an emulated GPU)."""
    recipe = lever_recipe(recipe_id, options.recipe)
    scale = scale or options.gpu_at_scale(SMOKE_SCALE, RECIPE_SCALE)
    fusion = masked_softmax_fusion(recipe)
    return [
        softmax_precision_lever(
            recipe=recipe, tier=tiers.GPU, scale=scale,
            candidate=MegatronAttention(softmax_in_fp32=False, masked_softmax_fusion=fusion),
            default=MegatronAttention(softmax_in_fp32=True, masked_softmax_fusion=fusion), options=options,
            description=DESCRIPTION + (", masked-softmax fusion on" if fusion else ", masked-softmax fusion off"),
        )
    ]


FUSION_DESCRIPTION = "Megatron's fused masked-softmax kernel against its core attention's FP32 softmax and an FP64 reference"


def fusion_gpu_tier(recipe_id: str, options: LeverOptions, scale: Scale = SMOKE_SCALE) -> list[Lever]:
    """On a CUDA GPU, what `--no-masked-softmax-fusion` removes: Megatron's fused masked-softmax
    kernel (fusion on) against its torch softmax (fusion off), both with the FP32 softmax flag. At
    the smoke scale the kernel takes the shapes (16 < keys <= 4096); at Gemma-4's recipe scale
    (8,192 keys) it takes none, and every case is "no kernel change". The kernel takes no window
    (megatron-core 0.16.1, forward_fused_softmax), so on a windowed layer it is expected to fail;
    where its CUDA extension is not built the cases skip."""
    recipe = lever_recipe(recipe_id, options.recipe)
    return [
        softmax_precision_lever(
            recipe=recipe, tier=tiers.GPU, scale=scale,
            candidate=MegatronAttention(softmax_in_fp32=True, masked_softmax_fusion=True),
            default=MegatronAttention(softmax_in_fp32=True), options=options, description=FUSION_DESCRIPTION,
        )
    ]

SPEC = LeverSpec(
    name=NAME, version=VERSION,
    description="Megatron's core attention (DotProductAttention) with its softmax in BF16 against FP32, and its"
                " fused masked-softmax kernel against its torch softmax, and FP64, at the recipe's shape",
    titles=("softmax in BF16 against its softmax in FP32", "fused masked-softmax kernel"),
    tests=(
        TierTest(test="test_megatron_softmax_bf16_against_fp32_cpu", tier="megatron-cpu", factory=cpu_tier,
                 recipes=(GEMMA,)),
        TierTest(test="test_megatron_softmax_bf16_against_fp32_gpu", tier="gpu", factory=gpu_tier, recipes=(GEMMA,)),
        TierTest(test="test_megatron_fused_masked_softmax_against_torch_softmax_gpu", tier="gpu",
                 factory=fusion_gpu_tier, recipes=(GEMMA,),
                 doc="`--no-masked-softmax-fusion`: Megatron's fused masked-softmax kernel (where its CUDA extension"
                     " is built and the shape is one it takes) against its torch softmax."),
    ),
    reads=(*SHAPE_READS, "--attention-softmax-in-fp32", "--apply-query-key-layer-scaling",
           "--no-masked-softmax-fusion", "--qkv-format"),
    evidence=Evidence(klass=UPSTREAM, tier="megatron-cpu", gpu_description="softmax in BF16 against",
                      what="Megatron's DotProductAttention with its softmax in BF16 against FP32"
                           " (FusedScaleMaskSoftmax's torch path)"),
    argument_evidence={"--no-masked-softmax-fusion": Evidence(
        klass=GPU_ONLY, tier="gpu", gpu_description="fused masked-softmax kernel",
        what="Megatron's fused masked-softmax kernel is CUDA only: the CPU tier runs fusion off on both sides")})
