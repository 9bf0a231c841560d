"""The README's example lever is complete and runs from outside this repository."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "component_tests" / "test_rmsnorm.py"


def test_readme_shows_the_example_verbatim():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.DOTALL)
    assert EXAMPLE.read_text() in blocks


def test_example_lever_runs_outside_the_repository(tmp_path):
    project = tmp_path / "another-project"
    (project / "component_tests").mkdir(parents=True)
    shutil.copy(EXAMPLE, project / "component_tests" / EXAMPLE.name)
    shutil.copy(ROOT / "examples" / "conftest.py", project / "conftest.py")
    (project / "pytest.ini").write_text("[pytest]\naddopts = --strict-markers -p no:cacheprovider\n")
    results = tmp_path / "results"
    finished = subprocess.run(
        [sys.executable, "-m", "pytest", "component_tests", "-k", "sliding and seed0", "--results-dir", str(results)],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert "lever verdicts" in finished.stdout
    (record_path,) = results.rglob("rmsnorm-kernel--cpu--torch-rms-norm.json")
    record = json.loads(record_path.read_text())
    assert record["verdict"] == "incomplete"  # one case of four ran (-k): the record says so
    assert len(record["completeness"]["missing"]) == 3
    (case,) = record["cases"]
    assert case["status"] == "pass"
    assert all(control["fails_bound"] for control in case["controls"])
