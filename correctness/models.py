"""Model facts: layer kinds, attention geometry and Megatron's layout of one model.

Read from a facts file (fixtures/models/<name>.yaml, or one `correctness model-facts` wrote) or made
from the model's Hugging Face config.json (correctness.model_config). `facts_for(recipe,
given)` is what a lever uses: the facts given on the command line (--model-config), which must be
for the recipe's model, else the suite's own: fixtures/models/<name>.yaml, then
fixtures/configs/<Name>/config.json. Every model name is compared by
correctness.model_config.same_model: without regard to case, with `_`, `-` and `.` alike. The
recipe's own model arguments (its run script's --num-layers, ...) must agree with the facts
(correctness.model_arguments), and every size the levers read is held to correctness.model_limits
where facts are read (`check_facts`).
"""

import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from correctness.errors import RecipeError
from correctness.files import visible_name
from correctness.fixtures import CONFIGS_DIR, MODELS_DIR
from correctness.model_arguments import check_model_arguments
from correctness.model_config import config_file, facts_from_config, same_model
from correctness.model_limits import checked_number, checked_size
from correctness.recipes import dotted_field
from correctness.yaml_documents import load_yaml, read_yaml_input


@dataclass(frozen=True, kw_only=True)
class AttentionKind:
    """One kind of attention layer (Gemma: "sliding" and "global") as the whole model has it."""

    name: str
    query_heads: int
    kv_heads: int
    head_dim: int
    window: int | None  # Hugging Face convention: the query and the window - 1 keys before it
    softmax_scale: float
    v_head_dim: int  # V's (and the output's) head dim: head_dim but for MLA (DeepSeek-V3: 192 and 128)
    logit_softcap: float | None = None  # c in c tanh(logit / c) (Gemma 2: 50); None: none
    sinks: bool = False  # one learned logit per query head in the softmax's denominator (GPT-OSS)

    @property
    def gqa_ratio(self) -> int:
        return self.query_heads // self.kv_heads


@dataclass(frozen=True)
class ModelFacts:
    name: str
    short_name: str  # for case ids: "gemma4-31b"
    data: dict[str, Any]
    source: str = ""  # the file the facts were read from or generated from (a config.json)
    sha256: str = ""  # that file's sha256

    def field(self, dotted: str) -> Any:
        return dotted_field(self.data, dotted, f"model facts {self.name}")

    @property
    def layers(self) -> int:
        return int(self.field("layers"))

    def layer_kind(self, layer: int) -> str:
        if not 0 <= layer < self.layers:
            raise RecipeError(f"model facts {self.name}: layer {layer} outside 0..{self.layers - 1}")
        pattern = self.field("layer_pattern")
        if "repeat" in pattern:
            repeat = pattern["repeat"]
            return repeat[layer % len(repeat)]
        return pattern["kinds"][pattern["symbols"][layer]]

    def layers_of_kind(self, kind: str) -> tuple[int, ...]:
        return tuple(layer for layer in range(self.layers) if self.layer_kind(layer) == kind)

    def attention_kind_of(self, layer_kind: str) -> str | None:
        """The attention kind a layer kind runs: the layer kind itself where it is an attention kind
        (Gemma: sliding, global), else `attention.kind_of_layer`'s entry (Moonlight's dense and moe
        layers both run its one attention kind); None for a layer without attention (Mamba)."""
        if layer_kind in self.attention_kinds:
            return layer_kind
        mapping = self.data.get("attention", {}).get("kind_of_layer") or {}
        return mapping.get(layer_kind)

    def attention_layers(self, kind: str) -> tuple[int, ...]:
        """The layers whose attention is of this attention kind."""
        return tuple(layer for layer in range(self.layers) if self.attention_kind_of(self.layer_kind(layer)) == kind)

    @property
    def attention_kinds(self) -> tuple[str, ...]:
        return tuple(self.field("attention.kinds"))

    def attention_kind(self, kind: str) -> AttentionKind:
        facts = self.field(f"attention.kinds.{kind}") if kind in self.attention_kinds else None
        if facts is None:
            raise RecipeError(f"model facts {self.name}: no attention kind {kind!r} (has {list(self.attention_kinds)})")
        head_dim = int(facts["head_dim"])
        scale = self.field("attention.softmax_scale")
        if scale == "inverse_sqrt_head_dim":
            scale = 1.0 / math.sqrt(head_dim)
        attention = self.field("attention")
        softcap = attention.get("logit_softcap")
        return AttentionKind(
            name=kind,
            query_heads=int(self.field("attention.query_heads")),
            kv_heads=int(facts["kv_heads"]),
            head_dim=head_dim,
            window=facts["window"],
            softmax_scale=float(scale),
            v_head_dim=int(facts.get("v_head_dim", head_dim)),
            logit_softcap=None if softcap is None else float(softcap),
            sinks=bool(attention.get("sinks", False)),
        )


