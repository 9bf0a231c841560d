"""Model facts from a Hugging Face config.json and the architecture family table.

`facts_from_config(path)` reads a model's config.json (or a folder holding one) and returns its
model facts, the same data fixtures/models/<name>.yaml holds (correctness.models.ModelFacts reads
both): the config's own fields give layers, sizes, heads, key-value heads, head dims, layer kinds,
windows, softcaps, scales, RoPE, experts, the MLP's activation and Mamba sizes; the family of the
config's `architectures[0]` in correctness/families.yaml gives what the config cannot say (Megatron's
parameter names and fused layouts, fixed scales, norms, sinks). A field missing or contradicting
another, a layer type or architecture the table does not know: ModelFactsError, one line naming the
field, never a guess.

The model's name is the folder holding the config.json (fixtures/configs/Llama-3.1-8B/config.json:
"Llama-3.1-8B"), which a recipe's `model:` must match as `same_model` compares names: without
regard to case, with `_`, `-` and `.` alike (a folder `llama_3.1_8b` holds Llama-3.1-8B's config).
"""

import copy
import hashlib
import json
import math
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from correctness.errors import RecipeError
from correctness.files import read_input

FAMILIES_FILE = Path(__file__).resolve().parent / "families.yaml"
CONFIG_LIMIT = 4 * 1024 * 1024  # bytes; a config.json is a few KB
HF_FULL, HF_SLIDING = "full_attention", "sliding_attention"


class ModelFactsError(RecipeError):
    """A config the facts cannot be made from (exit status 2, like any bad input)."""


@dataclass(frozen=True)
class ConfigFile:
    path: Path  # the config.json
    name: str  # the model's name: its folder's
    data: dict[str, Any]
    sha256: str


def config_file(path: str | Path) -> Path:
    path = Path(path)
    return path / "config.json" if path.is_dir() else path


def read_config(path: str | Path) -> ConfigFile:
    path = config_file(path)
    label = f"model config {path}"
    raw = read_input(path, label, ModelFactsError, limit=CONFIG_LIMIT, kind="a config.json")
    try:
        data = json.loads(raw.decode("utf-8-sig"))
    except UnicodeDecodeError:
        raise ModelFactsError(f"{label}: not UTF-8 text") from None
    except json.JSONDecodeError as error:
        raise ModelFactsError(f"{label}: malformed JSON at line {error.lineno}") from None
    if not isinstance(data, dict):
        raise ModelFactsError(f"{label}: expected a JSON object at the top level")
    name = path.resolve().parent.name
    return ConfigFile(path=path, name=name, data=data, sha256=hashlib.sha256(raw).hexdigest())


def name_key(name: str) -> str:
    """A model's or GPU's name as the suite compares it: lower case, with `_`, `-` and `.` alike (all
    `-`), so that Qwen3_32B, qwen3.32b and QWEN3-32B all name Qwen3-32B."""
    return re.sub(r"[-_.]", "-", name.lower())


def same_model(name: str, other: str) -> bool:
    """Whether two model names are one model's, as users write it (name_key)."""
    return name_key(name) == name_key(other)


def short_name(name: str) -> str:
    """For case ids: lower case, a word joined to the version number after it ("Gemma-4-31B" ->
    "gemma4-31b", "Llama-3.1-8B" -> "llama3.1-8b"; a size such as 120b stays apart). Any of `_`, `-`
    and `.` is joined over, so that names same_model matches give short names it matches too (the
    attention capture's model is checked so)."""
    return re.sub(r"([a-z])[-_.](\d+(?:\.\d+)*)(?=[-_.]|$)", r"\1\2", name.lower())


@cache
def families() -> dict[str, dict[str, Any]]:
    """The family table, read once (every lever built from a config looks its family up)."""
    data = yaml.safe_load(FAMILIES_FILE.read_text())
    return data["families"]


def family_of(architecture: str) -> tuple[str, dict[str, Any]]:
    for name, family in families().items():
        if architecture in family.get("architectures", ()):
            return name, family
    raise KeyError(architecture)


