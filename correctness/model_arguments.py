"""The recipe's model arguments held equal to the model facts its levers build shapes from.

A recipe's run script states the model as Megatron is told it (--num-layers, --hidden-size,
--rotary-base, ...); the levers take their shapes from the model facts (correctness.models). Where
the two disagree (a Llama config in a folder named after Mistral, or a script copied from another
model) the levers would pass at shapes the recipe never trains, so every flag of ARGUMENTS the
script shows is compared with the facts' value, and a mismatch is a RecipeError in one line naming
the flag, both values and where the facts came from.

A flag the script does not show is not compared (Megatron's default is not assumed), nor one whose
fact the facts do not state (an MoE model's --ffn-hidden-size, which its dense layers would use).
Arguments the script hides (an array expansion such as "${MODEL_ARGS[@]}", or a bridge that builds
the model from its Hugging Face config with no model flags at all) cannot be compared: the result
says so (ModelArgumentCheck.unchecked), and the recipe's reference records it.
"""

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from correctness.errors import RecipeError
from correctness.recipe_arguments import SEQUENCE, disagreement

ROPE_TYPES = {"rope": "rope", "yarn": "rope", "mrope": "rope", "none": "none"}
SOFTMAX_TYPES = {True: "learnable", False: "vanilla"}
LAYER_LIST = re.compile(r"\[\s*([01](?:\s*,\s*[01])*)\s*\](?:\s*\*\s*(\d+))?")


class ModelArgumentError(RecipeError):
    """A recipe's model argument that contradicts its model facts; the message names the recipe."""


@dataclass(frozen=True)
class ModelArgumentCheck:
    """What a check of a recipe's model arguments compared, and why any could not be."""

    checked: tuple[str, ...]  # the flags compared, in the script's order
    unchecked: str | None  # why some or all could not be (hidden arguments); None: none hidden


@dataclass(frozen=True)
class ModelArgument:
    """One flag of the run script and the fact it states.

    `recipe_value(words, layers)`: the flag's words (its last occurrence) as the value compared
    (ValueError: malformed); `facts_values(facts)`: the values the facts allow (several where
    attention kinds differ), None where the facts do not state it; `shown(value)`: a facts value
    as messages write it."""

    flag: str
    fact: str
    recipe_value: Callable[[list[str], int], Any]
    facts_values: Callable[[Any], tuple[Any, ...] | None]
    shown: Callable[[Any], str] = lambda value: _plain(value)


# The recipe's side: a flag's words as a value.

def _one(words: list[str]) -> str:
    if len(words) != 1:
        raise ValueError("takes one value")
    return words[0]


def _integer(words: list[str], layers: int) -> int:
    return int(_one(words))


def _number(words: list[str], layers: int) -> float:
    value = float(_one(words))
    if not math.isfinite(value):
        raise ValueError("takes a finite number")
    return value


def _word(words: list[str], layers: int) -> str:
    return _one(words)


def _switch(implied: Any) -> Callable[[list[str], int], Any]:
    """A flag without values (--swiglu) that states `implied`."""
    def value(words: list[str], layers: int) -> Any:
        if words:
            raise ValueError("takes no value")
        return implied
    return value


def _window(words: list[str], layers: int) -> tuple[int, int]:
    """Megatron's --window-size "left,right": the keys before and after the query it sees."""
    left, right = (int(part) for part in _one(words).split(","))
    return left, right


def _layer_list(expression: str, layers: int) -> tuple[int, ...]:
    """Megatron's per-layer list expression ("[0]*1+[1]*26", "[1,0,1]") as one 0 or 1 per layer."""
    flags: list[int] = []
    for term in expression.replace(" ", "").split("+"):
        match = LAYER_LIST.fullmatch(term)
        if match is None:
            raise ValueError("is neither an integer nor a list expression such as [0]*1+[1]*26")
        flags += [int(flag) for flag in match.group(1).split(",")] * int(match.group(2) or 1)
    if len(flags) != layers:
        raise ValueError(f"lists {len(flags)} layers, not the model's {layers}")
    return tuple(flags)


def _moe_layers(words: list[str], layers: int) -> tuple[int, ...]:
    """--moe-layer-freq: N (layer i, from 0, is MoE where i % N == 0) or a per-layer list."""
    text = _one(words)
    if text.isdigit():
        return tuple(int(layer % int(text) == 0) for layer in range(layers))
    return _layer_list(text, layers)


def _windowed_layers(words: list[str], layers: int) -> tuple[int, ...]:
    """--window-attn-skip-freq: N (layer n, from 1, has the window where n % N != 0) or a per-layer
    list (megatron.core.transformer.utils.is_layer_window_attention)."""
    text = _one(words)
    if text.isdigit():
        return tuple(int((layer + 1) % int(text) != 0) for layer in range(layers))
    return _layer_list(text, layers)


