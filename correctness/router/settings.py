"""The router's settings of a recipe: what Megatron's TopKRouter is built with, each with where it
was read.

Order of sources, per setting: the recipe's own train.py arguments (`--moe-router-dtype`,
`--moe-router-score-function`, `--moe-router-enable-expert-bias`, `--moe-router-topk-scaling-factor`,
`--moe-router-num-groups`, `--moe-router-group-topk`, `--moe-router-pre-softmax`, `--num-experts`,
`--moe-router-topk`); then, where the recipe hides its model arguments (an array expansion such as
`"${MODEL_ARGS[@]}"`) and builds the model with Megatron-Bridge (`--megatron-to-hf-mode bridge`),
the settings of the Bridge provider of the model's architecture (PROVIDERS: in bridge mode miles
takes the model's settings from the provider and copies from the arguments only training knobs,
`_apply_bridge_runtime_config`, none of them the router's); then the model facts (experts, top-k,
`moe.routing`, `moe.routing_scaling_factor`; a router bias where the facts' Megatron layout has
`mlp.router.bias`); then Megatron's defaults (TransformerConfig, megatron-core 0.16.1).
"""

import json
from dataclasses import asdict, dataclass
from typing import Any

from correctness.lever import NotApplicable
from correctness.models import ModelFacts, fixture_config
from correctness.recipes import ARRAY_EXPANSION, Recipe

ROUTER_DTYPES = (None, "fp32", "fp64")  # Megatron's moe_router_dtype: None keeps the input's dtype (BF16)

# Megatron-Bridge's providers, by the Hugging Face architecture they build (read at
# NVIDIA-NeMo/Megatron-Bridge src/megatron/bridge/models/nemotronh/nemotron_h_provider.py:
# NemotronHModelProvider moe_router_dtype "fp32", moe_router_enable_expert_bias True;
# Nemotron3SuperProvider moe_router_num_groups 1, moe_router_group_topk 1,
# moe_router_topk_scaling_factor 5.0, moe_router_topk 22, num_moe_experts 512). The recipe's
# Bridge commit 7f0fb345 itself was not available to check.
PROVIDERS: dict[str, dict[str, Any]] = {
    "NemotronHForCausalLM": {
        "source": "Megatron-Bridge NemotronHModelProvider / Nemotron3SuperProvider",
        "router_dtype": "fp32",
        "expert_bias": True,
        "num_groups": 1,
        "group_topk": 1,
    },
}


@dataclass(frozen=True, kw_only=True)
class RouterSettings:
    experts: int
    top_k: int
    score_function: str  # "sigmoid" or "softmax"
    scaling_factor: float | None
    expert_bias: bool  # moe_router_enable_expert_bias: a per-expert bias added to the scores for the choice
    router_bias: bool  # the gating linear's own bias (add_bias_linear): GPT-OSS
    pre_softmax: bool
    num_groups: int | None
    group_topk: int | None
    router_dtype: str | None  # the recipe's moe_router_dtype
    sources: dict[str, str]

    def record(self) -> dict[str, Any]:
        return asdict(self)


def _architecture(model: ModelFacts) -> str | None:
    config = model.source if model.source.endswith(".json") else fixture_config(model.name)
    try:
        architectures = json.loads(open(config).read()).get("architectures") if config else None
    except (OSError, ValueError):
        return None
    return architectures[0] if architectures else None


def _hides_model_arguments(recipe: Recipe) -> bool:
    run = recipe.field("run")
    return isinstance(run, str) and ARRAY_EXPANSION.search(run) is not None


def _number(recipe: Recipe, flag: str, convert):
    value = recipe.argument(flag)
    if value is None:
        return None
    if len(value) != 1:
        raise NotApplicable(f"recipe {recipe.id}: {flag} takes one value, got {value!r}")
    try:
        return convert(value[0])
    except ValueError:
        raise NotApplicable(f"recipe {recipe.id}: {flag} {value[0]!r} is not a number") from None


def router_settings(recipe: Recipe, model: ModelFacts) -> RouterSettings:
    """The recipe's router, or NotApplicable where the model has no experts."""
    moe = model.data.get("moe")
    if not moe or not moe.get("experts"):
        raise NotApplicable(f"model {model.name} has no experts (dense): there is no router to route with")
    sources: dict[str, str] = {}
    provider = None
    if _hides_model_arguments(recipe) and recipe.argument("--megatron-to-hf-mode") == ["bridge"]:
        provider = PROVIDERS.get(_architecture(model) or "")

    def pick(name: str, flag: str, read, facts_value=None, default=None):
        value = read(flag) if flag else None
        if value is not None:
            sources[name] = f"recipe {flag}"
            return value
        if provider is not None and name in provider:
            sources[name] = provider["source"]
            return provider[name]
        if facts_value is not None:
            sources[name] = "model facts"
            return facts_value
        sources[name] = "Megatron default"
        return default

    def word(flag):
        value = recipe.argument(flag)
        return value[0] if value else None

    def switch(flag):
        return True if recipe.argument(flag) is not None else None

    experts = pick("experts", "--num-experts", lambda f: _number(recipe, f, int), int(moe["experts"]))
    top_k = pick("top_k", "--moe-router-topk", lambda f: _number(recipe, f, int), int(moe["top_k"]))
    for name, value in (("experts", experts), ("top_k", top_k)):
        if name in sources and sources[name].startswith("recipe") and value != int(moe[name]):
            raise NotApplicable(f"recipe {recipe.id}: {name} {value} is not the model's {moe[name]}")
    score_function = pick("score_function", "--moe-router-score-function", word, moe.get("routing"), "softmax")
    if score_function not in ("sigmoid", "softmax"):
        raise NotApplicable(f"recipe {recipe.id}: router score function {score_function!r} is not sigmoid or softmax")
    scaling = moe.get("routing_scaling_factor")
    scaling_factor = pick("scaling_factor", "--moe-router-topk-scaling-factor", lambda f: _number(recipe, f, float),
                          None if scaling is None else float(scaling))
    expert_bias = bool(pick("expert_bias", "--moe-router-enable-expert-bias", switch, default=False))
    router_dtype = pick("router_dtype", "--moe-router-dtype", word)
    if router_dtype not in ROUTER_DTYPES:
        raise NotApplicable(f"recipe {recipe.id}: --moe-router-dtype {router_dtype!r} is not fp32 or fp64")
    layout = model.data.get("megatron", {}).get("layer_tensors", [])
    tensors = [t for kind in layout.values() for t in kind] if isinstance(layout, dict) else list(layout)
    router_bias = any(isinstance(t, dict) and t.get("name") == "mlp.router.bias" for t in tensors)
    sources["router_bias"] = "model facts (Megatron layout)"
    return RouterSettings(
        experts=experts, top_k=top_k, score_function=score_function, scaling_factor=scaling_factor,
        expert_bias=expert_bias, router_bias=router_bias,
        pre_softmax=bool(pick("pre_softmax", "--moe-router-pre-softmax", switch, default=False)),
        num_groups=pick("num_groups", "--moe-router-num-groups", lambda f: _number(recipe, f, int)),
        group_topk=pick("group_topk", "--moe-router-group-topk", lambda f: _number(recipe, f, int)),
        router_dtype=router_dtype, sources=sources,
    )
