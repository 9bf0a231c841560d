"""What a recipe says its attention runs, per layer kind: the backend its TE tier must see run.

Where the recipe forces a TE backend (`--attention-backend flash|fused|unfused`), that is the
claim for every layer kind. Where it leaves the choice to TE (`auto`), the claim is what the recipe
says in words, kept as data in `fixtures/claims/<recipe id>.yaml`: the recipe field it quotes, the
quote (which must still stand in that field), and the backend per layer kind. A recipe without
either makes no claim: its TE tier records what ran and checks nothing more.
"""

from collections.abc import Mapping

import yaml

from correctness.attention.te import te_backend_name
from correctness.errors import RecipeError
from correctness.fixtures import FIXTURES_DIR
from correctness.models import ModelFacts
from correctness.recipes import Recipe

CLAIMS_DIR = FIXTURES_DIR / "claims"
TE_BACKENDS = ("flash", "fused", "unfused")


def _claims_file(recipe: Recipe, model: ModelFacts) -> dict[str, str]:
    path = CLAIMS_DIR / f"{recipe.id}.yaml"
    if not path.is_file():
        return {}
    where = f"claims file {path}"
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise RecipeError(f"{where}: cannot be read ({type(error).__name__})") from None
    if not isinstance(data, dict) or not isinstance(data.get("attention_backend"), Mapping):
        raise RecipeError(f"{where}: needs a mapping attention_backend (layer kind: backend)")
    text = recipe.field(str(data.get("source")))
    if not isinstance(text, str) or str(data.get("quote")) not in text:
        raise RecipeError(f"{where}: its quote no longer stands in the recipe's {data.get('source')}")
    claims = {str(kind): str(backend) for kind, backend in data["attention_backend"].items()}
    unknown_kinds = sorted(set(claims) - set(model.attention_kinds))
    if unknown_kinds:
        raise RecipeError(f"{where}: layer kinds {unknown_kinds} are not {model.short_name}'s {list(model.attention_kinds)}")
    unknown = sorted(backend for backend in claims.values() if backend not in TE_BACKENDS)
    if unknown:
        raise RecipeError(f"{where}: backends {unknown} are not TE's {list(TE_BACKENDS)}")
    return claims


def expected_te_backends(recipe: Recipe, model: ModelFacts) -> dict[str, str]:
    """Layer kind -> the TE backend the recipe says runs there, as the TE path names it."""
    forced = recipe.argument("--attention-backend")
    if forced and forced[0] in TE_BACKENDS:
        claims = {kind: forced[0] for kind in model.attention_kinds}
    else:
        claims = _claims_file(recipe, model)
    return {kind: te_backend_name(backend) for kind, backend in claims.items()}
