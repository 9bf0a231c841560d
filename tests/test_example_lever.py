"""The example lever of docs/adding-a-lever.md is complete and runs from outside this repository."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "component_tests" / "test_rmsnorm.py"


def test_the_guide_shows_the_example_verbatim():
    guide = (ROOT / "docs" / "adding-a-lever.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", guide, flags=re.DOTALL)
    assert EXAMPLE.read_text() in blocks


def test_the_guide_shows_a_real_levers_spec_verbatim():
    guide = (ROOT / "docs" / "adding-a-lever.md").read_text()
    spec = next(block for block in re.findall(r"```python\n(.*?)```", guide, flags=re.DOTALL)
                if block.startswith("SPEC = LeverSpec("))
    assert (ROOT / "correctness" / "rope" / "lever.py").read_text().endswith(spec)


def another_project(tmp_path: Path) -> Path:
    project = tmp_path / "another-project"
    (project / "component_tests").mkdir(parents=True)
    shutil.copy(EXAMPLE, project / "component_tests" / EXAMPLE.name)
    shutil.copy(ROOT / "examples" / "conftest.py", project / "conftest.py")
    (project / "pytest.ini").write_text("[pytest]\naddopts = --strict-markers -p no:cacheprovider\n")
    return project


def run_example(project: Path, *arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "component_tests", *arguments], cwd=project,
                          capture_output=True, text=True, timeout=300)


def test_example_lever_runs_outside_the_repository(tmp_path):
    results = tmp_path / "results"
    finished = run_example(another_project(tmp_path), "-k", "sliding and seed0", "--results-dir", str(results))
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert "lever verdicts" in finished.stdout
    (record_path,) = results.rglob("rmsnorm-kernel--cpu--torch-rms-norm.json")
    record = json.loads(record_path.read_text())
    assert record["verdict"] == "incomplete"  # one case of four ran (-k): the record says so
    assert len(record["completeness"]["missing"]) == 3
    (case,) = record["cases"]
    assert case["status"] == "pass"
    assert all(control["fails_bound"] for control in case["controls"])


def test_example_lever_takes_the_users_recipe_and_model_config(tmp_path):
    """The in-tree pattern: --recipe runs the user's recipe in the fixture's place, --model-config
    gives its model's facts, and the record carries both."""
    recipe = ROOT / "fixtures" / "recipes" / "gemma-4-31b" / "h100" / "attune-tp2-pp4-split13.yaml"
    users = tmp_path / "my-recipe.yaml"
    shutil.copy(recipe, users)
    config = ROOT / "fixtures" / "configs" / "Gemma-4-31B" / "config.json"
    results = tmp_path / "results"
    finished = run_example(another_project(tmp_path), "-k", "global and seed1", "--results-dir", str(results),
                           "--recipe", str(users), "--model-config", str(config))
    assert finished.returncode == 0, finished.stdout + finished.stderr
    (record_path,) = results.rglob("rmsnorm-kernel--cpu--torch-rms-norm.json")
    record = json.loads(record_path.read_text())
    assert record["recipe"]["path"] == str(users.resolve())
    assert record["recipe"]["model_facts"].endswith("Gemma-4-31B/config.json")
    (case,) = record["cases"]
    assert case["status"] == "pass"
