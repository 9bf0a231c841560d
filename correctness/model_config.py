"""Model facts from a Hugging Face config.json and the architecture family table.

`facts_from_config(path)` reads a model's config.json (or a folder holding one) and returns its
model facts, the same data fixtures/models/<name>.yaml holds (correctness.models.ModelFacts reads
both): the config's own fields give layers, sizes, heads, key-value heads, head dims, layer kinds,
windows, softcaps, scales, RoPE, experts, the MLP's activation and Mamba sizes; the family of the
config's `architectures[0]` in correctness/families.yaml gives what the config cannot say (Megatron's
parameter names and fused layouts, fixed scales, norms, sinks). A field missing or contradicting
another, a layer type or architecture the table does not know: ModelFactsError, one line naming the
field, never a guess. No field is dropped silently: the facts' `config_fields` section lists each
field of the text model as used or ignored with the reason (families.yaml's `config_fields` table);
a field unknown to the table whose name looks numerics-shaping is refused.

The model's name is the folder holding the config.json (fixtures/configs/Llama-3.1-8B/config.json:
"Llama-3.1-8B"), which a recipe's `model:` must match as `same_model` compares names: without
regard to case, with `_`, `-` and `.` alike (a folder `llama_3.1_8b` holds Llama-3.1-8B's config).
"""

import copy
import hashlib
import json
import math
import re
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Callable

import yaml

from correctness.errors import RecipeError
from correctness.files import read_input
from correctness.model_limits import number_problem

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


def _unique_keys(label: str):
    """json.loads' object_pairs_hook: an object as a dict, refusing a key given twice (json.loads
    would keep the last value silently)."""
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        for key, value in pairs:
            if key in seen:
                raise ModelFactsError(f"{label}: duplicate key {key} in one JSON object")
            seen[key] = value
        return seen
    return hook


def read_config(path: str | Path) -> ConfigFile:
    path = config_file(path)
    label = f"model config {path}"
    raw = read_input(path, label, ModelFactsError, limit=CONFIG_LIMIT, kind="a config.json")
    try:
        data = json.loads(raw.decode("utf-8-sig"), object_pairs_hook=_unique_keys(label))
    except UnicodeDecodeError:
        raise ModelFactsError(f"{label}: not UTF-8 text") from None
    except json.JSONDecodeError as error:
        raise ModelFactsError(f"{label}: malformed JSON at line {error.lineno}") from None
    except RecursionError:
        raise ModelFactsError(f"{label}: JSON nested too deep to read") from None
    except ValueError:  # an integer beyond Python's int_max_str_digits, the one other ValueError json raises
        raise ModelFactsError(f"{label}: a number of more than {sys.get_int_max_str_digits()} digits") from None
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
def _family_table() -> dict[str, Any]:
    """families.yaml, read once (every lever built from a config looks its family up)."""
    return yaml.safe_load(FAMILIES_FILE.read_text())


def families() -> dict[str, dict[str, Any]]:
    return _family_table()["families"]


def field_table() -> dict[str, Any]:
    """The fate of each known config field: `used` (field -> the fact it gives), `ignored` (field ->
    why), `numerics_words`."""
    return _family_table()["config_fields"]


def family_of(architecture: str) -> tuple[str, dict[str, Any]]:
    for name, family in families().items():
        if architecture in family.get("architectures", ()):
            return name, family
    raise KeyError(architecture)