# The facts' side: the values a fact allows.

def _at(facts: Any, dotted: str) -> Any:
    value = facts.data
    for key in dotted.split("."):
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


def _field(dotted: str) -> Callable[[Any], tuple[Any, ...] | None]:
    def values(facts: Any) -> tuple[Any, ...] | None:
        value = _at(facts, dotted)
        return None if value is None else (value,)
    return values


def _mla(facts: Any) -> bool:
    return _at(facts, "attention.mla") is not None


def _kinds(key: str, *, mla: bool = True) -> Callable[[Any], tuple[Any, ...] | None]:
    """A field of every attention kind (the kinds' distinct values); `mla` False: not stated for
    MLA, whose head dims and rotary share Megatron takes from its own flags."""
    def values(facts: Any) -> tuple[Any, ...] | None:
        if not mla and _mla(facts):
            return None
        kinds = _at(facts, "attention.kinds") or {}
        found = tuple(dict.fromkeys(kind.get(key) for kind in kinds.values() if kind.get(key) is not None))
        return found or None
    return values


def _mla_field(key: str) -> Callable[[Any], tuple[Any, ...] | None]:
    def values(facts: Any) -> tuple[Any, ...] | None:
        return (_at(facts, f"attention.mla.{key}"),) if _mla(facts) else None
    return values


def _megatron_windows(facts: Any) -> tuple[Any, ...]:
    """The windows of the attention kinds as Megatron's (left, right): Hugging Face's sliding_window
    W sees the query and the W - 1 keys before it (../shared/notes/upstream-facts.md); None: no kind
    has a window."""
    windows = _kinds("window")(facts)
    return tuple((window - 1, 0) for window in windows) if windows else (None,)


def _window_shown(window: Any) -> str:
    return "none" if window is None else f"{window} (Hugging Face's sliding_window {window[0] + 1})"


def _layer_kinds(facts: Any) -> list[str]:
    return [facts.layer_kind(layer) for layer in range(facts.layers)]


def _windowed_of(facts: Any) -> tuple[tuple[int, ...], ...]:
    kinds = _at(facts, "attention.kinds") or {}
    windowed = []
    for kind in _layer_kinds(facts):
        attention = facts.attention_kind_of(kind)
        windowed.append(int(attention is not None and kinds[attention].get("window") is not None))
    return (tuple(windowed),)


def _moe_of(facts: Any) -> tuple[tuple[int, ...], ...] | None:
    """Which layers are MoE: those of kind "moe", or every layer of a model whose kinds name none."""
    if _at(facts, "moe") is None:
        return None
    kinds = _layer_kinds(facts)
    every = "moe" not in kinds and "dense" not in kinds
    return (tuple(int(every or kind == "moe") for kind in kinds),)


def _period_shown(flags: tuple[int, ...], every: Callable[[int, int], bool]) -> str:
    """Per-layer flags as Megatron's flag would write them: the period N where every(layer, N) gives
    them, else the list expression."""
    for period in range(1, len(flags) + 1):
        if all(int(every(layer, period)) == flag for layer, flag in enumerate(flags)):
            return str(period)
    runs: list[list[int]] = []
    for flag in flags:
        if runs and runs[-1][0] == flag:
            runs[-1][1] += 1
        else:
            runs.append([flag, 1])
    return "+".join(f"[{flag}]*{count}" for flag, count in runs)


def _mlp_of(facts: Any) -> tuple[str, ...] | None:
    activation = _at(facts, "mlp.activation")
    if activation is None:
        return None
    return (f"gated {activation}" if _at(facts, "mlp.gated") else activation,)


def _experts_of(facts: Any) -> tuple[int, ...] | None:
    return _field("moe.experts")(facts) or _field("experts")(facts)


def _position_embedding_of(facts: Any) -> tuple[str, ...]:
    return ("rope" if _kinds("rope_theta")(facts) else "none",)


def _qk_norm_of(facts: Any) -> tuple[bool, ...] | None:
    # Megatron's --qk-layernorm on MLA normalizes the query and key-value latents, which every
    # DeepSeek-V3 has; the facts' qk_norm is the per-head norm of Qwen3 and Gemma.
    return None if _mla(facts) else _field("attention.qk_norm")(facts)


def _sinks_of(facts: Any) -> tuple[str, ...]:
    return (SOFTMAX_TYPES[bool(_at(facts, "attention.sinks"))],)