class _Config:
    """The text model's fields of a config, read with one-line errors naming the field."""

    def __init__(self, config: ConfigFile, fields: dict[str, Any]):
        self.config, self.fields = config, fields

    def error(self, message: str) -> ModelFactsError:
        return ModelFactsError(f"model config {self.config.path}: {message}")

    def has(self, key: str) -> bool:
        return self.fields.get(key) is not None

    def get(self, key: str, default: Any = None) -> Any:
        value = self.fields.get(key)
        return default if value is None else value

    def count(self, key: str, *, needed_for: str, minimum: int = 1, default: int | None = None) -> int:
        value = self.fields.get(key)
        if value is None and default is not None:
            return default
        if value is None:
            raise self.error(f"missing field {key} (needed for {needed_for})")
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise self.error(f"field {key} must be an integer of at least {minimum}, got {value!r}")
        return value

    def first_count(self, keys: tuple[str, ...], *, needed_for: str) -> int:
        for key in keys:
            if self.has(key):
                return self.count(key, needed_for=needed_for)
        raise self.error(f"missing field {' or '.join(keys)} (needed for {needed_for})")

    def number(self, key: str, default: float | None = None) -> float | None:
        value = self.fields.get(key)
        if value is None:
            return default
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
            raise self.error(f"field {key} must be a positive number, got {value!r}")
        return value

    def flag(self, key: str, default: bool) -> bool:
        value = self.fields.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(f"field {key} must be true or false, got {value!r}")
        return value


def _layer_types(cfg: _Config, layers: int) -> list[str]:
    """The config's layer type of every layer (HF names: sliding_attention, full_attention, or the
    hybrid pattern's symbols)."""
    if cfg.has("hybrid_override_pattern"):
        pattern = cfg.get("hybrid_override_pattern")
        if not isinstance(pattern, str) or len(pattern) != layers:
            raise cfg.error(f"field hybrid_override_pattern must hold one symbol per layer ({layers}), got {pattern!r}")
        return list(pattern)
    if cfg.has("layer_types"):
        types = cfg.get("layer_types")
        if not isinstance(types, list) or len(types) != layers or not all(isinstance(t, str) for t in types):
            raise cfg.error(f"field layer_types must list a layer type per layer ({layers})")
        return types
    if cfg.has("sliding_window_pattern") and cfg.has("sliding_window"):  # Gemma 2/3: every n-th layer global
        every = cfg.count("sliding_window_pattern", needed_for="the layer pattern")
        return [HF_FULL if (layer + 1) % every == 0 else HF_SLIDING for layer in range(layers)]
    if cfg.flag("use_sliding_window", False):
        raise cfg.error("field use_sliding_window is true without layer_types: which layers slide is not said")
    return [HF_FULL] * layers


