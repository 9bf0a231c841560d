"""RoPE shapes from a recipe and its model facts: per attention kind with a rotary embedding, the
rank's query and key heads and head dim (correctness.heads.rank_heads, the derivation the
attention lever's shapes use too), the kind's rotary base and fraction, the recipe's RoPE
arguments, precision and token layout (BSHD rows, or THD: the recipe's rows packed with cumulative
lengths, as correctness/attention/thd_packing_lever.py packs them).

At the recipe scale a case is the recipe's microbatch: its rows of `row_tokens` positions from 0,
the rank's heads. The smoke scale (CPU) keeps one key-value group and SMOKE_POSITIONS positions
per row: BSHD rows take the last positions of the recipe's row (its largest angles; the same FP32
frequencies Megatron makes for those positions of a full row, Megatron's own `offset`), THD rows
start at position 0 as packed rows do.
"""

from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from correctness.errors import ShapeError
from correctness.heads import rank_heads
from correctness.shapes import DTYPES, qkv_format, recipe_dtype
from correctness.lever import NotApplicable
from correctness.models import ModelFacts
from correctness.recipes import Recipe

SMOKE_POSITIONS = 512
# The rank's key-value groups at each scale: its own at the recipe scale, one at the smoke scale.
KV_GROUPS_AT = {"recipe": None, "smoke": 1}
MEGATRON_ROPE_SCALING_FACTOR = 8.0  # Megatron-LM's --rope-scaling-factor default


@dataclass(frozen=True, kw_only=True)
class RopeShape:
    """q and k of one attention kind at one rank, as Megatron rotates them: BSHD tensors
    [positions, rows, heads, head_dim] (Megatron's sequence-first layout), THD [rows x positions,
    heads, head_dim] with cumulative lengths."""

    model: str
    layer_kind: str
    scale: str
    tp_size: int
    rows: int
    positions: int  # per row
    first_position: int  # of each BSHD row; THD rows start at 0
    row_tokens: int  # the recipe's
    heads: int  # query heads at the rank
    groups: int  # key heads at the rank
    head_dim: int
    rotary_dims: int  # Megatron's int(head_dim x rotary_percent)
    rotary_percent: float
    rotary_base: float
    interleaved: bool
    rope_scaling_factor: float | None  # Llama 3.x's (--use-rope-scaling); None: none
    interpolation_factor: float | None  # --rotary-seq-len-interpolation-factor
    dtype: str
    qkv_format: str  # "bshd" or "thd"
    boundaries: tuple[int, ...] | None = None  # THD: cumulative lengths where not `rows` rows of `positions`

    def __post_init__(self):
        if self.rotary_dims <= 0 or self.rotary_dims % 2 or self.rotary_dims > self.head_dim:
            raise ShapeError(f"rope shape {self.id}: {self.rotary_dims} rotary dims must be even and within head dim"
                             f" {self.head_dim}")
        if self.qkv_format not in ("bshd", "thd"):
            raise ShapeError(f"rope shape: unknown qkv_format {self.qkv_format!r}")
        if self.dtype not in DTYPES:
            raise ShapeError(f"rope shape: unknown dtype {self.dtype!r} (known: {sorted(DTYPES)})")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def cu_seqlens(self) -> tuple[int, ...] | None:
        if self.qkv_format != "thd":
            return None
        return self.boundaries or tuple(row * self.positions for row in range(self.rows + 1))

    @property
    def max_row(self) -> int:
        """The longest row: the positions Megatron's frequencies cover."""
        bounds = self.cu_seqlens
        return self.positions if bounds is None else max(b - a for a, b in zip(bounds, bounds[1:]))

    @property
    def formula_angles(self) -> bool:
        """Whether Megatron's frequencies are the plain formula's (no scaling, no interpolation)."""
        return self.rope_scaling_factor is None and self.interpolation_factor is None

    @property
    def id(self) -> str:
        layout = f"b{self.rows}{self.qkv_format}"
        start = f"-p{self.first_position}" if self.first_position else ""
        pairing = "-interleaved" if self.interleaved else ""
        return (f"{self.model}-{self.layer_kind}-rope-s{self.positions}{start}-{layout}-h{self.heads}-g{self.groups}"
                f"-d{self.head_dim}-r{self.rotary_dims}-base{self.rotary_base:g}{pairing}-{self.dtype}")

    def with_changes(self, **changes: Any) -> "RopeShape":
        return replace(self, **changes)

    def record(self) -> dict[str, Any]:
        return {"id": self.id, **asdict(self), "cu_seqlens": self.cu_seqlens}


