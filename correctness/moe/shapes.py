"""An MoE layer's routed part at a recipe's shape: the experts one EP rank holds, their widths,
the activation, top-k and the tokens a GPU routes; the smoke scale the CPU tiers run.

Recipe scale: each GPU routes its share of the microbatch (row tokens x rows per microbatch over
TP: sequence parallelism splits the tokens before the MoE layer) to top-k of all experts; one EP
rank holds experts / EP of them and receives, from the EP ranks, tokens x EP x top-k / experts rows
per expert on average. The experts' input width is the model's latent size where it has one
(Nemotron-3-Super projects 4,096 down to 1,024 before dispatch, megatron-core moe_layer.py), else
its hidden size. Smoke scale (CPU): SMOKE_LOCAL_EXPERTS of the rank's experts and enough tokens for
about SMOKE_ROWS_PER_EXPERT rows each (widths unchanged); the permutation smoke routes
SMOKE_PERMUTE_TOKENS tokens over all experts.
"""

from dataclasses import asdict, dataclass
from typing import Any

import torch

from correctness.errors import RecipeError
from correctness.lever import NotApplicable
from correctness.models import ModelFacts
from correctness.recipes import Recipe

SMOKE_LOCAL_EXPERTS = 4
SMOKE_ROWS_PER_EXPERT = 16
SMOKE_PERMUTE_TOKENS = 128
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# The experts' activation per architecture family (megatron-core's, as each family's Bridge provider
# sets it): Nemotron-H squared ReLU without a gate (NemotronHModelProvider activation_func
# squared_relu); Qwen3-MoE and DeepSeek-V3 SwiGLU (gated_linear_unit, silu).
ACTIVATIONS = {"nemotron_h": "squared_relu", "qwen3_moe": "swiglu", "deepseek_v3": "swiglu"}


def model_family(model: ModelFacts) -> str | None:
    """The family of the model facts; the suite's Nemotron-3-Super facts file names none, and is
    the only one with Mamba layers and experts (nemotron_h)."""
    family = model.data.get("family")
    if family is None and "mamba" in model.data and "moe" in model.data:
        return "nemotron_h"
    return family


@dataclass(frozen=True, kw_only=True)
class MoeShape:
    model: str
    scale: str
    experts: int  # routed experts of the model (all EP ranks)
    ep: int
    recipe_local_experts: int  # experts / EP: what one EP rank holds in the recipe
    local_experts: int  # experts this case's rank holds (smoke: fewer)
    top_k: int
    expert_input: int  # latent size where the model has one, else hidden size
    ffn: int  # one expert's FFN width
    activation: str
    gated: bool
    tokens_per_gpu: int  # the recipe's tokens one GPU routes (microbatch tokens / TP)
    tokens: int  # tokens this case routes over all experts
    dtype: str
    probs_dtype: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def torch_probs_dtype(self) -> torch.dtype:
        return DTYPES[self.probs_dtype]

    @property
    def fc1_width(self) -> int:
        return 2 * self.ffn if self.gated else self.ffn

    @property
    def id(self) -> str:
        return (f"{self.model}-moe-e{self.local_experts}of{self.experts}-top{self.top_k}-d{self.expert_input}"
                f"-f{self.ffn}-{self.activation}-t{self.tokens}-{self.dtype}")

    def record(self) -> dict[str, Any]:
        return {"id": self.id, **asdict(self)}


def moe_shape(recipe: Recipe, model: ModelFacts, scale: str, purpose: str) -> MoeShape:
    """The shape of `purpose` ("experts": one EP rank's experts; "permute": a GPU's tokens over all
    experts) at `scale` ("recipe" or "smoke"). NotApplicable for a model without routed experts."""
    moe = model.data.get("moe")
    if not moe:
        raise NotApplicable(f"{model.name} has no routed experts (a dense model): no MoE layer to test")
    family = model_family(model)
    if family not in ACTIVATIONS:
        raise NotApplicable(f"{model.name} (family {family}): its experts' activation is not modelled"
                            f" (known: {', '.join(sorted(ACTIVATIONS))})")
    experts, top_k = int(moe["experts"]), int(moe["top_k"])
    ep = recipe.positive_int("layout.ep")
    if experts % ep:
        raise RecipeError(f"recipe {recipe.id}: EP {ep} does not divide the {experts} experts")
    tokens_per_gpu = recipe.row_tokens * recipe.rows_per_microbatch // recipe.tp
    router_dtype = recipe.argument("--moe-router-dtype")
    probs_dtype = "fp32" if router_dtype in (None, ["fp32"]) else router_dtype[0]  # Bridge's providers: fp32
    if probs_dtype not in DTYPES:
        raise RecipeError(f"recipe {recipe.id}: --moe-router-dtype {probs_dtype!r} is not one of {sorted(DTYPES)}")
    local = experts // ep
    if purpose == "experts":
        local_experts = local if scale == "recipe" else min(local, SMOKE_LOCAL_EXPERTS)
        tokens = tokens_per_gpu * ep if scale == "recipe" else -(-SMOKE_ROWS_PER_EXPERT * experts // top_k)
    elif purpose == "permute":
        local_experts = local
        tokens = tokens_per_gpu if scale == "recipe" else SMOKE_PERMUTE_TOKENS
    else:
        raise ValueError(f"purpose {purpose!r}: expected 'experts' or 'permute'")
    activation = ACTIVATIONS[family]
    return MoeShape(
        model=model.short_name, scale=scale, experts=experts, ep=ep, recipe_local_experts=local,
        local_experts=local_experts, top_k=top_k, expert_input=int(moe.get("latent_size") or model.field("hidden_size")),
        ffn=int(moe["expert_ffn_hidden_size"]), activation=activation, gated=activation == "swiglu",
        tokens_per_gpu=tokens_per_gpu, tokens=tokens, dtype=recipe.precision, probs_dtype=probs_dtype,
    )
