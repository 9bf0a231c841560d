"""The FP8 lever (`--fp8-format e4m3|hybrid`, `--fp8-recipe delayed|tensorwise|blockwise|mxfp8`): a
linear layer of the recipe's model at its TP shard, forward and backward (y, dgrad, wgrad), in FP8
as Transformer Engine's recipe quantises it, against the same linear in BF16 (the default: BF16
training) and an FP64 reference (references/linear.py) on the same BF16 inputs.

Linears: the attention output projection (`self_attention.linear_proj`, row-parallel: the input
is the attention width over TP) of the first attention layer, and the first dense MLP's fc1
(`mlp.linear_fc1`, or the shared expert's where the MLP is an MoE; column-parallel: the output is
the FFN width, gate and up for a gated MLP, over TP), their TP rank 0 shapes from Megatron's
layout (correctness.megatron.layout). Tokens: the recipe's tokens per microbatch (row tokens x
rows per microbatch): with sequence parallelism each TP rank's GEMM runs over the gathered
sequence. The smoke scale (CPU tier) divides each feature dimension by 16 and the tokens by 32,
rounded up to a multiple of 32 (MXFP8's block) and at least 128 (one 1x128 block).

Configurations: a recipe that trains in FP8 (--fp8-format) runs its own (its --fp8-recipe, delayed
by default, with its --fp8-margin, --fp8-amax-history-len and --fp8-amax-compute-algo); a recipe
that does not runs all four recipes in both formats (e4m3 and hybrid), at Megatron's defaults for
the rest: what turning FP8 on would do.

Tiers: `cpu`, torch's float8 dtypes, smoke scale, the GEMMs with Hopper's FP8 arithmetic where mmaemu models
them (correctness.fp8.hopper: per-tensor scales, delayed and tensorwise; the H100 PCIe's arithmetic, the nearest
chip mmaemu models to the recipes' H100 SXM / H200), the FP32 stand-in for blockwise and MXFP8
(correctness.fp8.paths), the negative controls the stand-in's mistakes; the recipe's GPU (`h100`/`h200` +
`te`), TE's Linear under te.autocast at the recipe's scale, the negative controls being the emulation's
mistakes run on the GPU.

FP8 fails the rule against BF16 by its format (E4M3's unit roundoff, 2^-4, is 32 times BF16's):
the format floor (correctness.lever.FormatFloor) is the FP64 reference on the recipe's FP8
operands, its outputs rounded to the candidate's dtypes (paths.Fp64OnFp8Operands), and a candidate
within 2 x its error + 1e-3, unbiased against it, whose controls all fail that bound, is
`format-limited`. What a recipe then needs besides is evidence the rule cannot give: convergence
(`correctness converge`) against its BF16 reference.
"""

import math
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch

from correctness import tiers
from correctness.errors import RecipeError
from correctness.fp8.hopper import HopperTeGemms
from correctness.fp8.inputs import LinearInputs, amax_histories, draw_tensors
from correctness.fp8.paths import MISTAKES, Bf16Linear, EmulatedFp8Linear, Fp64Linear, Fp64OnFp8Operands
from correctness.fp8.scaling import AMAX_ALGOS, FORMATS, RECIPES, Fp8Config
from correctness.fp8.te_linear import TeLinear
from correctness.evidence import STAND_IN, Evidence
from correctness.lever import Case, Control, FormatFloor, Lever, LeverOptions, NotApplicable, Tier
from correctness.lever_spec import RECIPE_GPU, SHAPE_READS, LeverSpec, TierTest
from correctness.models import ModelFacts, facts_for
from correctness.megatron.layout import RECIPE, param_slices
from correctness.recipes import Recipe, lever_recipe
from correctness.results import CaseResult