def _number(recipe: Recipe, flag: str) -> float | None:
    given = recipe.argument(flag)
    if not given:
        return None
    try:
        return float(given[0])
    except ValueError:
        raise ShapeError(f"recipe {recipe.id}: {flag} {given[0]!r} is not a number") from None


def rope_kinds(recipe: Recipe, model: ModelFacts) -> tuple[str, ...]:
    """The model's attention kinds with a rotary embedding; NotApplicable where the recipe's
    attention has none the flag could change."""
    given = recipe.argument("--position-embedding-type")
    if given and given[0] != "rope":
        raise NotApplicable(f"recipe {recipe.id}: --position-embedding-type {given[0]}, no RoPE for --no-rope-fusion")
    if model.data.get("attention", {}).get("mla"):
        raise NotApplicable(
            f"{model.name}: multi-latent attention rotates its own RoPE head dims, and megatron-core 0.16 refuses"
            " apply_rope_fusion for MLA without YaRN (transformer_config.py); this lever models standard attention")
    kinds = tuple(kind for kind in model.attention_kinds
                  if model.field(f"attention.kinds.{kind}").get("rope_theta") is not None
                  and float(model.field(f"attention.kinds.{kind}").get("partial_rotary_factor", 1.0)) > 0)
    if not kinds:
        raise NotApplicable(f"{model.name}: its attention has no position embedding (rope_theta null,"
                            " partial_rotary_factor 0), so --no-rope-fusion changes nothing")
    return kinds


def rope_shape(recipe: Recipe, model: ModelFacts, kind: str, scale: str) -> RopeShape:
    if scale not in KV_GROUPS_AT:
        raise ShapeError(f"rope shape: unknown scale {scale!r} (known: {sorted(KV_GROUPS_AT)})")
    heads = rank_heads(recipe, model, kind, KV_GROUPS_AT[scale])
    dtype, layout = recipe_dtype(recipe), qkv_format(recipe)
    facts = model.field(f"attention.kinds.{kind}")
    percent = float(facts.get("partial_rotary_factor", 1.0))
    rotary_dims = int(heads.head_dim * percent) if percent < 1.0 else heads.head_dim  # RotaryEmbedding's
    scaling = recipe.argument("--use-rope-scaling") is not None
    factor = _number(recipe, "--rope-scaling-factor") if scaling else None
    positions = recipe.row_tokens if scale == "recipe" else min(SMOKE_POSITIONS, recipe.row_tokens)
    first = recipe.row_tokens - positions if layout == "bshd" else 0
    return RopeShape(
        model=model.short_name, layer_kind=kind, scale=scale, tp_size=recipe.tp, rows=recipe.rows_per_microbatch,
        positions=positions, first_position=first, row_tokens=recipe.row_tokens, heads=heads.heads,
        groups=heads.groups, head_dim=heads.head_dim, rotary_dims=rotary_dims, rotary_percent=percent,
        rotary_base=float(facts["rope_theta"]), interleaved=recipe.argument("--rotary-interleaved") is not None,
        rope_scaling_factor=(factor or MEGATRON_ROPE_SCALING_FACTOR) if scaling else None,
        interpolation_factor=_number(recipe, "--rotary-seq-len-interpolation-factor"),
        dtype=dtype, qkv_format=layout,
    )
