"""The seed recipes and their model facts, shared by the unit tests; the toy lever's spec found by
the registry (tests/toy_records.py)."""

import shutil

import pytest

import correctness.registry

from correctness.fixtures import recipe_path
from correctness.models import load_model
from correctness.recipes import load_recipe

GEMMA_RECIPE = "gemma-4-31b/h100/attune-tp2-pp4-split13"
NEMOTRON_RECIPE = "nemotron-3-super-120b-a12b/h200/attune-tp4-pp2-ep8-mt16k"


@pytest.fixture
def gemma_copy(tmp_path):
    """A copy of the Gemma seed recipe to attach to."""
    path = tmp_path / "gemma.yaml"
    shutil.copy(recipe_path(GEMMA_RECIPE), path)
    return path


@pytest.fixture(scope="session")
def gemma_recipe():
    return load_recipe(recipe_path(GEMMA_RECIPE))


@pytest.fixture(scope="session")
def nemotron_recipe():
    return load_recipe(recipe_path(NEMOTRON_RECIPE))


@pytest.fixture(scope="session")
def gemma(gemma_recipe):
    return load_model(gemma_recipe.model)


@pytest.fixture(scope="session")
def nemotron(nemotron_recipe):
    return load_model(nemotron_recipe.model)


@pytest.fixture(autouse=True)
def toy_levers_known(monkeypatch):
    """The registry finds the toy lever's spec (tests/toy_records.py) beside this suite's levers."""
    from toy_records import known_toy

    suite = correctness.registry.known_lever
    monkeypatch.setattr(correctness.registry, "known_lever", lambda name: known_toy(name) or suite(name))
