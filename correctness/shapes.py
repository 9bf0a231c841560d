"""The shape vocabulary every lever kind shares: the dtypes a recipe names (and its precision among
them), the scale a case runs at, and the recipe's attention layout (`--qkv-format`)."""

from dataclasses import dataclass

import torch

from correctness.errors import ShapeError
from correctness.recipes import Recipe

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True, kw_only=True)
class Scale:
    name: str
    kv_groups: int | None = None  # None: the recipe's rank-local groups
    seq_len: int | None = None  # None: the recipe's row_tokens
    # Windowed kinds: the sequence is the window and this many tokens more (None: seq_len as for the
    # others). Attention cost grows with the sequence squared: a window kind needs only to be longer
    # than its window, not as long as the longest sequence a case has.
    past_window: int | None = None
    rows: int | None = None  # None: the recipe's rows per microbatch


RECIPE_SCALE = Scale(name="recipe")
SMOKE_SCALE = Scale(name="smoke", kv_groups=2, seq_len=768, past_window=256, rows=1)


def qkv_format(recipe: Recipe) -> str:
    """The recipe's `--qkv-format`; without one, THD where miles packs rows (dynamic batch size)."""
    given = recipe.argument("--qkv-format")
    if given:
        return given[0]
    return "thd" if recipe.argument("--use-dynamic-batch-size") is not None else "bshd"


def recipe_dtype(recipe: Recipe) -> str:
    """The recipe's precision, one of DTYPES' names."""
    precision = recipe.precision
    if precision not in DTYPES:
        raise ShapeError(f"recipe {recipe.id}: precision {precision!r} is not one of {sorted(DTYPES)}")
    return precision
