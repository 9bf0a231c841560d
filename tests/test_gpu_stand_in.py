"""An H200 standing in for an H100 (`--gpu-stand-in h200=h100`), on the CPU: the H100 tiers run on an
H200 only where asked, the record and the recipe entry say "run on H200 standing in for H100 (both
sm90)", and `correctness check` shows such a result as stand-in, never as the H100's own.

A stand-in device name (a monkeypatched torch.cuda, a device description) is scaffolding for the
logic; no numerics here are the GPU's."""

import subprocess
import sys
import types
from dataclasses import dataclass, replace

import pytest
import torch

import correctness.provenance as provenance_module
from correctness.attach import component_test_entry
from correctness.check import check_recipe
from correctness.errors import CorrectnessError
from correctness.fixtures import recipe_path
from correctness.harness import run_lever
from correctness.pytest_plugin import _missing_hardware
from correctness.recipe_sets import GEMMA
from correctness.tiers import StandIn, parse_stand_in, recipe_gpu_tier
from tests.test_harness import toy_lever

pytest_plugins = ("pytester",)

H200 = {"type": "cuda", "name": "NVIDIA H200", "gpu_type": "H200", "capability": "9.0", "memory_gb": 139.8, "index": 0}
SENTENCE = "run on H200 standing in for H100 (both sm90)"


def test_a_stand_in_is_another_gpu_of_the_recipe_gpus_architecture():
    stand_in = parse_stand_in("h200=h100")
    assert stand_in == StandIn(present="H200", recipe="H100")
    assert stand_in.sentence() == SENTENCE
    assert stand_in.label() == "H200 (standing in for H100)"


@pytest.mark.parametrize(("text", "why"), [
    ("h200", "write it as PRESENT=RECIPE, e.g. h200=h100"),
    ("h200=", "write it as PRESENT=RECIPE"),
    ("h300=h100", "unknown GPU H300"),
    ("h100=h100", "a GPU cannot stand in for itself"),
    ("b200=h100", "B200 is sm100 and H100 is sm90; a stand-in must be of the recipe GPU's architecture"),
])
def test_a_stand_in_that_cannot_be_is_refused_in_one_line(text, why):
    with pytest.raises(CorrectnessError, match=why) as refused:
        parse_stand_in(text)
    assert str(refused.value).startswith(f"--gpu-stand-in {text}: ") and "\n" not in str(refused.value)


@dataclass
class MarkedItem:
    names: tuple[str, ...]
    stand_in: StandIn | None = None

    def iter_markers(self):
        return [types.SimpleNamespace(name=name) for name in self.names]

    @property
    def config(self):
        return types.SimpleNamespace(getoption=lambda name, default=None: self.stand_in if name == "gpu_stand_in"
                                     else default)


@pytest.fixture
def on_an_h200(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "NVIDIA H200")


def test_the_h100_tiers_skip_on_an_h200_and_say_how_it_could_stand_in(on_an_h200):
    assert _missing_hardware(MarkedItem(("h100",))) == (
        "needs an NVIDIA H100 (the recipe's GPU); found NVIDIA H200 (--gpu-stand-in h200=h100 runs it here: both sm90)")


def test_with_the_stand_in_the_h100_tiers_run_on_an_h200(on_an_h200):
    stand_in = parse_stand_in("h200=h100")
    assert _missing_hardware(MarkedItem(("h100",), stand_in)) is None
    assert _missing_hardware(MarkedItem(("h200",), stand_in)) is None  # its own tiers still run


def test_a_stand_in_for_another_pair_does_not_let_the_h100_tiers_run(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "NVIDIA GH200 480GB")
    reason = _missing_hardware(MarkedItem(("h100",), parse_stand_in("h200=h100")))
    assert reason == "needs an NVIDIA H100 (the recipe's GPU); found NVIDIA GH200 480GB"


def test_the_pytest_option_refuses_an_impossible_stand_in_in_one_line(pytester):
    pytester.makeconftest('pytest_plugins = ("correctness.pytest_plugin",)\n')
    pytester.makepyfile(test_nothing="def test_nothing():\n    pass\n")
    result = pytester.runpytest("-p", "no:cacheprovider", "--gpu-stand-in", "b200=h100")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--gpu-stand-in b200=h100: B200 is sm100 and H100 is sm90*"])


def h100_record(monkeypatch, device=H200):
    """A record of a toy lever of the H100 tier, as a run on `device` writes it."""
    monkeypatch.setattr(provenance_module, "device_description", lambda _: dict(device))
    lever = toy_lever(tier=replace(recipe_gpu_tier("H100"), device="cpu"))  # the H100 tier, its toy on the CPU
    return run_lever(replace(lever, recipe=replace(lever.recipe, gpu="H100")))


def test_the_record_and_the_entry_say_an_h200_stood_in_for_the_h100(monkeypatch):
    record = h100_record(monkeypatch)
    assert record.provenance["stand_in"] == {"present": "H200", "recipe": "H100", "architecture": "sm90",
                                            "sentence": SENTENCE}
    entry = component_test_entry(record)
    assert entry["gpu"] == "H200 (standing in for H100)"
    assert entry["note"].endswith(f"; {SENTENCE}")


def test_a_run_on_the_recipes_own_gpu_has_no_stand_in(monkeypatch):
    record = h100_record(monkeypatch, {**H200, "name": "NVIDIA H100 80GB HBM3", "gpu_type": "H100"})
    assert "stand_in" not in record.provenance
    assert component_test_entry(record)["gpu"] == "H100"


def test_check_shows_a_stand_in_result_as_stand_in_and_never_counts_it(tmp_path):
    text = recipe_path(GEMMA).read_text()
    own = "    gpu: H100\n    date: 2026-10-21\n    result: pass\n    detail: on the sliding-window layers TE"
    assert own in text  # the attention lever's H100 entry
    recipe = tmp_path / "gemma-stand-in.yaml"
    recipe.write_text(text.replace(own, own.replace("gpu: H100", "gpu: H200 (standing in for H100)")))
    checked = check_recipe(recipe)
    (finding,) = [finding for finding in checked.findings if finding.lever == "attention-backend"]
    assert finding.result is None and finding.stand_in_result == "pass"
    assert finding.status == "incomplete" and checked.verdict != "pass"
    assert "no H100 result attached" in finding.detail
    assert f"stand-in evidence ({SENTENCE}, not the H100's own): pass" in finding.detail


def run_cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "correctness.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600)


def test_correctness_run_hands_the_stand_in_to_pytest(tmp_path):
    finished = run_cli("run", str(recipe_path(GEMMA)), "--tier", "cpu", "--gpu-stand-in", "H200=H100", "--",
                       "--collect-only", "-q", "-p", "no:cacheprovider", cwd=tmp_path)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert "--gpu-stand-in h200=h100" in finished.stdout.split("test session starts")[0]  # the pytest command it prints


def test_correctness_run_refuses_an_impossible_stand_in_in_one_line(tmp_path):
    finished = run_cli("run", str(recipe_path(GEMMA)), "--gpu-stand-in", "a100=h100", cwd=tmp_path)
    assert finished.returncode == 2
    assert "--gpu-stand-in a100=h100: A100 is sm80 and H100 is sm90" in finished.stderr.strip().splitlines()[-1]