NAME = "fp8"
VERSION = 3  # 2: the FP8 format floor (docs/levers/fp8.md); 3: the CPU candidate's per-tensor GEMMs by mmaemu hopper-te
SEEDS = (0,)
DESCRIPTION = (
    "a linear layer's forward and backward in FP8 (TE's delayed, tensorwise, blockwise or MXFP8 scaling)"
    " against BF16 and FP64, at the recipe's TP shard"
)
SMOKE_FEATURE_DIVISOR = 16
SMOKE_TOKEN_DIVISOR = 32
SMOKE_GRANULE = 32  # smoke dimensions are whole MXFP8 blocks (128-element blocks may be partial, as at 1,344) ...
SMOKE_MINIMUM = 128  # ... and at least one 128-element block
LINEARS = (  # (short name, Megatron parameter suffixes, in the order looked for)
    ("attn-proj", ("self_attention.linear_proj.weight",)),
    ("mlp-fc1", ("mlp.linear_fc1.weight", "mlp.shared_experts.linear_fc1.weight")),
)
HOPPER = ("H100", "H200")  # no MXFP8 GEMM (TE 2.17 quantization.py: MXFP8 needs compute capability 10.0)
MEGATRON_DEFAULTS = {"--fp8-margin": 0, "--fp8-amax-history-len": 1, "--fp8-amax-compute-algo": "most_recent"}
FLOOR_ROUNDINGS = (
    "each GEMM's operands (x and W in the forward, dy and W in dgrad, dy and x in wgrad) quantised to FP8 as"
    " the recipe prescribes: E4M3, the output gradient dy in E5M2 under hybrid; with the recipe's scales (delayed:"
    " one per tensor from the amax history of the earlier iterations; tensorwise: one per tensor from its own"
    " amax; blockwise: 1x128 blocks, 128x128 for the weight; MXFP8: 1x32 blocks with E8M0 scales; blocks along"
    " the GEMM's contraction) and a saturating round-to-nearest-even cast",
    "y and dgrad to BF16, wgrad to FP32 (gradient accumulation fusion into main_grad) or BF16",
)
FLOOR = FormatFloor(format="FP8", roundings=FLOOR_ROUNDINGS,
                    implementation=Fp64OnFp8Operands(name="fp8-format-floor", round_outputs=True))


@dataclass(frozen=True, kw_only=True)
class Fp8LinearShape:
    model: str
    scale: str
    linear: str
    parameter: str  # Megatron's parameter name (TP rank 0)
    parallel: str  # column-parallel or row-parallel
    tp: int
    tokens: int
    out_features: int
    in_features: int
    recipe_shape: tuple[int, int, int]  # (tokens, out, in) at the recipe's scale
    fp8_recipe: str
    fp8_format: str
    margin: int
    amax_history_len: int
    amax_compute_algo: str
    forward_dtype: str
    backward_dtype: str
    wgrad_dtype: str  # "fp32" (gradient accumulation fusion into main_grad) or "bf16"
    recipe_trains_in_fp8: bool

    @property
    def config(self) -> Fp8Config:
        return Fp8Config(recipe=self.fp8_recipe, format=self.fp8_format, margin=self.margin,
                         amax_history_len=self.amax_history_len, amax_compute_algo=self.amax_compute_algo)

    @property
    def id(self) -> str:
        sizes = f"t{self.tokens}-o{self.out_features}-i{self.in_features}"
        return f"{self.model}-{self.linear}-tp{self.tp}-{sizes}-{self.config.id}"

    def record(self) -> dict[str, Any]:
        fields = asdict(self)
        fields["recipe_shape"] = dict(zip(("tokens", "out_features", "in_features"), self.recipe_shape))
        return {"id": self.id, **fields}


def _int_argument(recipe: Recipe, flag: str) -> int:
    values = recipe.argument(flag)
    if values is None:
        return MEGATRON_DEFAULTS[flag]
    try:
        return int(values[0])
    except (IndexError, ValueError):
        raise RecipeError(f"recipe {recipe.id}: {flag} {' '.join(values)!r} is not an integer") from None


def _choice(recipe: Recipe, flag: str, choices: tuple[str, ...], default: str | None) -> str | None:
    values = recipe.argument(flag)
    if values is None:
        return default
    if len(values) != 1 or values[0] not in choices:
        raise RecipeError(f"recipe {recipe.id}: {flag} {' '.join(values)!r}: expected one of {', '.join(choices)}")
    return values[0]