# Sizes the levers read: dotted field -> its dimension in correctness.model_limits.
SIZES = {
    "layers": "layers", "hidden_size": "hidden size", "ffn_hidden_size": "FFN size", "vocab_size": "vocabulary",
    "attention.query_heads": "attention heads",
    "moe.experts": "experts", "moe.top_k": "experts per token", "moe.expert_ffn_hidden_size": "expert FFN size",
    "moe.shared_expert_ffn_hidden_size": "FFN size", "moe.latent_size": "MoE latent size",
    "attention.mla.q_lora_rank": "MLA rank", "attention.mla.kv_lora_rank": "MLA rank",
    "mamba.heads": "Mamba heads", "mamba.head_dim": "Mamba head dim", "mamba.state_size": "Mamba state size",
    "mamba.groups": "Mamba groups", "mamba.conv_kernel": "Mamba convolution width",
}
KIND_SIZES = {"kv_heads": "key-value heads", "head_dim": "head dim", "v_head_dim": "head dim", "window": "context tokens"}
# Numbers that are no size: finite and above zero where given (None: absent).
NUMBERS = ("attention.logit_softcap", "final_logit_softcap", "moe.routing_scaling_factor", "mlp.clamp")


def _present(data: dict[str, Any], dotted: str) -> tuple[bool, Any]:
    value: Any = data
    for key in dotted.split("."):
        if not isinstance(value, dict) or value.get(key) is None:
            return False, None
        value = value[key]
    return True, value


def check_facts(data: dict[str, Any], owner: str) -> None:
    """Hold every size the levers read to correctness.model_limits, and the RoPE bases, windows,
    scales and softcaps to finite positive numbers: RecipeError in one line naming `owner` and the
    field. A field that is absent is left to the lever that needs it (which names it missing). The
    model's name (a config's: its folder's) must show as itself (correctness.files.visible_name)."""
    present, name = _present(data, "name")
    if present and isinstance(name, str):
        visible_name(name, f"{owner}: field name", RecipeError)
    for dotted, dimension in SIZES.items():
        present, value = _present(data, dotted)
        if present:
            checked_size(value, dimension, owner, dotted)
    present, blocks = _present(data, "mtp_blocks")
    if present:
        checked_size(blocks, "MTP blocks", owner, "mtp_blocks", minimum=0)
    for dotted in NUMBERS:
        present, value = _present(data, dotted)
        if present:
            checked_number(value, owner, dotted)
    present, scale = _present(data, "attention.softmax_scale")
    if present and scale != "inverse_sqrt_head_dim":
        checked_number(scale, owner, "attention.softmax_scale")
    present, kinds = _present(data, "attention.kinds")
    for kind, facts in (kinds.items() if present and isinstance(kinds, dict) else ()):
        _check_kind(facts, owner, f"attention.kinds.{kind}")


def _check_kind(facts: Any, owner: str, prefix: str) -> None:
    if not isinstance(facts, dict):
        raise RecipeError(f"{owner}: field {prefix} must be a mapping")
    for key, dimension in KIND_SIZES.items():
        if facts.get(key) is not None:
            checked_size(facts[key], dimension, owner, f"{prefix}.{key}")
    if facts.get("rope_theta") is not None:
        checked_number(facts["rope_theta"], owner, f"{prefix}.rope_theta")
    if facts.get("partial_rotary_factor") is not None:
        checked_number(facts["partial_rotary_factor"], owner, f"{prefix}.partial_rotary_factor", at_most=1.0, zero=True)