class _Config:
    """The text model's fields of a config, read with one-line errors naming the field. Every field
    read (get, count, number, flag) is recorded as used; `ignore` records why a field present is not."""

    def __init__(self, config: ConfigFile, fields: dict[str, Any], architecture: str, family_name: str,
                 family: dict[str, Any]):
        self.config, self.fields = config, fields
        self.architecture, self.family_name, self.family = architecture, family_name, family
        self.used: set[str] = set()
        self.ignored: dict[str, str] = {}

    def error(self, message: str) -> ModelFactsError:
        return ModelFactsError(f"model config {self.config.path}: {message}")

    def has(self, key: str) -> bool:
        return self.fields.get(key) is not None

    def _read(self, key: str) -> Any:
        if key in self.fields:
            self.used.add(key)
        return self.fields.get(key)

    def ignore(self, key: str, reason: str) -> None:
        """A field present that this config's facts are not made from, and why."""
        if key in self.fields:
            self.ignored.setdefault(key, reason)

    def get(self, key: str, default: Any = None) -> Any:
        value = self._read(key)
        return default if value is None else value

    def count(self, key: str, *, needed_for: str, minimum: int = 1, default: int | None = None) -> int:
        value = self._read(key)
        if value is None and default is not None:
            return default
        if value is None:
            raise self.error(f"missing field {key} (needed for {needed_for})")
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise self.error(f"field {key} must be an integer of at least {minimum}, got {value!r}")
        return value

    def first_count(self, keys: tuple[str, ...], *, needed_for: str, minimum: int = 1) -> int:
        """The count under the first of a field's names; a second name the config also gives must agree."""
        given = [(key, self.count(key, needed_for=needed_for, minimum=minimum)) for key in keys if self.has(key)]
        if not given:
            raise self.error(f"missing field {' or '.join(keys)} (needed for {needed_for})")
        (first, value), *others = given
        for other, other_value in others:
            if other_value != value:
                raise self.error(f"fields {first} {value} and {other} {other_value} disagree (both give {needed_for})")
        return value

    def number(self, key: str, default: float | None = None) -> float | None:
        value = self._read(key)
        return default if value is None else positive(value, self.error, key)

    def flag(self, key: str, default: bool) -> bool:
        value = self._read(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(f"field {key} must be true or false, got {value!r}")
        return value


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def positive(value: Any, error: Callable[[str], ModelFactsError], field: str, *, zero: bool = False) -> float:
    """A finite positive number (`zero`: or 0), else `error` naming the field (dotted within a mapping)."""
    problem = number_problem(value, zero=zero)
    if problem is not None:
        raise error(f"field {field} {problem}")
    return float(value)


def fraction(value: Any, error: Callable[[str], ModelFactsError], field: str) -> float:
    """A rotary fraction: a number in (0, 1]."""
    if not _is_number(value) or not 0 < value <= 1:  # NaN fails both comparisons
        raise error(f"field {field} must be a number in (0, 1], got {value!r}")
    return float(value)


# Numbers in rope_scaling / rope_parameters (transformers' RoPE types: linear, dynamic, llama3, yarn,
# longrope) and what they may be; mscale and mscale_all_dim of 0 turn DeepSeek's YaRN mscale off.
ROPE_NUMBERS = {"rope_theta": "positive", "partial_rotary_factor": "fraction", "factor": "positive",
                "low_freq_factor": "positive", "high_freq_factor": "positive", "beta_fast": "positive",
                "beta_slow": "positive", "original_max_position_embeddings": "positive",
                "attention_factor": "positive", "mscale": "zero", "mscale_all_dim": "zero"}
ROPE_LISTS = ("short_factor", "long_factor")  # longrope: one factor per rotary dimension pair


def _check_rope_mapping(cfg: _Config, mapping: Any, field: str) -> None:
    """The numbers of a rope_scaling / rope_parameters mapping (or of one layer type's, nested)."""
    if not isinstance(mapping, dict):
        raise cfg.error(f"field {field} must be a mapping, got {mapping!r}")
    for key, value in mapping.items():
        name = f"{field}.{key}"
        if isinstance(value, dict):
            _check_rope_mapping(cfg, value, name)
        elif key in ROPE_NUMBERS and value is not None:
            rule = ROPE_NUMBERS[key]
            if rule == "fraction":
                fraction(value, cfg.error, name)
            else:
                positive(value, cfg.error, name, zero=rule == "zero")
        elif key in ROPE_LISTS and value is not None:
            if not isinstance(value, list):
                raise cfg.error(f"field {name} must be a list of numbers, got {value!r}")
            for index, item in enumerate(value):
                positive(item, cfg.error, f"{name}[{index}]")


# Scalar fields checked wherever a config carries them, whether or not its facts are made from them
# (a field ignored here may be read by the model's own code): rule per field.
CHECKED_NUMBERS = {"rope_theta": "positive", "rope_local_base_freq": "positive", "partial_rotary_factor": "fraction",
                   "query_pre_attn_scalar": "positive", "attn_logit_softcapping": "positive",
                   "final_logit_softcapping": "positive", "routed_scaling_factor": "positive",
                   "swiglu_limit": "positive"}


def _check_numbers(cfg: _Config) -> None:
    """Refuse a RoPE base, rotary fraction, scale, softcap or window that no model could have (inf,
    NaN, zero, negative, not a number), naming the field."""
    for key, rule in CHECKED_NUMBERS.items():
        value = cfg.fields.get(key)
        if value is not None:
            (fraction if rule == "fraction" else positive)(value, cfg.error, key)
    window = cfg.fields.get("sliding_window")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise cfg.error(f"field sliding_window must be an integer of at least 1, got {window!r}")
    for key in ("rope_scaling", "rope_parameters"):
        if cfg.fields.get(key) is not None:
            _check_rope_mapping(cfg, cfg.fields[key], key)


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
    if cfg.has("use_sliding_window"):  # Qwen's switch for its window
        if cfg.flag("use_sliding_window", False):
            raise cfg.error("field use_sliding_window is true without layer_types: which layers slide is not said")
        # transformers' Qwen3 configs set sliding_window to None then: no layer slides.
        cfg.ignore("sliding_window", "use_sliding_window is false: the window applies to no layer")
        cfg.ignore("max_window_layers", "use_sliding_window is false: no layer slides")
        return [HF_FULL] * layers
    return _window_alone(cfg, layers)


def _window_alone(cfg: _Config, layers: int) -> list[str]:
    """The layer types of a config whose only word on windows is `sliding_window`: what the
    architecture's code makes of it (the family's `window_alone`: Mistral slides every layer by it,
    Llama has no window); an architecture the family does not say this of, with a window, is refused."""
    meaning = (cfg.family.get("window_alone") or {}).get(cfg.architecture)
    if meaning == "every_layer":
        if "sliding_window" not in cfg.fields:
            raise cfg.error(f"missing field sliding_window ({cfg.architecture} slides every layer by it, and"
                            " transformers' default where it is absent is not the suite's to guess; null: no window)")
        return [HF_FULL if cfg.get("sliding_window") is None else HF_SLIDING] * layers
    if cfg.has("sliding_window"):
        if meaning != "unused":
            raise cfg.error(f"field sliding_window without layer_types: whether {cfg.architecture} slides every layer"
                            f" or none is not said (window_alone of the {cfg.family_name} family in {FAMILIES_FILE.name})")
        cfg.ignore("sliding_window", f"{cfg.architecture} applies no window (its attention in transformers has none)")
    return [HF_FULL] * layers


def _layer_pattern(kinds: list[str]) -> dict[str, Any]:
    """The shortest repeat of the layer kinds, as fixtures/models write it."""
    for period in range(1, len(kinds) + 1):
        if len(kinds) % period == 0 and kinds == kinds[:period] * (len(kinds) // period):
            return {"repeat": kinds[:period]}
    raise AssertionError("unreachable: the whole list repeats itself")


def _rope(cfg: _Config, layer_type: str) -> tuple[float | None, float]:
    """(rope_theta, partial_rotary_factor) of a layer type: per-type `rope_parameters` (Gemma 4),
    flat `rope_parameters`, or the top-level fields; Gemma 3's local layers: rope_local_base_freq.
    The values were checked (_check_numbers) before."""
    parameters = cfg.get("rope_parameters") or {}
    if isinstance(parameters.get(layer_type), dict):
        parameters = parameters[layer_type]
    theta = parameters.get("rope_theta")
    if theta is None:
        theta = cfg.get("rope_local_base_freq") if layer_type == HF_SLIDING and cfg.has("rope_local_base_freq") else cfg.get("rope_theta")
    factor = parameters.get("partial_rotary_factor")
    if factor is None:
        factor = cfg.get("partial_rotary_factor", 1.0)
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
    if not cfg.has("kv_lora_rank"):
        return "inverse_sqrt_head_dim"
    scaling = cfg.fields.get("rope_scaling") or {}
    if scaling.get("mscale_all_dim"):
        cfg.get("rope_scaling")  # used: YaRN's mscale scales MLA's softmax
        if scaling.get("factor") is None:
            raise cfg.error("missing field rope_scaling.factor (needed with mscale_all_dim for MLA's softmax scale)")
        factor, all_dim = float(scaling["factor"]), float(scaling["mscale_all_dim"])
        mscale = 0.1 * all_dim * math.log(factor) + 1.0 if factor > 1 else 1.0
        return mscale * mscale / math.sqrt(head_dim)
    return "inverse_sqrt_head_dim"


def _moe(cfg: _Config) -> dict[str, Any] | None:
    keys = ("n_routed_experts", "num_experts", "num_local_experts")
    if not any(cfg.has(key) for key in keys):
        return None
    experts = cfg.first_count(keys, needed_for="the experts", minimum=0)
    if experts == 0:
        return None
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
        cfg.ignore("n_shared_experts", "the shared expert's size is moe_shared_expert_intermediate_size")
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


def _family_config(path: str | Path) -> _Config:
    """The config's text-model fields, with the architecture family its `architectures` names, its
    numbers and the family's expected values checked."""
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
    cfg = _Config(config, fields, architectures[0], family_name, family)
    cfg.get("architectures")
    _check_model_type(cfg, top)
    _check_model_name(cfg)
    _check_numbers(cfg)
    _check_expected_values(cfg)
    return cfg


def _check_model_type(cfg: _Config, top: dict[str, Any]) -> None:
    """The config's `model_type` (and its text_config's) is one of its architecture family's."""
    allowed = cfg.family.get("model_types") or ()
    for where, section in (("model_type", top), ("text_config.model_type", top.get("text_config"))):
        value = section.get("model_type") if isinstance(section, dict) else None
        if value is not None and value not in allowed:
            raise cfg.error(f"field {where} {value!r} is not the {cfg.family_name} family's ({', '.join(allowed)}),"
                            f" but architectures names {cfg.architecture}: the config contradicts itself")
    cfg.get("model_type")


def name_families(name: str) -> tuple[str, ...]:
    """The families whose `names` words the model's name holds (families.yaml: compared in lower case,
    with everything but letters and digits left out)."""
    squashed = re.sub(r"[^a-z0-9]", "", name.lower())
    return tuple(family_name for family_name, family in families().items()
                 if any(word in squashed for word in family.get("names") or ()))


def _check_model_name(cfg: _Config) -> None:
    """A config whose architecture is not of the family its model's name says (a Llama config in a
    folder named Gemma-4-31B) is another model's: its facts would label one model's cases with
    another's geometry."""
    named = name_families(cfg.config.name)
    if named and cfg.family_name not in named:
        raise cfg.error(f"architecture {cfg.architecture} is of the {cfg.family_name} family, but the model"
                        f" {cfg.config.name} (the name of the folder holding its config.json) is of the"
                        f" {' or '.join(named)} family: this is another model's config")


def _layer_kinds(
    cfg: _Config, layers: int, heads: int, hidden: int
) -> tuple[list[str], list[str], dict[str, dict[str, Any]]]:
    """Each layer's Hugging Face type and the family's kind for it, and the facts of each attention kind."""
    names = cfg.family.get("layer_kinds") or {}
    types = _layer_types(cfg, layers)
    unknown = sorted({t for t in types if t not in names})
    if unknown:
        raise cfg.error(f"layer type {unknown[0]!r} is not one the {cfg.family_name} family knows ({', '.join(names)});"
                        f" add it to layer_kinds in {FAMILIES_FILE.name}")
    kinds = [names[t] for t in types]
    attention_types = {names[t]: t for t in types if t in (HF_FULL, HF_SLIDING) or names[t] == "attention"}
    attention_kinds = {
        kind: _attention_kind(cfg, HF_FULL if hf_type not in (HF_FULL, HF_SLIDING) else hf_type, heads, hidden)
        for kind, hf_type in attention_types.items()
    }
    if not attention_kinds:
        raise cfg.error("no layer has attention")
    return types, kinds, attention_kinds


def _layout_facts(
    cfg: _Config, facts: dict[str, Any], moe: dict[str, Any] | None, types: list[str], kinds: list[str], layers: int
) -> dict[str, str] | None:
    """Sets `facts["layer_pattern"]` (the layers' kinds in order); returns the attention kind of each
    layer kind where the layer kinds are not attention kinds (DeepSeek's dense and MoE layers), else None."""
    dense_key = cfg.family.get("dense_layers")
    if dense_key is not None and moe is not None:  # DeepSeek: the first k layers dense, then MoE
        dense = cfg.count(dense_key, needed_for="the dense layers before the MoE ones", minimum=0)
        if dense > layers:
            raise cfg.error(f"{dense_key} {dense} is more than the {layers} layers")
        attention_kind = kinds[0]
        facts["layer_pattern"] = {"symbols": "D" * dense + "E" * (layers - dense), "kinds": {"D": "dense", "E": "moe"}}
        return {"dense": attention_kind, "moe": attention_kind}
    if cfg.has("hybrid_override_pattern"):
        names = cfg.family.get("layer_kinds") or {}
        facts["layer_pattern"] = {"symbols": "".join(types), "kinds": {symbol: names[symbol] for symbol in dict.fromkeys(types)}}
        return None
    if moe is not None and (cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1):
        raise cfg.error("fields mlp_only_layers / decoder_sparse_step make some layers dense: a mix of dense and"
                        " MoE layers is not modelled for this family")
    facts["layer_pattern"] = _layer_pattern(kinds)
    return None


def _attention_facts(
    cfg: _Config, heads: int, attention_kinds: dict[str, dict[str, Any]], kind_of_layer: dict[str, str] | None
) -> dict[str, Any]:
    """The facts' `attention` section: query heads, softmax scale, softcap, the kinds, MLA's ranks."""
    first_head_dim = next(iter(attention_kinds.values()))["head_dim"]
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
    return attention


def _mamba(cfg: _Config) -> dict[str, int]:
    return {
        "heads": cfg.count("mamba_num_heads", needed_for="mamba.heads"),
        "head_dim": cfg.count("mamba_head_dim", needed_for="mamba.head_dim"),
        "state_size": cfg.count("ssm_state_size", needed_for="mamba.state_size"),
        "groups": cfg.count("n_groups", needed_for="mamba.groups"),
        "conv_kernel": cfg.count("conv_kernel", needed_for="mamba.conv_kernel"),
    }


def _with_family_facts(cfg: _Config, facts: dict[str, Any]) -> dict[str, Any]:
    """The facts with the family's own laid over them, its megatron, checkpoint and synthetic
    sections, and the fate of every config field."""
    facts = _merge(facts, copy.deepcopy(cfg.family.get("facts", {})))
    if facts.get("moe") is not None and "routing" not in facts["moe"]:
        raise cfg.error(f"the {cfg.family_name} family does not say how its router scores experts (facts.moe.routing)")
    for section in ("megatron", "checkpoint", "synthetic"):
        if section in cfg.family:
            facts[section] = copy.deepcopy(cfg.family[section])
    facts["config_fields"] = _field_fates(cfg)
    return facts


def facts_from_config(path: str | Path) -> dict[str, Any]:
    """The model facts of a config.json (see the module's docstring)."""
    cfg = _family_config(path)
    layers = cfg.count("num_hidden_layers", needed_for="layers")
    hidden = cfg.count("hidden_size", needed_for="hidden_size")
    heads = cfg.count("num_attention_heads", needed_for="attention.query_heads")
    types, kinds, attention_kinds = _layer_kinds(cfg, layers, heads, hidden)

    facts: dict[str, Any] = {
        "name": cfg.config.name,
        "short_name": short_name(cfg.config.name),
        "source": str(cfg.config.path),
        "config_sha256": cfg.config.sha256,
        "family": cfg.family_name,
        "layers": layers,
        "hidden_size": hidden,
    }
    if "ffn_gated" in cfg.family.get("facts", {}):
        facts["ffn_hidden_size"] = cfg.count("intermediate_size", needed_for="ffn_hidden_size")
    facts["vocab_size"] = cfg.count("vocab_size", needed_for="vocab_size")
    facts["mlp"] = _mlp(cfg)
    top = cfg.config.data
    facts["tied_embeddings"] = cfg.flag("tie_word_embeddings", top.get("tie_word_embeddings", True) is True)  # transformers' default
    moe = _moe(cfg)
    if moe is None:
        facts["experts"] = 0
    kind_of_layer = _layout_facts(cfg, facts, moe, types, kinds, layers)
    if cfg.has("num_nextn_predict_layers"):
        facts["mtp_blocks"] = cfg.count("num_nextn_predict_layers", needed_for="mtp_blocks", minimum=0)
    facts["attention"] = _attention_facts(cfg, heads, attention_kinds, kind_of_layer)
    if cfg.has("final_logit_softcapping"):
        facts["final_logit_softcap"] = float(cfg.number("final_logit_softcapping"))
    if moe is not None:
        facts["moe"] = moe
    if cfg.has("mamba_num_heads"):
        facts["mamba"] = _mamba(cfg)
    return _with_family_facts(cfg, facts)


def _check_expected_values(cfg: _Config) -> None:
    """The family's `config_fields.expects`: a value its facts assume (a part they do not model is
    off); another value, or an absent field whose transformers default (`defaults`) is another, is
    refused."""
    section = cfg.family.get("config_fields") or {}
    defaults = section.get("defaults") or {}
    for key, expected in (section.get("expects") or {}).items():
        value = cfg.get(key, defaults.get(key, expected))
        if value != expected or type(value) is not type(expected):
            said = "" if key in cfg.fields else " (transformers' default where it is absent)"
            raise cfg.error(f"field {key} {json.dumps(value)}{said}: the {cfg.family_name} family's facts assume"
                            f" {json.dumps(expected)} and do not model another value")


def _field_fates(cfg: _Config) -> dict[str, Any]:
    """The `config_fields` section: every field of the text model used, or ignored with the reason,
    in this order of precedence: the family's `overridden` (read, but its fact replaced by the
    family's), read by the code or expected by the family (used), the code's own reason, the family's
    `ignored`, the table's `ignored`, a used field not needed here; unknown last. A field unknown to
    the table whose name has a numerics word (`numerics_words`) is refused."""
    table, section = field_table(), cfg.family.get("config_fields") or {}
    overridden, expected = section.get("overridden") or {}, section.get("expects") or {}
    reasons = {**table["ignored"], **(section.get("ignored") or {}), **cfg.ignored}
    used, ignored = [], {}
    for key in cfg.fields:
        if key in overridden:
            ignored[key] = overridden[key]
        elif key in cfg.used or key in expected:
            used.append(key)
        elif key in reasons:
            ignored[key] = reasons[key]
        elif key in table["used"]:
            ignored[key] = f"not needed by this config (where it applies it gives {table['used'][key]})"
        else:
            ignored[key] = _unknown_field(cfg, key, table["numerics_words"])
    return {"used": sorted(used), "ignored": dict(sorted(ignored.items()))}


def field_words(key: str) -> set[str]:
    """A field's name as words: split at `_`, `-`, `.` and where a capital follows a lower-case
    letter or a digit (logitScale: logit, scale)."""
    spaced = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", key)
    return {word for word in re.split(r"[^a-z0-9]+", spaced.lower()) if word}


def _unknown_field(cfg: _Config, key: str, numerics_words: list[str]) -> str:
    """The reason an unknown field is ignored; refused where a word of its name says numerics."""
    words = sorted(field_words(key) & set(numerics_words))
    if words:
        raise cfg.error(f"field {key} is not known to the suite, and its name ({', '.join(words)}) says it may shape"
                        f" what a lever computes; add it to config_fields in {FAMILIES_FILE.name} with its fate")
    return "not known to the suite (its name says nothing of numerics)"


def facts_text(facts: dict[str, Any]) -> str:
    """The facts as a YAML file, with a header naming where they came from."""
    header = (
        f"# Model facts for {facts['name']}, generated by `correctness model-facts` from {facts['source']}\n"
        f"# (sha256 {facts['config_sha256']}) and the {facts['family']} family of correctness/families.yaml.\n"
    )
    return header + yaml.safe_dump(facts, sort_keys=False, width=100)
