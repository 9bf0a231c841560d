"""Rank-local shapes derived from a recipe and its model facts, at a named scale.

The recipe scale is the shape one GPU of the recipe sees. The smoke scale keeps what can go wrong
visible on a CPU: the same head dims, GQA ratio, softmax scale, window and layer kinds, with two
key-value groups; a windowed kind's sequence is its window and 256 tokens more (so that 256
queries see a full window with keys beyond its edge), the others' 768 tokens: more than one of the
512-key blocks torch's CPU flash kernel takes keys in, the last block partial, so that the online
softmax's rescaling between blocks and a ragged last block both run.
"""

from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from correctness.errors import ShapeError
from correctness.heads import rank_heads
from correctness.models import ModelFacts
from correctness.recipes import Recipe
from correctness.shapes import DTYPES, RECIPE_SCALE, Scale, qkv_format, recipe_dtype



@dataclass(frozen=True, kw_only=True)
class AttentionShape:
    """Self-attention at one rank: BSHD tensors [batch, seq_len, heads, head_dim] (THD packs the
    batch's rows into one sequence of batch * seq_len tokens with cumulative lengths); V, the
    output and its gradient have v_head_dim."""

    model: str  # the model's short name
    layer_kind: str
    scale: str
    tp_size: int
    tp_rank: int
    batch: int
    seq_len: int
    heads: int
    groups: int
    head_dim: int
    window: tuple[int, int] | None  # Transformer Engine's inclusive (left, right); None: none
    causal: bool
    softmax_scale: float
    dtype: str
    qkv_format: str  # "bshd" or "thd"
    # THD only: the packed rows' cumulative lengths where they are not `batch` rows of `seq_len` each
    # (a control that moves a row boundary sets them).
    boundaries: tuple[int, ...] | None = None
    v_head_dim: int | None = None  # None: head_dim (set so when the shape is made)
    softcap: float | None = None  # logits -> softcap * tanh(logits / softcap), after the scale, before the mask
    sinks: bool = False  # a learned logit per query head in the softmax's denominator (the inputs carry them)

    def __post_init__(self):
        if self.v_head_dim is None:
            object.__setattr__(self, "v_head_dim", self.head_dim)
        if self.softcap is not None and not self.softcap > 0:
            raise ShapeError(f"attention shape {self.id}: softcap {self.softcap} must be positive")
        if self.heads % self.groups:
            raise ShapeError(f"attention shape {self.id}: {self.heads} heads do not divide into {self.groups} groups")
        if self.qkv_format not in ("bshd", "thd"):
            raise ShapeError(f"attention shape: unknown qkv_format {self.qkv_format!r}")
        if self.dtype not in DTYPES:
            raise ShapeError(f"attention shape: unknown dtype {self.dtype!r} (known: {sorted(DTYPES)})")
        if self.boundaries is not None and (
            self.qkv_format != "thd"
            or self.boundaries[0] != 0
            or self.boundaries[-1] != self.batch * self.seq_len
            or list(self.boundaries) != sorted(self.boundaries)
        ):
            raise ShapeError(
                f"attention shape {self.id}: boundaries {self.boundaries} must rise from 0 to"
                f" {self.batch * self.seq_len} and need qkv_format thd"
            )

    @property
    def gqa_ratio(self) -> int:
        return self.heads // self.groups

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def cu_seqlens(self) -> tuple[int, ...] | None:
        """THD: cumulative row lengths over the packed tokens; None for BSHD."""
        if self.qkv_format != "thd":
            return None
        return self.boundaries or tuple(row * self.seq_len for row in range(self.batch + 1))

    @property
    def tokens(self) -> int:
        """Query positions per row (BSHD) or packed tokens in all (THD)."""
        return self.batch * self.seq_len if self.qkv_format == "thd" else self.seq_len

    @property
    def window_text(self) -> str:
        return "nowin" if self.window is None else f"w{self.window[0] + 1}"

    @property
    def id(self) -> str:
        """Readable and stable: gemma4-31b-sliding-s1280-h4-g2-d256-w1024-bf16; a value head dim of its
        own, a softcap and sinks add -dv128, -cap50 and -sink."""
        rows = "" if self.batch == 1 else f"-b{self.batch}{self.qkv_format}"
        value = "" if self.v_head_dim in (None, self.head_dim) else f"-dv{self.v_head_dim}"
        cap = "" if self.softcap is None else f"-cap{self.softcap:g}"
        return (
            f"{self.model}-{self.layer_kind}-s{self.seq_len}{rows}-h{self.heads}-g{self.groups}"
            f"-d{self.head_dim}{value}-{self.window_text}{cap}{'-sink' if self.sinks else ''}-{self.dtype}"
        )

    def with_changes(self, **changes: Any) -> "AttentionShape":
        return replace(self, **changes)

    def record(self) -> dict[str, Any]:
        return {"id": self.id, **asdict(self), "cu_seqlens": self.cu_seqlens}


def attention_shape(
    recipe: Recipe, model: ModelFacts, kind: str, scale: Scale = RECIPE_SCALE, tp_rank: int = 0
) -> AttentionShape:
    heads = rank_heads(recipe, model, kind, scale.kv_groups, tp_rank)
    facts = heads.facts
    seq_len = scale.seq_len or recipe.row_tokens
    if facts.window is not None and scale.past_window is not None:
        seq_len = facts.window + scale.past_window
    window = None if facts.window is None else (facts.window - 1, 0)
    if window is not None and seq_len <= facts.window:
        raise ShapeError(
            f"{scale.name} scale: sequence {seq_len} is not longer than the {kind} window {facts.window},"
            " so a wrong window would be invisible"
        )
    return AttentionShape(
        model=model.short_name,
        layer_kind=kind,
        scale=scale.name,
        tp_size=recipe.tp,
        tp_rank=tp_rank,
        batch=scale.rows or recipe.rows_per_microbatch,
        seq_len=seq_len,
        heads=heads.heads,
        groups=heads.groups,
        head_dim=heads.head_dim,
        v_head_dim=heads.v_head_dim,
        window=window,
        causal=True,
        softmax_scale=facts.softmax_scale,
        softcap=facts.logit_softcap,
        sinks=facts.sinks,
        dtype=recipe_dtype(recipe),
        qkv_format=qkv_format(recipe),
    )
