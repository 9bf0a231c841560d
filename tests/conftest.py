"""The seed recipes and their model facts, shared by the unit tests; the seeds' records and reports
made once per session; the toy lever's spec found by the registry (tests/toy_records.py); the unit
tests' time limit (tests/unit_time.py)."""

import fcntl
import os
import shutil
from pathlib import Path

import pytest

import correctness.registry

from correctness.fixtures import recipe_path
from correctness.models import load_model
from correctness.recipes import load_recipe
from unit_time import pytest_runtest_call, pytest_runtest_makereport  # noqa: F401 (the time limit's hooks)

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


def made_once(tmp_path_factory, name: str, make) -> Path:
    """A folder `make(folder)` fills once per pytest session: the first pytest-xdist worker to ask
    makes it, under a lock, in the temporary folder the workers share; the others wait for it and
    read the same folder (a session fixture alone runs once per worker). Where `make` fails, the
    next to ask tries again."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # pytest-of-<user>/pytest-<n>: the session's, above each worker's own
    folder, made = root / name, root / f"{name}.made"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not made.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            made.touch()
    return folder


@pytest.fixture(scope="session")
def seed_reports(tmp_path_factory) -> Path:
    """A results folder with the records and reports of a few component tests of each seed recipe
    (report_in_browser.SEED_RUNS), run once per session for every worker: the report's tests and
    the browser's read it (`correctness report` on it rewrites each recipe's report.html in place,
    atomically and from the same records)."""
    from report_in_browser import SEED_RUNS, run_component_tests

    def make(folder: Path) -> None:
        for recipe in SEED_RUNS:
            failed = run_component_tests(recipe, folder / "results")
            assert failed is None, failed

    return made_once(tmp_path_factory, "seed-reports", make) / "results"


@pytest.fixture(autouse=True)
def toy_levers_known(monkeypatch):
    """The registry finds the toy lever's spec (tests/toy_records.py) beside this suite's levers."""
    from toy_records import known_toy

    suite = correctness.registry.known_lever
    monkeypatch.setattr(correctness.registry, "known_lever", lambda name: known_toy(name) or suite(name))


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow(reason): a unit test allowed more than tests/unit_time.py's limit, for the reason given")
