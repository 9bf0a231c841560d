"""No silent skips: --require-tiers turns a skip of a named tier for a missing dependency into a
failure naming it (the README's commands pass it: `make test` fails where megatron-core stops
importing, instead of skipping ten levers' Megatron CPU tiers and staying green)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODULE = "component_tests/test_rope_fusion.py"  # a Megatron CPU tier: Megatron's own RoPE


@pytest.fixture
def megatron_hidden(tmp_path):
    """A PYTHONPATH on which `import megatron` fails, as a broken install would."""
    package = tmp_path / "hidden" / "megatron"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text('raise ImportError("megatron-core hidden for this test")\n')
    return str(package.parent)


def pytest_run(*arguments, pythonpath=None):
    environment = {"PYTHONPATH": pythonpath} if pythonpath else {}
    return subprocess.run([sys.executable, "-m", "pytest", MODULE, "-q", "-p", "no:cacheprovider", *arguments],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **environment})


def test_without_it_a_missing_dependency_is_a_green_skip(megatron_hidden):
    finished = pytest_run("-rs", pythonpath=megatron_hidden)
    assert finished.returncode == 0, finished.stdout
    assert "megatron-core is not usable here: ImportError: megatron-core hidden for this test" in finished.stdout


def test_a_required_tier_that_cannot_run_fails_naming_it(megatron_hidden):
    finished = pytest_run("--require-tiers", "cpu,megatron-cpu", pythonpath=megatron_hidden)
    assert finished.returncode == 1, finished.stdout
    assert ("the megatron-cpu tier is required here (--require-tiers) but cannot run: megatron-core is not usable"
            " here: ImportError: megatron-core hidden for this test") in finished.stdout


def test_the_readmes_commands_require_the_cpu_tiers():
    makefile = (ROOT / "Makefile").read_text()
    assert "REQUIRED_TIERS ?= cpu,megatron-cpu,te-cpu" in makefile
    for target in ("component-tests:", "test:"):
        recipe = makefile.split(f"\n{target}", 1)[1].split("\n\n", 1)[0]
        assert "--require-tiers $(REQUIRED_TIERS)" in recipe, target


def test_an_unknown_tier_is_a_usage_error():
    finished = pytest_run("--require-tiers", "cpu,tpu", "--collect-only")
    assert finished.returncode == 4
    assert "unknown tier tpu; the tiers are cpu, gpu, megatron-cpu, te-cpu, megatron, h100, h200" in finished.stderr


def test_a_required_te_cpu_tier_without_its_te_fails_naming_it(tmp_path):
    """TE's CPU copy missing (CORRECTNESS_TE_CPU naming an empty folder): the te-cpu tier fails."""
    finished = subprocess.run(
        [sys.executable, "-m", "pytest", "component_tests/test_attention_backend.py", "-q", "-p", "no:cacheprovider",
         "-k", "te_unfused_on_cpu", "--require-tiers", "te-cpu", "--results-dir", str(tmp_path / "results")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "CORRECTNESS_TE_CPU": str(tmp_path)})
    assert finished.returncode == 1, finished.stdout
    assert ("the te-cpu tier is required here (--require-tiers) but cannot run: Transformer Engine 2.17.0's Python is not"
            f" installed for the CPU tier in {tmp_path}") in finished.stdout
