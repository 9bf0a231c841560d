"""`correctness run` from an installed wheel, not from the checkout (the CI check of packaging).

The wheel is built from a copy of the checkout's packaged folders (no build/ or egg-info left in
the checkout), installed with `pip install --no-deps --target`, and run in a subprocess from a
folder outside the repository with `python -S`: the venv's site-packages (torch, pytest, ...) come
after the installed copy on PYTHONPATH, and the editable install's .pth finder is never loaded, so
nothing can come from the checkout. About 25 seconds.
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GEMMA = "gemma-4-31b/h100/attune-tp2-pp4-split13"
PACKAGED = ("pyproject.toml", "README.md", "correctness", "references", "fixtures", "component_tests")


def test_the_package_list_names_every_package():
    """pyproject.toml lists the packages (packages.find cannot add the mapped folders): a new
    subpackage of correctness/ or references/ must be added there, or the wheel would lack it."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    setuptools = pytest.importorskip("setuptools")
    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    found = setuptools.find_packages(str(ROOT), include=["correctness", "correctness.*", "references", "references.*"])
    assert sorted(set(found) - set(listed)) == []
    assert {"correctness_fixtures", "correctness_component_tests"} <= set(listed)


def _build_and_install(tmp_path: Path) -> Path:
    source = tmp_path / "source"
    for name in PACKAGED:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            source.mkdir(exist_ok=True)
            shutil.copy2(path, source / name)
    dist, target = tmp_path / "dist", tmp_path / "target"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    # The build needs only setuptools: without build isolation where it is installed (torch requires
    # it; no index to reach), else pip fetches it into an isolated build environment.
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") is not None else []
    built = subprocess.run([*pip, "wheel", "--no-deps", *isolation, "-q", "-w", str(dist), str(source)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout[-4000:] + built.stderr[-4000:]
    (wheel,) = dist.glob("recipe_correctness-*.whl")
    installed = subprocess.run([*pip, "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                               capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stdout[-4000:] + installed.stderr[-4000:]
    return target


@pytest.mark.slow(reason='builds and installs the wheel, then runs a lever from it')
def test_correctness_run_from_an_installed_wheel(tmp_path):
    target = _build_and_install(tmp_path)
    recipe = target / "correctness_fixtures" / "recipes" / f"{GEMMA}.yaml"
    assert recipe.is_file()
    assert sorted(p.name for p in (target / "correctness_component_tests").glob("test_*.py")) == sorted(
        p.name for p in (ROOT / "component_tests").glob("test_*.py"))

    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    site_packages = sysconfig.get_paths()["purelib"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), site_packages])}
    env.pop("PYTHONHOME", None)
    python = [sys.executable, "-S"]  # no site: the editable install's finder stays out

    probe = ("import json, correctness, correctness.fixtures as f, correctness.commands.run as r;"
             "print(json.dumps([correctness.__file__, str(f.FIXTURES_DIR), str(f.COMPONENT_TESTS_DIR),"
             " str(f.checkout_root()), str(r.default_results())]))")
    where = subprocess.run([*python, "-c", probe], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert where.returncode == 0, where.stderr
    module, fixtures, tests, checkout, results = json.loads(where.stdout)
    assert Path(module).is_relative_to(target), module
    assert Path(fixtures) == target / "correctness_fixtures"
    assert Path(tests) == target / "correctness_component_tests"
    assert checkout == "None"
    assert Path(results) == cwd / "results"

    config = target / "correctness_fixtures" / "configs" / "Llama-3.1-8B"
    facts = subprocess.run([*python, "-m", "correctness.cli", "model-facts", str(config)],
                           cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert facts.returncode == 0 and "name: Llama-3.1-8B" in facts.stdout, facts.stderr  # families.yaml shipped

    run = subprocess.run(
        [*python, "-m", "correctness.cli", "run", str(recipe), "--tier", "cpu", "--",
         "-k", "packed_loss or offload_fraction_cpu", "-p", "no:cacheprovider"],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
    )
    # The recipe needs the attention-backend lever too, deselected here: its verdict is incomplete.
    assert run.returncode == 1, run.stdout[-4000:] + run.stderr[-4000:]
    assert f"recipe {GEMMA}: INCOMPLETE" in run.stdout
    assert "correctness_fixtures/references/" in run.stdout  # judged against its reference, shipped in the wheel
    assert "-p correctness.pytest_plugin" in run.stdout
    records = list((cwd / "results").glob(f"{GEMMA}.*/*.json"))  # its folder: id and a hash of its path
    assert records, run.stdout[-4000:]
    for path in records:
        record = json.loads(path.read_text())
        assert str(record["verdict"]).lower() == "pass", path