def fp8_configs(recipe: Recipe) -> tuple[tuple[Fp8Config, ...], bool]:
    """The configurations the lever runs, and whether the recipe itself trains in FP8."""
    fp8_recipe = _choice(recipe, "--fp8-recipe", (*RECIPES, "custom"), "delayed")
    if fp8_recipe == "custom":
        raise NotApplicable(f"recipe {recipe.id} uses a custom FP8 quantizer factory (--fp8-recipe custom): not modelled")
    fp8_format = _choice(recipe, "--fp8-format", FORMATS, None)
    margin = _int_argument(recipe, "--fp8-margin")
    history = _int_argument(recipe, "--fp8-amax-history-len")
    algo = _choice(recipe, "--fp8-amax-compute-algo", AMAX_ALGOS, MEGATRON_DEFAULTS["--fp8-amax-compute-algo"])
    try:
        if fp8_format is not None:
            return (Fp8Config(recipe=fp8_recipe, format=fp8_format, margin=margin, amax_history_len=history,
                              amax_compute_algo=algo),), True
        return tuple(Fp8Config(recipe=name, format=fmt, margin=margin, amax_history_len=history,
                               amax_compute_algo=algo) for name in RECIPES for fmt in FORMATS), False
    except ValueError as bad:
        raise RecipeError(f"recipe {recipe.id}: {bad}") from None


def _linear_slices(recipe: Recipe, model: ModelFacts) -> list[tuple[str, str, str, tuple[int, int]]]:
    """(short name, parameter, kind, [out, in]) of each linear the model has, TP rank 0, first layer
    holding it."""
    found: dict[str, tuple[str, str, str, tuple[int, int]]] = {}
    for layer in range(model.layers):
        slices = param_slices(model, tp=recipe.tp, tp_rank=0, layers=(layer,), embedding_rows=1, scale=RECIPE,
                              ep=recipe.positive_int("layout.ep"), etp=1)
        for short, suffixes in LINEARS:
            if short in found:
                continue
            for piece in slices:
                if piece.layer == layer and any(piece.name.endswith(suffix) for suffix in suffixes):
                    found[short] = (short, piece.name, piece.kind, tuple(piece.shape))
                    break
        if len(found) == len(LINEARS):
            break
    return [found[short] for short, _ in LINEARS if short in found]


def _smoke(size: int, divisor: int) -> int:
    return max(SMOKE_MINIMUM, SMOKE_GRANULE * math.ceil(size / divisor / SMOKE_GRANULE))


def fp8_shapes(recipe: Recipe, model: ModelFacts, scale: str, gpu: str | None = None) -> list[Fp8LinearShape]:
    """The cases' shapes; `gpu`: the GPU the tier runs on, where MXFP8 needs Blackwell (TE's
    check_mxfp8_support: compute capability 10.0): on a Hopper GPU a recipe that does not train in
    FP8 runs the other three recipes, and one that asks for MXFP8 keeps its case, which TE refuses."""
    if recipe.precision != "bf16":
        raise NotApplicable(f"recipe {recipe.id} trains in {recipe.precision}: the FP8 lever compares against BF16 training")
    configs, trains_in_fp8 = fp8_configs(recipe)
    if gpu in HOPPER and not trains_in_fp8:
        configs = tuple(config for config in configs if config.recipe != "mxfp8")
    tokens = recipe.row_tokens * recipe.rows_per_microbatch
    fused = recipe.argument("--no-gradient-accumulation-fusion") is None
    linears = _linear_slices(recipe, model)
    if not linears:
        raise NotApplicable(f"{model.name} has no attention output projection or dense MLP fc1 in Megatron's layout")
    shapes = []
    for short, parameter, kind, (out_features, in_features) in linears:
        sizes = (tokens, out_features, in_features)
        if scale == "smoke":
            sizes = (_smoke(tokens, SMOKE_TOKEN_DIVISOR), _smoke(out_features, SMOKE_FEATURE_DIVISOR),
                     _smoke(in_features, SMOKE_FEATURE_DIVISOR))
        for config in configs:
            shapes.append(Fp8LinearShape(
                model=model.short_name, scale=scale, linear=short, parameter=parameter, parallel=kind, tp=recipe.tp,
                tokens=sizes[0], out_features=sizes[1], in_features=sizes[2],
                recipe_shape=(tokens, out_features, in_features), fp8_recipe=config.recipe, fp8_format=config.format,
                margin=config.margin, amax_history_len=config.amax_history_len,
                amax_compute_algo=config.amax_compute_algo, forward_dtype=config.forward.name,
                backward_dtype=config.backward.name, wgrad_dtype="fp32" if fused else "bf16",
                recipe_trains_in_fp8=trains_in_fp8,
            ))
    return shapes


