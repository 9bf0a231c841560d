"""The bias-swiglu-fusion lever (`--no-bias-swiglu-fusion`): Megatron's fused SwiGLU
(`bias_swiglu_impl`, and `weighted_bias_swiglu_impl` in the routed experts; torch.compile'd as
Megatron runs them) against the unfused SwiGLU that runs without the fusion, and an FP64 SwiGLU
(references/swiglu.py), forward and backward (correctness.swiglu.paths says exactly what runs).

Where the flag reaches (Megatron-LM `core_transformer_config_from_args`): only with `--swiglu`
does `bias_activation_fusion` follow `--no-bias-swiglu-fusion`; otherwise it follows
`--no-bias-gelu-fusion`. So the lever applies to models whose facts say `mlp: {activation: silu,
gated: true}` without a clamp or an offset (Llama, Qwen3, Qwen3-MoE, DeepSeek-V3/Moonlight) and
is NotApplicable, with the reason, to the others:
- Gemma-4 (`gelu_tanh`, gated): Megatron-Bridge's Gemma 4 provider sets `activation_func =
  fast_gelu`; Megatron's GeGLU fusion (`bias_geglu_impl`) runs only for `F.gelu` and
  TransformerConfig refuses `bias_activation_fusion` with any other function, so nothing
  either flag controls runs for it (and the GeGLU fusion is `--no-bias-gelu-fusion`'s);
- Nemotron-3-Super (`squared_relu`, not gated): no gated unit to fuse;
- GPT-OSS (`quick_gelu`, gated, offset 1, clamp 7): `--quick-geglu`, so the gelu flag; its fused
  function is `weighted_bias_quick_geglu_impl`.

Sites, from the facts: the dense MLP (`ffn_hidden_size` over the recipe's TP; models with dense
layers), the shared expert (`moe.shared_expert_ffn_hidden_size` over TP) and the routed experts
(`moe.expert_ffn_hidden_size` over the recipe's ETP, with the router's weights in the router's
dtype: `--moe-router-dtype`, else the recipe's precision). Tokens: the microbatch's (row tokens x
rows per microbatch, [sequence, batch]); the experts take the routed copies one EP rank holds under
balanced routing (tokens x top-k / EP, [tokens]). The smoke scale (CPU tier) keeps the FFN width
per rank and cuts the sequence to SMOKE_TOKENS positions.

Inputs (seeded, BF16 as the recipe's precision): fc1's output normal with std 1 ("unit") and
std 8 ("wide": the gate's tails, where SiLU's sigmoid saturates), the upstream gradient standard
normal; a bias [2F] (std 0.5) where the recipe's model has one (no `--disable-bias-linear`; not
on the experts, where Megatron's fused function refuses one); router weights uniform in (0, 1).

Controls: the gate and linear halves swapped, a sigmoid gate (SiLU's factor a missing), SiLU's
derivative taken as sigmoid(a) (the forward right, only the gradient wrong), and, where the case
has them, the router's weights ignored and the bias not added.
"""

from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch

from correctness import tiers
from correctness.shapes import DTYPES
from correctness.evidence import UPSTREAM, Evidence
from correctness.lever import Case, Control, Lever, LeverOptions, Mutated, NotApplicable, Tier
from correctness.lever_spec import EXPERT_LAYOUT, SHAPE_READS, LeverSpec, TierTest
from correctness.recipe_sets import GEMMA, LLAMA, MOONLIGHT, NEMOTRON
from correctness.swiglu.paths import (
    FUSED, UNFUSED, Fp64Swiglu, MegatronSwiglu, SwigluInputs, WrongGatedUnit, swapped_inputs, unbiased_inputs,
    unswapped_gradients, unweighted_inputs,
)
from correctness.models import ModelFacts, facts_for
from correctness.recipes import Recipe, lever_recipe

