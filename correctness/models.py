"""Model facts (fixtures/models/<name>.yaml): layer kinds and attention geometry."""

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from correctness.errors import RecipeError
from correctness.fixtures import MODELS_DIR
from correctness.recipes import dotted_field


@dataclass(frozen=True, kw_only=True)
class AttentionKind:
    """One kind of attention layer (Gemma: "sliding" and "global") as the whole model has it."""

    name: str
    query_heads: int
    kv_heads: int
    head_dim: int
    window: int | None  # Hugging Face convention: the query and the window - 1 keys before it
    softmax_scale: float

    @property
    def gqa_ratio(self) -> int:
        return self.query_heads // self.kv_heads


@dataclass(frozen=True)
class ModelFacts:
    name: str
    short_name: str  # for case ids: "gemma4-31b"
    data: dict[str, Any]

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
        return AttentionKind(
            name=kind,
            query_heads=int(self.field("attention.query_heads")),
            kv_heads=int(facts["kv_heads"]),
            head_dim=head_dim,
            window=facts["window"],
            softmax_scale=float(scale),
        )


def model_file(model_name: str) -> Path:
    """fixtures/models/<name>.yaml for a recipe's `model:` value ("Gemma-4-31B" -> gemma-4-31b.yaml)."""
    return MODELS_DIR / f"{model_name.lower()}.yaml"


def load_model(model_name: str) -> ModelFacts:
    """The model facts of a recipe's `model:`; RecipeError (one line, naming the file) where the
    suite has none or they are malformed."""
    path = model_file(model_name)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError:
        raise RecipeError(f"model {model_name}: no model facts at {path}") from None
    except UnicodeDecodeError:
        raise RecipeError(f"model facts {path}: not UTF-8 text") from None
    except yaml.YAMLError:
        raise RecipeError(f"model facts {path}: malformed YAML") from None
    if not isinstance(data, dict) or data.get("name") != model_name:
        raise RecipeError(f"model facts {path}: its name field does not read {model_name!r}")
    short = data.get("short_name")
    if not isinstance(short, str):
        raise RecipeError(f"model facts {path}: missing field short_name")
    return ModelFacts(name=model_name, short_name=short, data=data)
