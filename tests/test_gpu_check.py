"""The one prepared GPU command starts on a bare GPU image: torch, pytest, pyyaml and numpy, and
nothing of this project's other dependencies (the image has no ruamel.yaml, jsonschema, matplotlib,
hypothesis or transformers; safetensors and megatron-core may be missing too)."""

import subprocess
import sys
from pathlib import Path

import pytest

from correctness.errors import CaseInputError
from correctness.optimizer.checkpoint_values import load_slice
from correctness.optimizer.layout import param_slices

ROOT = Path(__file__).resolve().parent.parent
ABSENT_ON_A_BARE_IMAGE = ("ruamel", "jsonschema", "matplotlib", "hypothesis", "transformers", "pyarrow",
                          "accelerate", "safetensors", "megatron", "transformer_engine")


def bare_image(tmp_path: Path, absent=ABSENT_ON_A_BARE_IMAGE) -> dict[str, str]:
    """An environment in which the named top-level modules cannot be imported."""
    site = tmp_path / "bare"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sys\n"
        "class Absent:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] in {tuple(absent)!r}:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Absent())\n"
    )
    # The image has no pytest plugins of its own: none is loaded from this machine's environment.
    return {"PYTHONPATH": f"{site}:{ROOT}", "PATH": "/usr/bin:/bin", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}


def run(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_the_preflight_names_what_is_missing_and_stops(tmp_path):
    finished = run([sys.executable, "scripts/gpu_preflight.py"], bare_image(tmp_path, ("yaml", "numpy", "safetensors")))
    assert finished.returncode == 2
    assert finished.stderr.strip() == (
        "gpu-check preflight: cannot run, missing yaml (pip package pyyaml), numpy (pip package numpy)"
    )
    assert "optional safetensors is not installed" in finished.stdout


def test_the_preflight_passes_with_the_required_modules_and_names_the_optional_ones(tmp_path):
    finished = run([sys.executable, "scripts/gpu_preflight.py"], bare_image(tmp_path))
    assert finished.returncode == 0, finished.stderr
    for optional in ("safetensors", "transformer_engine", "megatron.core"):
        assert f"optional {optional} is not installed" in finished.stdout


def test_the_gpu_tiers_run_on_a_bare_image_and_skip_here_with_reasons(tmp_path):
    finished = run(
        [sys.executable, "-m", "pytest", "component_tests", "-m", "gpu or h100 or h200 or megatron", "-q", "-rs",
         "-p", "no:cacheprovider", "--results-dir", str(tmp_path / "results")],
        bare_image(tmp_path),
    )
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    summary = finished.stdout.strip().splitlines()[-1]
    assert "skipped" in summary and not {"passed", "failed", "error", "errors"} & set(summary.replace(",", " ").split())
    assert "needs a CUDA GPU" in finished.stdout and "megatron-core is not usable here" in finished.stdout


def test_a_checkpoint_slice_without_safetensors_names_it(gemma, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)
    (tmp_path / "model.safetensors").write_bytes(b"")
    param = param_slices(gemma, tp=2, tp_rank=0, layers=(0,), embedding_rows=2)[0]
    with pytest.raises(CaseInputError, match=r"model\.safetensors needs safetensors, which is not installed"):
        load_slice(tmp_path, param)