def _layer_pattern(kinds: list[str]) -> dict[str, Any]:
    """The shortest repeat of the layer kinds, as fixtures/models write it."""
    for period in range(1, len(kinds) + 1):
        if len(kinds) % period == 0 and kinds == kinds[:period] * (len(kinds) // period):
            return {"repeat": kinds[:period]}
    raise AssertionError("unreachable: the whole list repeats itself")


def _rope(cfg: _Config, layer_type: str) -> tuple[float | None, float]:
    """(rope_theta, partial_rotary_factor) of a layer type: per-type `rope_parameters` (Gemma 4),
    flat `rope_parameters`, or the top-level fields; Gemma 3's local layers: rope_local_base_freq."""
    parameters = cfg.get("rope_parameters") or {}
    if not isinstance(parameters, dict):
        raise cfg.error("field rope_parameters must be a mapping")
    if isinstance(parameters.get(layer_type), dict):
        parameters = parameters[layer_type]
    theta = parameters.get("rope_theta")
    if theta is None:
        theta = cfg.get("rope_local_base_freq") if layer_type == HF_SLIDING and cfg.has("rope_local_base_freq") else cfg.get("rope_theta")
    factor = parameters.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    return (None if theta is None else float(theta)), float(factor)


def _attention_kind(cfg: _Config, layer_type: str, heads: int, hidden: int) -> dict[str, Any]:
    full = layer_type != HF_SLIDING
    k_eq_v = full and cfg.flag("attention_k_eq_v", False)  # Gemma 4's global layers: K and V share k_proj
    kv_field = "num_global_key_value_heads" if k_eq_v and cfg.has("num_global_key_value_heads") else "num_key_value_heads"
    kv_heads = cfg.count(kv_field, needed_for="key-value heads", default=heads)
    if heads % kv_heads:
        raise cfg.error(f"num_attention_heads {heads} is not a multiple of {kv_field} {kv_heads}")
    facts: dict[str, Any] = {"kv_heads": kv_heads}
    theta, factor = _rope(cfg, layer_type)
    if cfg.has("kv_lora_rank"):  # MLA: q/k heads of nope + rope dims, V heads of their own size
        nope = cfg.count("qk_nope_head_dim", needed_for="MLA's query/key head dim")
        rope = cfg.count("qk_rope_head_dim", needed_for="MLA's query/key head dim")
        facts["head_dim"] = nope + rope
        value = cfg.count("v_head_dim", needed_for="MLA's value head dim")
        if value != nope + rope:
            facts["v_head_dim"] = value
        factor = rope / (nope + rope)
    elif full and cfg.has("global_head_dim"):
        facts["head_dim"] = cfg.count("global_head_dim", needed_for="the global layers' head dim")
    elif cfg.has("head_dim"):
        facts["head_dim"] = cfg.count("head_dim", needed_for="the head dim")
    else:
        if hidden % heads:
            raise cfg.error(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads}, and no head_dim")
        facts["head_dim"] = hidden // heads
    facts["window"] = None if full else cfg.count("sliding_window", needed_for="the sliding layers' window")
    facts["rope_theta"] = theta
    facts["partial_rotary_factor"] = factor
    if k_eq_v:
        facts["k_eq_v"] = True
    return facts


def _softmax_scale(cfg: _Config, head_dim: int) -> float | str:
    """query_pre_attn_scalar ** -0.5 (Gemma 2/3); MLA with YaRN: 1/sqrt(d) times mscale^2 as
    DeepSeek-V3 computes it; otherwise 1/sqrt(head_dim), by name."""
    if cfg.has("query_pre_attn_scalar"):
        return float(cfg.number("query_pre_attn_scalar")) ** -0.5
    scaling = cfg.get("rope_scaling") or {}
    if cfg.has("kv_lora_rank") and isinstance(scaling, dict) and scaling.get("mscale_all_dim"):
        factor, all_dim = float(scaling["factor"]), float(scaling["mscale_all_dim"])
        mscale = 0.1 * all_dim * math.log(factor) + 1.0 if factor > 1 else 1.0
        return mscale * mscale / math.sqrt(head_dim)
    return "inverse_sqrt_head_dim"


def _moe(cfg: _Config) -> dict[str, Any] | None:
    key = next((k for k in ("n_routed_experts", "num_experts", "num_local_experts") if cfg.has(k)), None)
    if key is None or cfg.get(key) == 0:
        return None
    experts = cfg.count(key, needed_for="the experts")
    top_k = cfg.first_count(("num_experts_per_tok", "experts_per_token"), needed_for="the experts chosen per token")
    if top_k > experts:
        raise cfg.error(f"num_experts_per_tok {top_k} is more than the {experts} experts")
    size_key = "moe_intermediate_size" if cfg.has("moe_intermediate_size") else "intermediate_size"
    moe: dict[str, Any] = {"experts": experts, "top_k": top_k,
                           "expert_ffn_hidden_size": cfg.count(size_key, needed_for="the experts' FFN size")}
    if cfg.has("moe_latent_size"):
        moe["latent_size"] = cfg.count("moe_latent_size", needed_for="the MoE latent size")
    if cfg.has("moe_shared_expert_intermediate_size"):
        moe["shared_expert_ffn_hidden_size"] = cfg.count("moe_shared_expert_intermediate_size", needed_for="the shared expert")
    elif cfg.get("n_shared_experts", 0):
        moe["shared_expert_ffn_hidden_size"] = cfg.count("n_shared_experts", needed_for="the shared experts") * moe["expert_ffn_hidden_size"]
    if cfg.has("scoring_func"):
        moe["routing"] = cfg.get("scoring_func")
    if cfg.has("routed_scaling_factor"):
        moe["routing_scaling_factor"] = float(cfg.number("routed_scaling_factor"))
    return moe


# Hugging Face's activation names (transformers' ACT2FN keys) -> the facts' names of the function
# applied to an MLP's (gate) projection.
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
               "gelu_fast": "gelu_tanh", "gelu": "gelu", "relu2": "squared_relu", "relu": "relu"}
