"""A recipe's CPU optimizer offload at one scale, as the Adam levers take it: its optimizer
settings, the parameter slices (TP rank 0's, and EP rank 0's, of the first layer of each layer kind
and of the embedding's first EMBEDDING_ROWS rows, as the Gemma recipe's component test takes them)
and Megatron's CPU/GPU split of them at the recipe's fraction."""

from collections.abc import Mapping
from dataclasses import dataclass

from correctness.adam.config import OptimizerConfig, optimizer_config
from correctness.adam.split import offload_split
from correctness.lever import LeverOptions, NotApplicable
from correctness.megatron.layout import ParamScale, ParamSlice, first_layer_of_each_kind, param_slices
from correctness.models import ModelFacts, facts_for
from correctness.recipes import Recipe, lever_recipe

EMBEDDING_ROWS = 8192  # the Gemma recipe's component test slices embedding rows 0-8,191
TP_RANK = 0
EP_RANK = 0


def recipe_slices(recipe: Recipe, model: ModelFacts, scale: ParamScale) -> tuple[ParamSlice, ...]:
    """TP rank 0 (and EP rank 0)'s slices of the first layer of every layer kind and of the embedding."""
    return param_slices(
        model, tp=recipe.tp, tp_rank=TP_RANK, layers=first_layer_of_each_kind(model),
        embedding_rows=EMBEDDING_ROWS, scale=scale,
        ep=recipe.positive_int("layout.ep"), ep_rank=EP_RANK, etp=recipe.positive_int("layout.etp"),
    )


@dataclass(frozen=True, kw_only=True)
class OffloadSetting:
    """A recipe's offload lever at one scale: its optimizer settings, slices and their split."""

    recipe: Recipe
    model: ModelFacts
    scale: ParamScale
    config: OptimizerConfig
    slices: tuple[ParamSlice, ...]
    shares: Mapping[str, str]

    @property
    def fraction(self) -> float:
        return self.config.offload_fraction


def offload_setting(recipe_id: str, scale: ParamScale, options: LeverOptions) -> OffloadSetting:
    recipe = lever_recipe(recipe_id, options.recipe)
    if recipe.argument("--optimizer-cpu-offload") is None:
        raise NotApplicable(f"recipe {recipe.id} does not offload the optimizer (no --optimizer-cpu-offload)")
    model = facts_for(recipe, options.model)
    config = optimizer_config(recipe)
    slices = recipe_slices(recipe, model, scale)
    return OffloadSetting(
        recipe=recipe, model=model, scale=scale, config=config, slices=slices,
        shares=offload_split(slices, config.offload_fraction),
    )