def _hybrid_pattern_of(facts: Any) -> tuple[str, ...] | None:
    return _field("layer_pattern.symbols")(facts) if _at(facts, "mamba") is not None else None


def _plain(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return "none" if value is None else str(value)


ARGUMENTS: tuple[ModelArgument, ...] = (
    ModelArgument("--num-layers", "layers", _integer, _field("layers")),
    ModelArgument("--hidden-size", "hidden_size", _integer, _field("hidden_size")),
    ModelArgument("--ffn-hidden-size", "ffn_hidden_size", _integer, _field("ffn_hidden_size")),
    ModelArgument("--num-attention-heads", "attention.query_heads", _integer, _field("attention.query_heads")),
    ModelArgument("--num-query-groups", "kv_heads", _integer, _kinds("kv_heads")),
    ModelArgument("--kv-channels", "head_dim", _integer, _kinds("head_dim", mla=False)),
    ModelArgument("--position-embedding-type", "position embedding", lambda words, layers: ROPE_TYPES.get(_one(words), _one(words)),
                  _position_embedding_of),
    ModelArgument("--rotary-base", "rope_theta", _number, _kinds("rope_theta")),
    ModelArgument("--rotary-percent", "partial_rotary_factor", _number, _kinds("partial_rotary_factor", mla=False)),
    ModelArgument("--window-size", "window", _window, _megatron_windows, _window_shown),
    ModelArgument("--window-attn-skip-freq", "window_attn_skip_freq", _windowed_layers, _windowed_of,
                  lambda flags: _period_shown(flags, lambda layer, n: (layer + 1) % n != 0)),
    ModelArgument("--softmax-type", "attention.sinks", _word, _sinks_of),
    ModelArgument("--qk-layernorm", "attention.qk_norm", _switch(True), _qk_norm_of),
    ModelArgument("--multi-latent-attention", "attention.mla", _switch(True), lambda facts: (_mla(facts),),
                  lambda present: "present" if present else "absent"),
    ModelArgument("--q-lora-rank", "attention.mla.q_lora_rank", _integer, _mla_field("q_lora_rank")),
    ModelArgument("--kv-lora-rank", "attention.mla.kv_lora_rank", _integer, _mla_field("kv_lora_rank")),
    ModelArgument("--qk-head-dim", "attention.mla.qk_nope_head_dim", _integer, _mla_field("qk_nope_head_dim")),
    ModelArgument("--qk-pos-emb-head-dim", "attention.mla.qk_rope_head_dim", _integer, _mla_field("qk_rope_head_dim")),
    ModelArgument("--v-head-dim", "attention.mla.v_head_dim", _integer, _mla_field("v_head_dim")),
    ModelArgument("--swiglu", "mlp", _switch("gated silu"), _mlp_of),
    ModelArgument("--quick-geglu", "mlp", _switch("gated quick_gelu"), _mlp_of),
    ModelArgument("--squared-relu", "mlp", _switch("squared_relu"), _mlp_of),
    ModelArgument("--glu-linear-offset", "mlp.glu_linear_offset", _number, _field("mlp.glu_linear_offset")),
    ModelArgument("--activation-func-clamp-value", "mlp.clamp", _number, _field("mlp.clamp")),
    ModelArgument("--vocab-size", "vocab_size", _integer, _field("vocab_size")),
    ModelArgument("--untie-embeddings-and-output-weights", "tied_embeddings", _switch(False), _field("tied_embeddings")),
    ModelArgument("--num-experts", "moe.experts", _integer, _experts_of),
    ModelArgument("--moe-router-topk", "moe.top_k", _integer, _field("moe.top_k")),
    ModelArgument("--moe-ffn-hidden-size", "moe.expert_ffn_hidden_size", _integer, _field("moe.expert_ffn_hidden_size")),
    ModelArgument("--moe-shared-expert-intermediate-size", "moe.shared_expert_ffn_hidden_size", _integer,
                  lambda facts: (_at(facts, "moe.shared_expert_ffn_hidden_size"),) if _at(facts, "moe") else None),
    ModelArgument("--moe-router-score-function", "moe.routing", _word, _field("moe.routing")),
    ModelArgument("--moe-router-topk-scaling-factor", "moe.routing_scaling_factor", _number,
                  _field("moe.routing_scaling_factor")),
    ModelArgument("--moe-layer-freq", "the MoE layers", _moe_layers, _moe_of,
                  lambda flags: _period_shown(flags, lambda layer, n: layer % n == 0)),
    ModelArgument("--mtp-num-layers", "mtp_blocks", _integer, _field("mtp_blocks")),
    ModelArgument("--hybrid-override-pattern", "layer_pattern.symbols", _word, _hybrid_pattern_of),
    ModelArgument("--mamba-num-heads", "mamba.heads", _integer, _field("mamba.heads")),
    ModelArgument("--mamba-head-dim", "mamba.head_dim", _integer, _field("mamba.head_dim")),
    ModelArgument("--mamba-state-dim", "mamba.state_size", _integer, _field("mamba.state_size")),
    ModelArgument("--mamba-num-groups", "mamba.groups", _integer, _field("mamba.groups")),
)
MODEL_FLAGS = frozenset(argument.flag for argument in ARGUMENTS)
SEQUENCE_FLAG, BRIDGE_FLAG = SEQUENCE.flag, "--megatron-to-hf-mode"
# Every flag the check reads (Recipe.argument), whichever lever's factory runs it.
CHECKED_FLAGS = MODEL_FLAGS | {SEQUENCE_FLAG, BRIDGE_FLAG}


def _same(recipe_value: Any, facts_value: Any) -> bool:
    numbers = (int, float)
    if isinstance(recipe_value, numbers) and isinstance(facts_value, numbers) \
            and not isinstance(recipe_value, bool) and not isinstance(facts_value, bool):
        return math.isclose(recipe_value, facts_value, rel_tol=1e-6)
    return recipe_value == facts_value


def _shown_values(argument: ModelArgument, values: tuple[Any, ...]) -> str:
    return " or ".join(argument.shown(value) for value in values)


def _compare(recipe: Any, facts: Any, argument: ModelArgument, words: list[str]) -> bool:
    """Whether the flag was compared (False: the facts do not state it); RecipeError where it
    contradicts them or is malformed."""
    allowed = argument.facts_values(facts)
    if allowed is None:
        return False
    written = " ".join([argument.flag, *words])
    try:
        value = argument.recipe_value(words, facts.layers)
    except ValueError as error:
        detail = str(error) if " " in str(error) else "is malformed"
        raise ModelArgumentError(f"recipe {recipe.id}: {written} in its run script {detail}") from None
    if not any(_same(value, fact) for fact in allowed):
        raise ModelArgumentError(f"recipe {recipe.id}: {written} in its run script, but the model facts ({facts.source})"
                          f" say {argument.fact} {_shown_values(argument, allowed)}")
    return True


def _sequence_checked(recipe: Any) -> bool:
    """--seq-length against the recipe's own workload.row_tokens (correctness.recipe_arguments'
    pair): a row longer than the sequence Megatron is told would not fit it."""
    if recipe.argument(SEQUENCE_FLAG) is None:
        return False
    problem = disagreement(SEQUENCE, recipe.data, recipe.arguments, recipe.id)
    if problem is not None:
        raise ModelArgumentError(problem)
    return True


def _unchecked(recipe: Any, shown: set[str]) -> str | None:
    """Why some or all model arguments could not be compared; None where the script hides none."""
    hidden = recipe.hidden_arguments
    if hidden:
        quoted = ", ".join(f'"{word}"' for word in hidden)
        return f"the run script passes {quoted}, whose arguments it does not show"
    if shown:
        return None
    if recipe.argument(BRIDGE_FLAG) == ["bridge"]:
        return ("the run script passes no model arguments: --megatron-to-hf-mode bridge builds the model from its"
                " Hugging Face config")
    return "the run script passes no model arguments"


def compared_arguments(recipe: Any, facts: Any) -> ModelArgumentCheck:
    """Compare the recipe's (correctness.recipes.Recipe) model arguments with the model facts
    (correctness.models.ModelFacts); RecipeError in one line on the first that disagrees."""
    if "run" not in recipe.data:
        return ModelArgumentCheck(checked=(), unchecked="the recipe has no run script")
    arguments = recipe.arguments
    checked = [argument.flag for argument in ARGUMENTS
               if argument.flag in arguments and _compare(recipe, facts, argument, recipe.argument(argument.flag))]
    if _sequence_checked(recipe):
        checked.append(SEQUENCE_FLAG)
    order = list(arguments)
    return ModelArgumentCheck(checked=tuple(sorted(checked, key=order.index)),
                              unchecked=_unchecked(recipe, MODEL_FLAGS & set(arguments)))


def check_model_arguments(recipe: Any, facts: Any) -> ModelArgumentCheck:
    """compared_arguments, once per recipe and facts: kept with the recipe (Recipe.model_argument_checks)."""
    checks = recipe.model_argument_checks
    kept = checks.get(id(facts))
    if kept is None or kept[0] is not facts:
        kept = checks[id(facts)] = (facts, compared_arguments(recipe, facts))
    return kept[1]