NAME = "bias-swiglu-fusion"
VERSION = 1
SMOKE_TOKENS = 128
VARIANTS = (("unit", 0, 1.0), ("wide", 1, 8.0))  # variant, seed, std of fc1's output
BIAS_STD = 0.5
ROUTER_DTYPES = {"fp32": "fp32", "fp64": "fp64"}
DTYPE_NAMES = {"fp32": torch.float32, "fp64": torch.float64, **DTYPES}


@dataclass(frozen=True, kw_only=True)
class SwigluShape:
    model: str
    scale: str
    site: str  # "dense", "shared-expert" or "experts"
    tokens: int  # positions (dense, shared expert) or routed token copies (experts)
    batch: int | None  # rows per microbatch; None: fc1's output is [tokens, 2F] (experts)
    ffn_per_rank: int  # F: each half of fc1's output on one rank
    model_ffn: int  # the model's FFN width at this site
    split: int  # the TP (or ETP) size dividing it
    dtype: str
    bias: bool
    probs_dtype: str | None  # the router's weights (experts)
    input_std: float

    @property
    def id(self) -> str:
        rows = f"{self.tokens}x{self.batch}" if self.batch else f"t{self.tokens}"
        bias = "-bias" if self.bias else ""
        return f"{self.model}-swiglu-{self.site}-{rows}-f{self.ffn_per_rank}-{self.dtype}{bias}-std{self.input_std:g}"

    def record(self) -> dict[str, Any]:
        return {"id": self.id, **asdict(self)}


def make_inputs(shape: SwigluShape, seed: int, device: torch.device) -> SwigluInputs:
    generator = torch.Generator().manual_seed(seed)
    rows = (shape.tokens,) if shape.batch is None else (shape.tokens, shape.batch)
    dtype = DTYPES[shape.dtype]
    x = shape.input_std * torch.randn(*rows, 2 * shape.ffn_per_rank, generator=generator)
    grad = torch.randn(*rows, shape.ffn_per_rank, generator=generator)
    bias = BIAS_STD * torch.randn(2 * shape.ffn_per_rank, generator=generator) if shape.bias else None
    probs = torch.rand(shape.tokens, 1, generator=generator) if shape.probs_dtype else None
    return SwigluInputs(
        x=x.to(dtype).to(device), grad=grad.to(dtype).to(device),
        bias=None if bias is None else bias.to(dtype).to(device),
        probs=None if probs is None else probs.to(DTYPE_NAMES[shape.probs_dtype]).to(device),
    )


def check_applies(model: ModelFacts) -> None:
    """NotApplicable unless the model's MLP is the gated SiLU that --no-bias-swiglu-fusion reaches."""
    mlp = model.data.get("mlp") or {}
    activation, gated = mlp.get("activation"), mlp.get("gated")
    if activation is None or gated is None:
        raise NotApplicable(f"the model facts of {model.name} do not say its MLP's activation (mlp.activation,"
                            f" mlp.gated): which fusion the flag reaches is unknown")
    if not gated:
        raise NotApplicable(f"{model.name}'s MLP is not gated ({activation} on one projection): there is no"
                            f" gated unit for Megatron's SwiGLU fusion, and --no-bias-swiglu-fusion does not reach it")
    if activation == "gelu_tanh":
        raise NotApplicable(
            f"{model.name}'s gated unit is GELU's tanh approximation (Megatron-Bridge's provider: fast_gelu):"
            f" Megatron's GeGLU fusion runs only for F.gelu (TransformerConfig refuses bias_activation_fusion with"
            f" fast_gelu), and is --no-bias-gelu-fusion's, not --no-bias-swiglu-fusion's")
    if activation != "silu" or mlp.get("clamp") is not None or mlp.get("glu_linear_offset"):
        raise NotApplicable(
            f"{model.name}'s gated unit is {activation} (clamp {mlp.get('clamp')}, offset"
            f" {mlp.get('glu_linear_offset', 0.0)}), not SwiGLU: Megatron-LM sets bias_activation_fusion from"
            f" --no-bias-swiglu-fusion only with --swiglu")