def make_inputs(shape: Fp8LinearShape, seed: int, device: torch.device) -> LinearInputs:
    config = shape.config
    history_len = config.amax_history_len if config.recipe == "delayed" else 0
    current, earlier = draw_tensors(shape.tokens, shape.in_features, shape.out_features, seed, history_len)
    return LinearInputs(
        shape=shape, config=config, x=current.x.to(device), weight=current.weight.to(device),
        grad_output=current.grad_output.to(device),
        wgrad_dtype=torch.float32 if shape.wgrad_dtype == "fp32" else torch.bfloat16,
        earlier=earlier, history={role: h.to(device) for role, h in amax_histories(earlier).items()} if earlier else {},
    )


def summarize(case: CaseResult) -> dict[str, Any]:
    """How far FP8 is from the rule and from its format: per tensor the candidate's error, the
    default's, error/bound, the ratio, the GEMM's own share (the candidate against FP64 on the FP8
    operands), the floor's error, the format bound, error/format bound, and the scale slope with its
    threshold against the floor; per control its power under the rule, that power over the
    candidate's own error/bound on the same tensor, and its power against the format bound."""
    candidate = {t.tensor: t for t in case.candidate.tensors}
    gemm = {t.tensor: t.error for judgement in case.secondary for t in judgement.tensors}
    tensors = {
        name: {
            "candidate_error": t.error, "default_error": t.default_error, "bound": t.bound,
            "error_over_bound": t.error_over_bound, "ratio_to_default": t.ratio, "passes": t.passes,
            "bias": t.bias, **({"error_against_fp8_operands": gemm[name]} if name in gemm else {}),
        }
        for name, t in candidate.items()
    }
    if case.format is not None:
        floor = {t.tensor: t for t in case.format.candidate.tensors}
        for name, figures in tensors.items():
            t = floor[name]
            figures.update(floor_error=t.default_error, format_bound=t.bound, error_over_format_bound=t.error_over_bound,
                           slope=t.systematic.slope, slope_threshold_against_floor=t.systematic.slope_threshold)
    worst = max(candidate.values(), key=lambda t: t.error_over_bound)
    format_powers = {control.name: control.power for control in case.format.controls} if case.format else {}
    controls = {}
    for control in case.controls:
        if control.judgement is None:
            continue
        powers = {t.tensor: t.error_over_bound for t in control.judgement.tensors}
        strongest = max(powers, key=powers.get)
        controls[control.name] = {
            "power": powers[strongest], "tensor": strongest, "least_tensor_power": min(powers.values()),
            "power_over_candidate": {name: powers[name] / candidate[name].error_over_bound for name in powers},
            **({"format_power": format_powers[control.name]} if control.name in format_powers else {}),
        }
    details = case.candidate.run.details
    return {
        "tensors": tensors, "worst_error_over_bound": worst.error_over_bound, "worst_tensor": worst.tensor,
        "least_error_over_bound": min(t.error_over_bound for t in candidate.values()),
        "controls": controls,
        **{key: details[key] for key in ("gemm", "mmaemu", "profile", "profile_note", "gemms", "hopper_gemms_not_run",
                                         "operands", "scaled_mm_probe", "transformer_engine") if key in details},
    }


# Peak bytes per element of the case's largest tensors, all paths together: the FP32 draws, the
# inputs in their dtype, each path's outputs and gradients, and the FP64 reference's copies of
# them (an estimate from what the paths allocate, not measured; correctness.memory).
ELEMENT_BYTES = 48


def fp8_memory(shape: Fp8LinearShape) -> dict[str, Any]:
    """A case's estimated peak bytes (Case.memory_bytes, memory_driver): the input, the weight and the
    output with their gradients."""
    elements = shape.tokens * (shape.in_features + shape.out_features) + shape.out_features * shape.in_features
    return {"memory_bytes": ELEMENT_BYTES * elements,
            "memory_driver": f"tokens {shape.tokens} x features {shape.in_features} in, {shape.out_features} out"}


