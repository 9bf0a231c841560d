"""The recipes' parameter slices the optimizer tests share: Gemma-4-31B's TP 2 slices of a sliding
and a global layer, and Nemotron-3-Super's TP 4 / EP 8 slices of the first layer of each kind."""

from correctness.megatron.layout import RECIPE, first_layer_of_each_kind, param_slices

LAYERS = (0, 5)  # a sliding layer and a global one
EMBEDDING_ROWS = 8192
EMBEDDING = "embedding.word_embeddings.weight"


def recipe_slices(gemma_recipe, gemma, scale=RECIPE, tp_rank=0):
    return param_slices(gemma, tp=gemma_recipe.tp, tp_rank=tp_rank, layers=LAYERS, embedding_rows=EMBEDDING_ROWS, scale=scale)


def nemotron_slices(gemma_recipe, model, scale=RECIPE, **changes):
    arguments = {
        "tp": gemma_recipe.tp, "tp_rank": 0, "ep": gemma_recipe.field("layout.ep"), "ep_rank": 0,
        "etp": gemma_recipe.field("layout.etp"), "layers": first_layer_of_each_kind(model),
        "embedding_rows": EMBEDDING_ROWS, "scale": scale, **changes,
    }
    return param_slices(model, **arguments)
