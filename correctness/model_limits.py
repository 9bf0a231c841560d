"""How large a model's and a recipe's sizes may be: ten times the largest published value of each.

Sizes are input: a facts file, a config.json or a recipe with `hidden_size: 2**40` or
`row_tokens: 2**30` would have the levers allocate terabytes, and `num_hidden_layers: 1e7` would
have them walk ten million layers. Every size the levers read is held to LIMITS, the largest value
a published model has (the model named beside it) times HEADROOM, so that no real model comes near
it and no absurd one gets past it; a value over it, or not a positive integer, is refused in one
line naming the field and the limit. Numbers that are no size (RoPE bases, scales, softcaps) must be
finite and positive.
"""

import math
from typing import Any

from correctness.errors import RecipeError

HEADROOM = 10

# dimension -> (the largest published value, the model that has it)
LARGEST: dict[str, tuple[int, str]] = {
    "layers": (126, "Llama-3.1-405B"),
    "hidden size": (16_384, "Llama-3.1-405B"),
    "FFN size": (53_248, "Llama-3.1-405B"),
    "attention heads": (128, "Llama-3.1-405B and DeepSeek-V3"),
    "key-value heads": (128, "DeepSeek-V3 (MLA's up-projected heads)"),
    "head dim": (512, "Gemma-4-31B's global layers"),
    "vocabulary": (262_144, "Gemma 3 and Gemma 4"),
    "experts": (512, "Nemotron-3-Super-120B-A12B"),
    "experts per token": (22, "Nemotron-3-Super-120B-A12B"),
    "expert FFN size": (16_384, "Mixtral-8x22B"),
    "MoE latent size": (1_024, "Nemotron-3-Super-120B-A12B"),
    "MLA rank": (1_536, "DeepSeek-V3's q_lora_rank"),
    "context tokens": (10_485_760, "Llama 4 Scout's 10M context"),
    "MTP blocks": (1, "DeepSeek-V3"),
    "Mamba heads": (128, "Nemotron-3-Super-120B-A12B"),
    "Mamba head dim": (64, "Nemotron-H"),
    "Mamba state size": (256, "Nemotron-H-56B"),
    "Mamba groups": (8, "Nemotron-H"),
    "Mamba convolution width": (4, "Mamba-2 and Nemotron-H"),
}


def limit_of(dimension: str) -> int:
    """The largest value a size of this dimension may take."""
    return HEADROOM * LARGEST[dimension][0]


def _limit_text(dimension: str) -> str:
    largest, model = LARGEST[dimension]
    return f"{limit_of(dimension):,} ({HEADROOM} x the {largest:,} of {model})"


def checked_size(value: Any, dimension: str, owner: str, field: str, *, minimum: int = 1) -> int:
    """`value` where it is an integer from `minimum` to the dimension's limit, else RecipeError
    naming `owner`, the field and the limit."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer of at least {minimum}"
        raise RecipeError(f"{owner}: field {field} must be {what} ({dimension}), got {value!r}")
    if value > limit_of(dimension):
        raise RecipeError(f"{owner}: field {field} is {value:,}, over the suite's limit for {dimension},"
                          f" {_limit_text(dimension)}")
    return value


def number_problem(value: Any, *, at_most: float = math.inf, zero: bool = False) -> str | None:
    """Why `value` is not a finite number above zero (or zero, where `zero`) and at most `at_most`,
    as "must be ..., got ..."; None where it is one."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if number and math.isfinite(value) and (value > 0 or (zero and value == 0)) and value <= at_most:
        return None
    low = "0" if zero else "above 0"
    high = "" if at_most == math.inf else f" and at most {at_most:g}"
    return f"must be a finite number {low}{high}, got {value!r}"


def checked_number(value: Any, owner: str, field: str, *, at_most: float = math.inf, zero: bool = False) -> float:
    """`value` where it is a finite number above zero (or zero, where `zero`) and at most `at_most`,
    else RecipeError naming `owner` and the field."""
    problem = number_problem(value, at_most=at_most, zero=zero)
    if problem is not None:
        raise RecipeError(f"{owner}: field {field} {problem}")
    return float(value)
