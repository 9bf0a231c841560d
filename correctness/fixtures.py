"""Where the project's data files are: recipes and model facts under fixtures/, and the component
tests that `correctness run` runs.

In a checkout they are the folders fixtures/ and component_tests/ beside correctness/. Installed
(a wheel), they are the packages correctness_fixtures and correctness_component_tests, which
pyproject.toml maps onto those two folders; an editable install maps them onto the checkout's
folders. Each is found through importlib, and in the checkout layout where it is not installed.
"""

import importlib.util
from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parent.parent


def _folder(package: str, checkout_name: str) -> Path:
    """The folder of `package` (found without importing it), or the checkout's `checkout_name`."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        if spec.submodule_search_locations:  # a package, with or without __init__.py
            for location in spec.submodule_search_locations:
                if Path(location).is_dir():
                    return Path(location).resolve()
        if spec.origin and spec.origin not in ("namespace", "built-in", "frozen"):
            return Path(spec.origin).resolve().parent
    return _CHECKOUT / checkout_name


FIXTURES_DIR = _folder("correctness_fixtures", "fixtures")
RECIPES_DIR = FIXTURES_DIR / "recipes"
MODELS_DIR = FIXTURES_DIR / "models"
CONFIGS_DIR = FIXTURES_DIR / "configs"
COMPONENT_TESTS_DIR = _folder("correctness_component_tests", "component_tests")


def checkout_root() -> Path | None:
    """The checkout the component tests lie in (their folder's parent, holding pyproject.toml and
    fixtures/), or None where they were installed from a wheel."""
    root = COMPONENT_TESTS_DIR.parent
    if COMPONENT_TESTS_DIR.name == "component_tests" and (root / "pyproject.toml").is_file() and (root / "fixtures").is_dir():
        return root
    return None


def recipe_path(recipe_id: str) -> Path:
    """fixtures/recipes/<recipe_id>.yaml, e.g. recipe_path("gemma-4-31b/h100/attune-tp2-pp4-split13")."""
    return RECIPES_DIR / f"{recipe_id}.yaml"
