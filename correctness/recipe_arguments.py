"""A recipe's own fields held to its run script's arguments for them.

A recipe states its layout and workload twice: as fields (`layout.tp: 2`, `workload.precision:
bf16`), which the levers build their cases from, and in its run script (`--tensor-model-parallel-size
2`, `--bf16`), which is what Megatron runs. Where the two disagree the levers would pass at a layout
the recipe never trains, so every pair of AGREEMENTS whose field and flag are both given must agree,
and the recipe's GPUs (layout.tp x pp x cp x dp) must be the script's (--actor-num-nodes x
--actor-num-gpus-per-node) and no more than its gpu.count. A disagreement is a RecipeError in one
line naming the recipe, the field, the flag and both values.

A flag the script does not give is not compared: each pair says what Megatron (or miles) runs
without it, but a script may pass it unseen (an array expansion such as "${MODEL_ARGS[@]}"), so the
default is not assumed, as correctness.model_arguments does not assume one. A null field is
compared only where the pair says what null states (layout.layer_split null: Megatron's even split,
which a given --decoder-first-pipeline-num-layers contradicts); elsewhere null says nothing.

A flag given twice with different values is refused too: Megatron's parser would take the last
one silently, which is never what a recipe meant. The same value twice is harmless.

`check_recipe_arguments` runs where a recipe is validated (correctness.recipes.validate_recipe:
`correctness run`, `check`, `attach`) and where pytest is given a recipe (`--recipe`).
"""

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from correctness.errors import RecipeError

Arguments = Mapping[str, list[list[str]]]  # flag -> its words, once per occurrence (recipes.training_arguments)
DYNAMIC_BATCH = "--use-dynamic-batch-size"
_MISSING = object()


# A flag's words as the value its field states (ValueError: malformed).

def _one(words: list[str]) -> str:
    if len(words) != 1:
        raise ValueError("takes one value")
    return words[0]


def _integer(words: list[str]) -> int:
    try:
        return int(_one(words))
    except ValueError:
        raise ValueError("takes one integer") from None


def _number(words: list[str]) -> float:
    try:
        value = float(_one(words))
    except ValueError:
        raise ValueError("takes one number") from None
    if not math.isfinite(value):
        raise ValueError("takes a finite number")
    return value


def _word(words: list[str]) -> str:
    return _one(words)


def _switch(words: list[str]) -> bool:
    if words:
        raise ValueError("takes no value")
    return True


def _same(field_value: Any, flag_value: Any) -> bool:
    numbers = (int, float)
    if isinstance(field_value, bool) or isinstance(flag_value, bool):
        return field_value is flag_value
    if isinstance(field_value, numbers) and isinstance(flag_value, numbers):
        return math.isclose(field_value, flag_value, rel_tol=1e-9)
    return field_value == flag_value


def _precision(*formats: str) -> Callable[[Any, Any], bool]:
    """--bf16 / --fp16 agree with the precision they name, and with fp8 (FP8 training on top of it)."""
    return lambda field_value, given: field_value in formats


def _at_least(field_value: Any, flag_value: Any) -> bool:
    return isinstance(field_value, int) and flag_value >= field_value


def _with_dynamic_batch(arguments: Arguments) -> bool:
    return DYNAMIC_BATCH in arguments


def _without_dynamic_batch(arguments: Arguments) -> bool:
    return DYNAMIC_BATCH not in arguments


@dataclass(frozen=True)
class FieldArgument:
    """One recipe field and the run script's flag that says the same thing.

    `value(words)`: the flag's words as the field's value; `default`: what runs without the flag
    (not assumed, see the module's docstring); `agrees(field value, flag value)`; `null`: what a
    null field states, which any given flag contradicts (None: a null field is not compared);
    `applies(arguments)`: where the pair means the same thing (miles reads --micro-batch-size only
    without dynamic batching, --max-tokens-per-gpu only with it)."""

    field: str
    flag: str
    value: Callable[[list[str]], Any]
    default: str
    agrees: Callable[[Any, Any], bool] = _same
    null: str | None = None
    applies: Callable[[Arguments], bool] | None = None
    relation: str = ""  # how a disagreement reads where agreeing is not equality