def _named(model_name: str, named_paths: Iterable[tuple[str, Path]]) -> Path | None:
    """The first path whose name is the model's (same_model)."""
    return next((path for name, path in named_paths if same_model(name, model_name)), None)


def model_file(model_name: str) -> Path | None:
    """fixtures/models/<name>.yaml of a recipe's `model:` (Gemma-4-31B: gemma-4-31b.yaml)."""
    return _named(model_name, ((path.stem, path) for path in sorted(MODELS_DIR.glob("*.yaml"))))


def fixture_config(model_name: str) -> Path | None:
    """fixtures/configs/<Name>/config.json of a model."""
    if not CONFIGS_DIR.is_dir():
        return None
    folders = sorted(folder for folder in CONFIGS_DIR.iterdir() if (folder / "config.json").is_file())
    return _named(model_name, ((folder.name, folder / "config.json") for folder in folders))


def _facts(data: Any, label: str, source: Path, raw: bytes) -> ModelFacts:
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        raise RecipeError(f"{label}: missing field name")
    short = data.get("short_name")
    if not isinstance(short, str):
        raise RecipeError(f"{label}: missing field short_name")
    check_facts(data, label)
    return ModelFacts(name=data["name"], short_name=short, data=data, source=_shown(source),
                      sha256=hashlib.sha256(raw).hexdigest())


def _shown(path: Path) -> str:
    """A fixture's path relative to the fixtures folder's parent (fixtures/models/x.yaml), else as given."""
    resolved = path.resolve()
    base = MODELS_DIR.parent.parent
    return str(resolved.relative_to(base)) if resolved.is_relative_to(base) else str(path)


def load_facts(path: str | Path) -> ModelFacts:
    """The model facts in a file: a Hugging Face config.json (or a folder holding one), made into
    facts by correctness.model_config, or a facts YAML file. RecipeError in one line where it is
    missing or malformed."""
    path = Path(path)
    if path.is_dir() or path.suffix == ".json":
        source = config_file(path)
        data = facts_from_config(source)
        check_facts(data, f"model facts of {source}")
        return ModelFacts(name=data["name"], short_name=data["short_name"], data=data, source=_shown(source),
                          sha256=data["config_sha256"])
    label = f"model facts {path}"
    raw = read_yaml_input(path, label)
    return _facts(load_yaml(raw, label), label, path, raw)


def load_model(model_name: str) -> ModelFacts:
    """The suite's own facts of a recipe's `model:`: fixtures/models/<name>.yaml, else made from
    fixtures/configs/<Name>/config.json; RecipeError (one line) where it has neither."""
    source = model_file(model_name) or fixture_config(model_name)
    if source is None:
        raise RecipeError(f"model {model_name}: the suite has no model facts for it (no {model_name.lower()}.yaml in"
                          f" {_shown(MODELS_DIR)}, no config in {_shown(CONFIGS_DIR)}); give its Hugging Face"
                          " config with --model-config path/to/config.json")
    facts = load_facts(source)
    if not same_model(facts.name, model_name):
        raise RecipeError(f"model facts {facts.source}: its name field reads {facts.name!r}, not {model_name!r}")
    return facts


def facts_for(recipe: Any, given: ModelFacts | None = None) -> ModelFacts:
    """The facts a lever builds a recipe's (correctness.recipes.Recipe) shapes from: `given`
    (--model-config), which must be for the recipe's model, else the suite's own (load_model); the
    recipe's run-script model arguments must agree with them (correctness.model_arguments)."""
    facts = _chosen_facts(recipe.model, given)
    check_model_arguments(recipe, facts)
    return facts


def _chosen_facts(recipe_model: str, given: ModelFacts | None) -> ModelFacts:
    if given is None:
        return load_model(recipe_model)
    if not same_model(given.name, recipe_model):
        raise RecipeError(f"model facts {given.source} are for {given.name}, but the recipe is for {recipe_model}"
                          " (a config's model is the name of the folder holding its config.json)")
    return given