def _per_rank(model: ModelFacts, field: str, split: int, what: str) -> int:
    width = int(model.field(field))
    if width % split:
        raise ValueError(f"model {model.name}: {field} {width} does not split evenly over {what} {split}")
    return width // split


def _router_dtype(recipe: Recipe) -> str:
    chosen = recipe.argument("--moe-router-dtype")
    return ROUTER_DTYPES.get(chosen[0], recipe.precision) if chosen else recipe.precision


def swiglu_shapes(recipe: Recipe, model: ModelFacts, scale: str) -> list[SwigluShape]:
    """One shape per site of the model (check_applies first), at the recipe's or the smoke scale."""
    check_applies(model)
    moe = model.data.get("moe")
    kinds = {model.layer_kind(layer) for layer in range(model.layers)}
    bias = recipe.argument("--disable-bias-linear") is None
    tokens = recipe.row_tokens if scale == "recipe" else SMOKE_TOKENS
    common = dict(model=model.short_name, scale=scale, dtype=recipe.precision, input_std=0.0)
    sites = []
    if "ffn_hidden_size" in model.data and (not moe or "dense" in kinds):
        sites.append(dict(site="dense", tokens=tokens, batch=recipe.rows_per_microbatch, split=recipe.tp,
                          ffn_per_rank=_per_rank(model, "ffn_hidden_size", recipe.tp, "TP"),
                          model_ffn=int(model.field("ffn_hidden_size")), bias=bias, probs_dtype=None))
    if moe and moe.get("shared_expert_ffn_hidden_size"):
        field = "moe.shared_expert_ffn_hidden_size"
        sites.append(dict(site="shared-expert", tokens=tokens, batch=recipe.rows_per_microbatch, split=recipe.tp,
                          ffn_per_rank=_per_rank(model, field, recipe.tp, "TP"), model_ffn=int(model.field(field)),
                          bias=bias, probs_dtype=None))
    if moe:
        etp, ep = int(recipe.field("layout.etp")), int(recipe.field("layout.ep"))
        routed = max(1, tokens * recipe.rows_per_microbatch * int(model.field("moe.top_k")) // ep)
        field = "moe.expert_ffn_hidden_size"
        sites.append(dict(site="experts", tokens=routed, batch=None, split=etp,
                          ffn_per_rank=_per_rank(model, field, etp, "ETP"), model_ffn=int(model.field(field)),
                          bias=False, probs_dtype=_router_dtype(recipe)))
    if not sites:
        raise NotApplicable(f"{model.name}'s facts give no FFN width (ffn_hidden_size, moe.*_ffn_hidden_size)")
    return [SwigluShape(**{**common, **site}) for site in sites]


def _has(field: str, why: str):
    def inapplicable(case: Case) -> str | None:
        return None if getattr(case.shape, field) else why
    return inapplicable


def describe() -> str:
    return ("bias-SwiGLU fusion: Megatron's fused bias_swiglu_impl (torch.compile) against the unfused SwiGLU and FP64,"
            " activation output and gradients, at the FFN width per TP rank")


# Peak bytes per element of the case's largest tensors, all paths together: the FP32 draws, the
# inputs in their dtype, each path's outputs and gradients, and the FP64 reference's copies of
# them (an estimate from what the paths allocate, not measured; correctness.memory).
ELEMENT_BYTES = 48


def swiglu_memory(shape: SwigluShape) -> dict[str, Any]:
    """A case's estimated peak bytes (Case.memory_bytes, memory_driver): fc1's output (both halves) of
    every token, with its gradient and the activation's output."""
    tokens = shape.tokens * (shape.batch or 1)
    return {"memory_bytes": ELEMENT_BYTES * tokens * 2 * shape.ffn_per_rank,
            "memory_driver": f"tokens {tokens} x 2 x ffn {shape.ffn_per_rank}"}


def swiglu_lever(recipe: Recipe, *, tier: Tier, scale: str, options: LeverOptions) -> Lever:
    model = facts_for(recipe, options.model)
    cases = []
    for shape in swiglu_shapes(recipe, model, scale):
        for variant, seed, std in VARIANTS:
            sized = SwigluShape(**{**asdict(shape), "input_std": std})
            cases.append(Case(id=f"{sized.id}-seed{seed}", shape=sized, seed=seed, source="synthetic", variant=variant,
                              make_inputs=partial(make_inputs, sized, seed), **swiglu_memory(sized)))
    candidate = MegatronSwiglu(FUSED, fused=True)
    controls = (
        Control(name="gate and linear halves swapped", implementation=Mutated(
            base=candidate, mutation="gate and linear halves swapped", mutate=swapped_inputs,
            change_outputs=unswapped_gradients)),
        Control(name="sigmoid gate (SiLU's factor missing)",
                implementation=WrongGatedUnit("sigmoid-gate", "sigmoid gate")),
        Control(name="SiLU's derivative taken as sigmoid",
                implementation=WrongGatedUnit("sigmoid-derivative", "sigmoid derivative")),
        Control(name="router weights ignored", implementation=Mutated(base=candidate, mutation="router weights ignored",
                                                            mutate=unweighted_inputs),
                why_inapplicable=_has("probs_dtype", "no router weights at this site")),
        Control(name="bias not added",
                implementation=Mutated(base=candidate, mutation="bias not added", mutate=unbiased_inputs),
                why_inapplicable=_has("bias", "no bias (--disable-bias-linear)")),
    )
    return Lever(
        name=NAME, version=VERSION, tier=tier, description=describe(), recipe=recipe.ref_for(model),
        cases=tuple(cases), candidate=candidate, default=MegatronSwiglu(UNFUSED, fused=False), reference=Fp64Swiglu(),
        controls=controls,
    )


def cpu_tier(recipe_id: str, options: LeverOptions) -> list[Lever]:
    """Megatron's fused SwiGLU compiled by torch.compile's CPU backend (or eager under
    TORCH_COMPILE_DISABLE=1, as the record says), at the smoke scale (the recipe's with --scale recipe)."""
    recipe = lever_recipe(recipe_id, options.recipe)
    return [swiglu_lever(recipe, tier=tiers.MEGATRON_CPU, scale=options.at_scale("smoke", "recipe"), options=options)]


def megatron_gpu_tier(recipe_id: str, options: LeverOptions) -> list[Lever]:
    """Megatron's fused SwiGLU on a CUDA GPU (its jit_fuser compiles Triton kernels), recipe scale."""
    recipe = lever_recipe(recipe_id, options.recipe)
    return [swiglu_lever(recipe, tier=tiers.MEGATRON_GPU, scale=options.gpu_at_scale("smoke", "recipe"), options=options)]

SPEC = LeverSpec(
    name=NAME, version=VERSION,
    description="Megatron's fused bias-SwiGLU (bias_swiglu_impl; weighted_bias_swiglu_impl in routed experts;"
                " torch.compile) against the unfused SwiGLU and FP64, activation output and gradients at the FFN width"
                " per TP rank",
    titles=("bias-swiglu fusion",),
    tests=(
        TierTest(test="test_bias_swiglu_fusion_on_cpu", tier="megatron-cpu", factory=cpu_tier,
                 recipes=(GEMMA, NEMOTRON, LLAMA),
                 doc="Megatron's fused SwiGLU compiled for the CPU against its unfused SwiGLU."),
        TierTest(test="test_bias_swiglu_fusion_on_gpu", tier="megatron", factory=megatron_gpu_tier,
                 recipes=(GEMMA, NEMOTRON, LLAMA, MOONLIGHT)),
    ),
    reads=(*SHAPE_READS, *EXPERT_LAYOUT, "--disable-bias-linear", "--moe-router-dtype"),
    evidence=Evidence(klass=UPSTREAM, tier="megatron-cpu",
                      what="Megatron's bias_swiglu_impl compiled by inductor's CPU backend against its unfused SwiGLU,"
                           " in its own MLP.forward"))