SEQUENCE = FieldArgument("workload.row_tokens", "--seq-length", _integer, "Megatron's required --seq-length",
                         agrees=_at_least, relation="shorter than a row")

AGREEMENTS: tuple[FieldArgument, ...] = (
    FieldArgument("layout.tp", "--tensor-model-parallel-size", _integer, "1"),
    FieldArgument("layout.pp", "--pipeline-model-parallel-size", _integer, "1"),
    FieldArgument("layout.vpp", "--virtual-pipeline-model-parallel-size", _integer, "1 (no interleaving)"),
    FieldArgument("layout.cp", "--context-parallel-size", _integer, "1"),
    FieldArgument("layout.ep", "--expert-model-parallel-size", _integer, "1"),
    FieldArgument("layout.etp", "--expert-tensor-parallel-size", _integer, "the TP size"),
    FieldArgument("layout.sequence_parallel", "--sequence-parallel", _switch, "off"),
    FieldArgument("layout.layer_split.first", "--decoder-first-pipeline-num-layers", _integer, "an even split",
                  null="null (Megatron's even split)"),
    FieldArgument("layout.layer_split.last", "--decoder-last-pipeline-num-layers", _integer, "an even split",
                  null="null (Megatron's even split)"),
    FieldArgument("layout.rows_per_microbatch", "--micro-batch-size", _integer, "1",
                  applies=_without_dynamic_batch),
    FieldArgument("layout.max_tokens_per_gpu", "--max-tokens-per-gpu", _integer, "none (miles)",
                  applies=_with_dynamic_batch),
    FieldArgument("layout.recompute.granularity", "--recompute-granularity", _word, "no recompute",
                  null="null (no recompute)"),
    FieldArgument("layout.recompute.method", "--recompute-method", _word, "none", null="null (no recompute method)"),
    FieldArgument("layout.recompute.num_layers", "--recompute-num-layers", _integer, "1",
                  null="null (no recompute layer count)"),
    FieldArgument("layout.offload.optimizer_fraction", "--optimizer-offload-fraction", _number, "1.0"),
    FieldArgument("layout.offload.overlap_d2h_h2d", "--overlap-cpu-optimizer-d2h-h2d", _switch, "off"),
    FieldArgument("layout.dispatcher", "--moe-token-dispatcher-type", _word, "allgather"),
    FieldArgument("workload.global_batch", "--global-batch-size", _integer, "Megatron's required --global-batch-size"),
    FieldArgument("workload.precision", "--bf16", _switch, "FP32 (no --bf16 or --fp16)",
                  agrees=_precision("bf16", "fp8")),
    FieldArgument("workload.precision", "--fp16", _switch, "FP32 (no --bf16 or --fp16)",
                  agrees=_precision("fp16", "fp8")),
    SEQUENCE,
)
# The recipe's GPUs as its layout gives them and as its (miles) script launches them.
LAYOUT_GPUS = ("layout.tp", "layout.pp", "layout.cp", "layout.dp")
SCRIPT_GPUS = ("--actor-num-nodes", "--actor-num-gpus-per-node")


def _field(data: Any, dotted: str) -> Any:
    """The field's value; None where it or a mapping above it is null; _MISSING where absent."""
    value = data
    for key in dotted.split("."):
        if value is None:
            return None
        if not isinstance(value, dict) or key not in value:
            return _MISSING
        value = value[key]
    return value


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    return repr(value) if isinstance(value, str) and (not value or " " in value) else str(value)


def _written(flag: str, words: list[str]) -> str:
    return " ".join([flag, *words])


def _last(arguments: Arguments, flag: str) -> list[str] | None:
    occurrences = arguments.get(flag)
    return occurrences[-1] if occurrences else None