ACTIVATION_FIELDS = ("hidden_act", "hidden_activation", "mlp_hidden_act")


def _mlp(cfg: _Config) -> dict[str, Any]:
    """The MLP's activation (`activation`: the function on the gate half, or on the one projection of
    an ungated MLP) and, where the config clamps it (GPT-OSS's swiglu_limit), `clamp`; whether it is
    gated comes from the family. A config naming no activation leaves it out (no default is guessed)."""
    mlp: dict[str, Any] = {}
    field = next((key for key in ACTIVATION_FIELDS if cfg.has(key)), None)
    if field is not None:
        name = cfg.get(field)
        if name not in ACTIVATIONS:
            raise cfg.error(f"field {field} names the activation {name!r}, not one the facts know"
                            f" ({', '.join(sorted(ACTIVATIONS))})")
        mlp["activation"] = ACTIVATIONS[name]
    if cfg.has("swiglu_limit"):
        mlp["clamp"] = float(cfg.number("swiglu_limit"))
    return mlp


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` laid over `base`, mapping by mapping."""
    merged = dict(base)
    for key, value in over.items():
        merged[key] = _merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
    return merged


def facts_from_config(path: str | Path) -> dict[str, Any]:
    """The model facts of a config.json (see the module's docstring)."""
    config = read_config(path)
    top = config.data
    architectures = top.get("architectures")
    if not isinstance(architectures, list) or not architectures or not isinstance(architectures[0], str):
        raise ModelFactsError(f"model config {config.path}: missing field architectures (the model class, e.g."
                              " LlamaForCausalLM), which names its family")
    try:
        family_name, family = family_of(architectures[0])
    except KeyError:
        known = sorted(a for f in families().values() for a in f.get("architectures", ()))
        raise ModelFactsError(
            f"model config {config.path}: architecture {architectures[0]} has no family in {FAMILIES_FILE.name}"
            f" (known: {', '.join(known)}); add one (docs/model-facts.md, \"A new architecture family\")") from None
    fields = top.get("text_config") if family.get("text_config") else top
    if not isinstance(fields, dict):
        raise ModelFactsError(f"model config {config.path}: missing field text_config (a {family_name} model's text model)")
    cfg = _Config(config, fields)

    layers = cfg.count("num_hidden_layers", needed_for="layers")
    hidden = cfg.count("hidden_size", needed_for="hidden_size")
    heads = cfg.count("num_attention_heads", needed_for="attention.query_heads")
    names = family.get("layer_kinds") or {}
    types = _layer_types(cfg, layers)
    unknown = sorted({t for t in types if t not in names})
    if unknown:
        raise cfg.error(f"layer type {unknown[0]!r} is not one the {family_name} family knows ({', '.join(names)});"
                        f" add it to layer_kinds in {FAMILIES_FILE.name}")
    kinds = [names[t] for t in types]
    attention_types = {names[t]: t for t in types if t in (HF_FULL, HF_SLIDING) or names[t] == "attention"}
    attention_kinds = {
        kind: _attention_kind(cfg, HF_FULL if hf_type not in (HF_FULL, HF_SLIDING) else hf_type, heads, hidden)
        for kind, hf_type in attention_types.items()
    }
    if not attention_kinds:
        raise cfg.error("no layer has attention")
    first_head_dim = next(iter(attention_kinds.values()))["head_dim"]

    facts: dict[str, Any] = {
        "name": config.name,
        "short_name": short_name(config.name),
        "source": str(config.path),
        "config_sha256": config.sha256,
        "family": family_name,
        "layers": layers,
        "hidden_size": hidden,
    }
    if "ffn_gated" in family.get("facts", {}):
        facts["ffn_hidden_size"] = cfg.count("intermediate_size", needed_for="ffn_hidden_size")
    facts["vocab_size"] = cfg.count("vocab_size", needed_for="vocab_size")
    facts["mlp"] = _mlp(cfg)
    tied = fields.get("tie_word_embeddings", top.get("tie_word_embeddings", True))  # transformers' default
    facts["tied_embeddings"] = bool(tied)
    moe = _moe(cfg)
    if moe is None:
        facts["experts"] = 0
    dense_key = family.get("dense_layers")
    if dense_key is not None and moe is not None:  # DeepSeek: the first k layers dense, then MoE
        dense = cfg.count(dense_key, needed_for="the dense layers before the MoE ones", minimum=0)
        if dense > layers:
            raise cfg.error(f"{dense_key} {dense} is more than the {layers} layers")
        attention_kind = kinds[0]
        facts["layer_pattern"] = {"symbols": "D" * dense + "E" * (layers - dense), "kinds": {"D": "dense", "E": "moe"}}
        kind_of_layer = {"dense": attention_kind, "moe": attention_kind}
    elif cfg.has("hybrid_override_pattern"):
        facts["layer_pattern"] = {"symbols": "".join(types), "kinds": {symbol: names[symbol] for symbol in dict.fromkeys(types)}}
        kind_of_layer = None
    else:
        if moe is not None and (cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1):
            raise cfg.error("fields mlp_only_layers / decoder_sparse_step make some layers dense: a mix of dense and"
                            " MoE layers is not modelled for this family")
        facts["layer_pattern"] = _layer_pattern(kinds)
        kind_of_layer = None
    if cfg.has("num_nextn_predict_layers"):
        facts["mtp_blocks"] = cfg.count("num_nextn_predict_layers", needed_for="mtp_blocks", minimum=0)

    attention: dict[str, Any] = {
        "query_heads": heads,
        "softmax_scale": _softmax_scale(cfg, first_head_dim),
        "qk_norm": False,
        "v_norm": False,
        "logit_softcap": cfg.number("attn_logit_softcapping"),
        "kinds": attention_kinds,
    }
    if kind_of_layer:
        attention["kind_of_layer"] = kind_of_layer
    if cfg.has("kv_lora_rank"):
        attention["mla"] = {key: cfg.get(key) for key in
                            ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
    facts["attention"] = attention
    if cfg.has("final_logit_softcapping"):
        facts["final_logit_softcap"] = float(cfg.number("final_logit_softcapping"))
    if moe is not None:
        facts["moe"] = moe
    if cfg.has("mamba_num_heads"):
        facts["mamba"] = {
            "heads": cfg.count("mamba_num_heads", needed_for="mamba.heads"),
            "head_dim": cfg.count("mamba_head_dim", needed_for="mamba.head_dim"),
            "state_size": cfg.count("ssm_state_size", needed_for="mamba.state_size"),
            "groups": cfg.count("n_groups", needed_for="mamba.groups"),
            "conv_kernel": cfg.count("conv_kernel", needed_for="mamba.conv_kernel"),
        }
    facts = _merge(facts, copy.deepcopy(family.get("facts", {})))
    if facts.get("moe") is not None and "routing" not in facts["moe"]:
        raise cfg.error(f"the {family_name} family does not say how its router scores experts (facts.moe.routing)")
    for section in ("megatron", "checkpoint", "synthetic"):
        if section in family:
            facts[section] = copy.deepcopy(family[section])
    return facts


def facts_text(facts: dict[str, Any]) -> str:
    """The facts as a YAML file, with a header naming where they came from."""
    header = (
        f"# Model facts for {facts['name']}, generated by `correctness model-facts` from {facts['source']}\n"
        f"# (sha256 {facts['config_sha256']}) and the {facts['family']} family of correctness/families.yaml.\n"
    )
    return header + yaml.safe_dump(facts, sort_keys=False, width=100)