def fp8_lever(recipe: Recipe, *, tier: Tier, scale: str, options: LeverOptions, candidate: Any) -> Lever:
    model = facts_for(recipe, options.model)
    shapes = fp8_shapes(recipe, model, scale, gpu=None if tier.device == "cpu" else recipe.gpu)
    cases = tuple(
        Case(id=f"{shape.id}-seed{seed}", shape=shape, seed=seed, source="synthetic", variant="model-like",
             make_inputs=partial(make_inputs, shape, seed), **fp8_memory(shape),
             recipe_runs="candidate" if shape.recipe_trains_in_fp8 else "default")
        for shape in shapes for seed in SEEDS
    )
    controls = tuple(Control(name=mistake,
                             implementation=EmulatedFp8Linear(name=f"fp8-emulated ({mistake})", mistake=mistake))
                     for mistake in MISTAKES)
    return Lever(
        name=NAME, version=VERSION, tier=tier, description=DESCRIPTION, recipe=recipe.ref_for(model), cases=cases,
        candidate=candidate, default=Bf16Linear() if tier.device == "cpu" else TeLinear("te-linear-bf16", fp8=False),
        reference=Fp64Linear(), secondary_references=(Fp64OnFp8Operands(),), controls=controls, summarize=summarize,
        # small GEMMs: a second thread only contends (on the emulated GPU too, which runs on the CPU)
        cpu_threads=1 if tier.device == "cpu" or options.emulated is not None else None,
        format_floor=FLOOR,
    )


def cpu_tier(recipe_id: str, options: LeverOptions) -> list[Lever]:
    """torch's float8 dtypes on the CPU, at the smoke scale, the GEMMs by mmaemu's hopper-te profile where the
    recipe scales per tensor (correctness.fp8.hopper; unavailable without mmaemu), else the FP32 stand-in; the
    default is torch's CPU BF16 matmul."""
    recipe = lever_recipe(recipe_id, options.recipe)
    return [fp8_lever(recipe, tier=tiers.CPU, scale=options.at_scale("smoke", "recipe"), options=options,
                      candidate=EmulatedFp8Linear(probe_scaled_mm=True, gemms=HopperTeGemms()))]


def recipe_gpu_tier(recipe_id: str, options: LeverOptions) -> list[Lever]:
    """TE's Linear under te.autocast with the recipe's FP8 recipe, against TE's Linear in BF16, on the
    recipe's GPU at the recipe's scale."""
    recipe = lever_recipe(recipe_id, options.recipe)
    return [fp8_lever(recipe, tier=tiers.recipe_gpu_tier(recipe.gpu), scale=options.gpu_at_scale("smoke", "recipe"),
                      options=options,
                      candidate=TeLinear("te-linear-fp8", fp8=True))]

SPEC = LeverSpec(
    name=NAME, version=VERSION,
    description="a linear layer's forward and backward in FP8 (TE's delayed, tensorwise, blockwise or MXFP8 scaling)"
                " against BF16 and FP64, at the recipe's TP shard",
    titles=("forward and backward in FP8",),
    tests=(
        TierTest(test="test_fp8_linear_cpu", tier="cpu", factory=cpu_tier,
                 doc="torch's float8 dtypes, smoke scale; the GEMMs with Hopper's arithmetic (mmaemu hopper-te: the"
                     " H100 PCIe's, the nearest chip mmaemu models to the recipe's H100 SXM / H200) on delayed and"
                     " tensorwise scaling, the FP32 stand-in on blockwise and MXFP8 (the record says which ran)."),
        TierTest(test="test_fp8_linear_with_te", tier=RECIPE_GPU, factory=recipe_gpu_tier,
                 doc="TE's Linear under te.autocast with the FP8 recipe, against TE's Linear in BF16, recipe scale."),
    ),
    reads=(*SHAPE_READS, "layout.ep", "--fp8-format", "--fp8-recipe", "--fp8-margin", "--fp8-amax-history-len",
           "--fp8-amax-compute-algo", "--no-gradient-accumulation-fusion"),
    evidence=Evidence(klass=STAND_IN, tier="cpu",
                      what="TE's four scaling recipes in torch's float8 dtypes; delayed and tensorwise GEMMs with"
                           " Hopper's FP8 arithmetic (mmaemu 0.1.0 hopper-te: the H100 PCIe's, the nearest chip it"
                           " models to the recipes' H100 SXM / H200; fprop with fast accumulation, dgrad and wgrad"
                           " with the split accumulator, as TE), blockwise and MXFP8 with an FP32 GEMM stand-in"
                           " (probed against torch._scaled_mm where the CPU takes the layout)"))
