"""Transformer Engine is optional: never imported at collection; its tests skip with a reason."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_collection_never_imports_transformer_engine(tmp_path):
    fake = tmp_path / "site" / "transformer_engine"
    fake.mkdir(parents=True)
    imported = tmp_path / "imported"
    (fake / "__init__.py").write_text(
        f"open({str(imported)!r}, 'w').close()\nraise RuntimeError('TransformerEngine needs CUDA.')\n"
    )
    finished = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "component_tests"],
        cwd=ROOT,
        env={"PYTHONPATH": str(fake.parent), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert "test_te_auto_against_te_unfused" in finished.stdout
    assert not imported.exists()


def test_h100_tests_skip_with_a_reason_on_this_machine():
    finished = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "h100", "-q", "-rs", "-p", "no:cacheprovider", "component_tests",
         "--results-dir", "/dev/null/never-written"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert "failed" not in finished.stdout and "error" not in finished.stdout.lower()
    assert "needs a CUDA GPU" in finished.stdout or "needs an NVIDIA H100" in finished.stdout
