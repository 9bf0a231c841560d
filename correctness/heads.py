"""The attention heads one TP rank holds, read from a recipe and its model facts: the query heads,
key-value groups and head dims of one attention kind as Megatron splits them over TP. The lever
kinds that shape attention's tensors (attention, RoPE) read it here; it imports no lever kind."""

from dataclasses import dataclass

from correctness.errors import ShapeError
from correctness.model_config import same_model
from correctness.models import AttentionKind, ModelFacts
from correctness.recipes import Recipe


@dataclass(frozen=True, kw_only=True)
class RankHeads:
    """One attention kind's heads at one TP rank (`facts`: the kind as the whole model has it)."""

    facts: AttentionKind
    heads: int  # query heads at the rank
    groups: int  # key-value groups at the rank
    head_dim: int
    v_head_dim: int


def rank_heads(
    recipe: Recipe, model: ModelFacts, kind: str, kv_groups: int | None = None, tp_rank: int = 0
) -> RankHeads:
    """The rank's heads of attention kind `kind`; `kv_groups` keeps at most that many key-value
    groups (the rank's query heads per group unchanged), None the rank's own."""
    if not same_model(recipe.model, model.name):
        raise ShapeError(f"recipe {recipe.id} is for {recipe.model}, not {model.name}")
    facts = model.attention_kind(kind)
    tp = recipe.tp
    if not 0 <= tp_rank < tp:
        raise ShapeError(f"recipe {recipe.id}: TP rank {tp_rank} outside 0..{tp - 1}")
    if facts.query_heads % tp or (facts.kv_heads % tp and tp % facts.kv_heads):
        raise ShapeError(
            f"{model.name} {kind} attention: {facts.query_heads} query heads and {facts.kv_heads} key-value heads"
            f" do not split over TP {tp}"
        )
    # Fewer key-value heads than TP ranks (Nemotron-3: 2 over TP 4): Megatron's attention.py gives each
    # rank one group, the rank's own query heads attending it (megatron-core 0.16, the
    # num_query_groups < world_size branch).
    rank_groups = max(facts.kv_heads // tp, 1)
    gqa_ratio = facts.query_heads // tp // rank_groups
    groups = rank_groups if kv_groups is None else min(rank_groups, kv_groups)
    return RankHeads(
        facts=facts, heads=groups * gqa_ratio, groups=groups, head_dim=facts.head_dim, v_head_dim=facts.v_head_dim
    )