def repeated_flag(arguments: Arguments, name: str) -> str | None:
    """The first flag the script gives more than once with different values, as a refusal."""
    for flag, occurrences in arguments.items():
        values = list(dict.fromkeys(" ".join(words) for words in occurrences))
        if len(values) > 1:
            shown = ", then ".join(repr(value) if value else "no value" for value in values)
            return (f"recipe {name}: its run script gives {flag} {len(occurrences)} times with different values"
                    f" ({shown}); Megatron's parser would take the last one silently: give it once")
    return None


def disagreement(pair: FieldArgument, data: Any, arguments: Arguments, name: str) -> str | None:
    """Why the recipe's field and its script's flag of `pair` disagree (one line), or None where they
    agree or either is not given."""
    words = _last(arguments, pair.flag)
    if words is None or (pair.applies is not None and not pair.applies(arguments)):
        return None
    field_value = _field(data, pair.field)
    if field_value is _MISSING or (field_value is None and pair.null is None):
        return None
    written = _written(pair.flag, words)
    if field_value is None:
        return f"recipe {name}: {pair.field} is {pair.null}, but its run script gives {written}"
    try:
        flag_value = pair.value(words)
    except ValueError as error:  # the parsers' own words: "takes one integer"
        return f"recipe {name}: {written} in its run script is malformed: it {error} (as {pair.field})"
    if pair.agrees(field_value, flag_value):
        return None
    relation = f", {pair.relation}" if pair.relation else ""
    return f"recipe {name}: {pair.field} is {_shown(field_value)}, but its run script gives {written}{relation}"


def _gpu_count(data: Any, fields: tuple[str, ...]) -> int | None:
    values = [_field(data, field) for field in fields]
    if not all(isinstance(value, int) and not isinstance(value, bool) and value > 0 for value in values):
        return None
    return math.prod(values)


def gpus_disagreement(data: Any, arguments: Arguments, name: str) -> str | None:
    """Where the layout's GPUs (tp x pp x cp x dp) are not the script's, or more than gpu.count."""
    layout = _gpu_count(data, LAYOUT_GPUS)
    if layout is None:
        return None
    product = " x ".join(field.removeprefix("layout.") for field in LAYOUT_GPUS)
    stated = f"layout.{product} is {layout} GPUs"
    count = _field(data, "gpu.count")
    if isinstance(count, int) and not isinstance(count, bool) and layout > count:
        return f"recipe {name}: {stated}, more than its gpu.count {count}"
    given = [_last(arguments, flag) for flag in SCRIPT_GPUS]
    if any(words is None for words in given):
        return None
    written = " ".join(_written(flag, words) for flag, words in zip(SCRIPT_GPUS, given))
    try:
        launched = math.prod(_integer(words) for words in given)
    except ValueError:
        return f"recipe {name}: {written} in its run script is malformed (each takes one integer)"
    if launched != layout:
        return f"recipe {name}: {stated}, but its run script gives {written} ({launched} GPUs)"
    return None


def first_disagreement(data: Any, arguments: Arguments, name: str) -> str | None:
    """The first way the recipe's fields and its run script disagree (one line), or None."""
    problem = repeated_flag(arguments, name)
    for pair in AGREEMENTS:
        problem = problem or disagreement(pair, data, arguments, name)
    return problem or gpus_disagreement(data, arguments, name)


def check_recipe_arguments(data: Any, arguments: Arguments, name: str) -> None:
    """RecipeError (one line) where the recipe's fields and its run script's arguments disagree."""
    problem = first_disagreement(data, arguments, name)
    if problem is not None:
        raise RecipeError(problem)


def check_recipe(recipe: Any) -> Any:
    """check_recipe_arguments of a loaded recipe (correctness.recipes.Recipe); the recipe."""
    check_recipe_arguments(recipe.data, recipe.arguments, recipe.id)
    return recipe
