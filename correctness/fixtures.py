"""Where the project's data files are: recipes and model facts under fixtures/."""

from pathlib import Path

FIXTURES_DIR = Path(__file__).resolve().parent.parent / "fixtures"
RECIPES_DIR = FIXTURES_DIR / "recipes"
MODELS_DIR = FIXTURES_DIR / "models"


def recipe_path(recipe_id: str) -> Path:
    """fixtures/recipes/<recipe_id>.yaml, e.g. recipe_path("gemma-4-31b/h100/attune-tp2-pp4-split13")."""
    return RECIPES_DIR / f"{recipe_id}.yaml"
