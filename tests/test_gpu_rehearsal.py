"""A dress rehearsal of scripts/gpu-check on the CPU, on an emulated GPU: its packing, its per-case
records, its budget and its summary, on a toy test folder of GPU-tier levers in place of the
component tests (--rehearsal --tests). One run of three toy modules: one passes (its record id holds
spaces, parentheses, a comma and `=`), one hangs in its third case deaf to SIGINT and is killed at
its limit, one does not fit in the budget."""

import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from correctness.gpu_check import ENVIRONMENT, LOG, RECORDS, SUMMARY
from correctness.results import file_name

ROOT = Path(__file__).resolve().parent.parent
LEGAL = re.compile(r"[A-Za-z0-9._-]+")
RETURNED_FILES = 8  # the GPU machine returns at most 8 files, at most 2 folders down, named in LEGAL alone
HANG_LIMIT = 20  # seconds: the hanging module's limit (its pytest starts and runs two quick cases well within it)

TOY_LEVERS = '''
import os
import signal
import time
from dataclasses import dataclass

import torch

from correctness import Case, Control, Lever, Mutated, ImplementationOutput, RecipeRef
from correctness.tiers import GPU

ROWS = 4  # and one more per seed: the row count tells the path its case

@dataclass(frozen=True)
class Sum:
    name: str
    accumulate: torch.dtype
    hang_on_seed: int | None = None

    def run(self, inputs):
        if self.hang_on_seed is not None and inputs.shape[0] - ROWS == self.hang_on_seed:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a hang that only SIGKILL ends
            time.sleep(600)
        total = inputs.to(self.accumulate).sum(-1).float()
        # The backend names what the process found set as it started (gpu-check's CUBLAS_WORKSPACE_CONFIG),
        # and where its inputs were (the emulated GPU).
        return ImplementationOutput(
            tensors={"total": total},
            backend=f"sum cublas={os.environ.get('CUBLAS_WORKSPACE_CONFIG')} on {inputs.device}")


def toy_case(seed):
    def make_inputs(device):
        drawn = torch.rand(ROWS + seed, 64, generator=torch.Generator().manual_seed(seed))
        return drawn.to(device=device, dtype=torch.bfloat16)

    return Case(id=f"sum-seed{seed}", shape="rows of 64", seed=seed, source="synthetic", variant="uniform",
                make_inputs=make_inputs)


def toy_lever(name, candidate, seeds):
    return Lever(name=name, version=1, tier=GPU, description="toy sums",
                 recipe=RecipeRef(id=f"toy/cpu/{name}", model="Toy", gpu="none", sha256="0" * 64),
                 cases=tuple(toy_case(seed) for seed in seeds), candidate=candidate,
                 default=Sum("fp32", torch.float32), reference=Sum("fp64 reference", torch.float64),
                 controls=(Control(name="doubled",
                                   implementation=Mutated(base=candidate, mutation="x2", mutate=lambda x: 2 * x)),))


def sums(options):
    return [toy_lever("toy-sum", Sum("fp64 (stand-in, x=1)", torch.float64), (0, 1))]


def hangs(options):
    return [toy_lever("toy-hang", Sum("fp64", torch.float64, hang_on_seed=2), (0, 1, 2))]
'''

TEST_MODULE = '''
import pytest

from toy_levers import {factory}


@pytest.mark.levers(factory={factory})
def test_sum(lever, case, lever_check):
    lever_check(lever, case)
'''


def toy_tests(folder: Path) -> Path:
    """A toy component-test folder: a passing module (named as the deterministic-mode module, so
    that gpu-check sets CUBLAS_WORKSPACE_CONFIG for it), a hanging one and a late one."""
    folder.mkdir()
    (folder / "conftest.py").write_text('pytest_plugins = ("correctness.pytest_plugin",)\n')
    (folder / "toy_levers.py").write_text(TOY_LEVERS)
    (folder / "test_deterministic_mode.py").write_text(TEST_MODULE.format(factory="sums"))
    (folder / "test_hangs.py").write_text(TEST_MODULE.format(factory="hangs"))
    (folder / "test_late.py").write_text(TEST_MODULE.format(factory="sums"))
    return folder


def gpu_check(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    path = f"{Path(sys.executable).parent}:/usr/bin:/bin"
    environment = {"PATH": path, "HOME": str(Path.home()), **(env or {})}
    return subprocess.run([str(ROOT / "scripts/gpu-check"), *args], cwd=ROOT, env=environment, capture_output=True,
                          text=True, timeout=240)


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    """One rehearsal run: (its finished process, OUT, the records folder it kept)."""
    base = tmp_path_factory.mktemp("rehearsal")
    tests = toy_tests(base / "toy_tests")
    out, records = base / "out", base / "records"
    finished = gpu_check(str(out), "--rehearsal", "--tests", str(tests), "--records", str(records), "--budget", "60",
                         "--module-limit", f"test_hangs.py={HANG_LIMIT}", "--module-limit", "test_late.py=1000",
                         "--grace", "1")
    return finished, out, records


def tar_records(out: Path) -> dict[str, dict]:
    with tarfile.open(out / RECORDS, "r:gz") as tar:
        return {member.name: json.load(tar.extractfile(member)) for member in tar.getmembers() if member.isfile()}


def test_out_holds_at_most_eight_files_with_legal_names_and_no_deep_folders(rehearsal):
    finished, out, _ = rehearsal
    everything = sorted(path.relative_to(out) for path in out.rglob("*"))
    assert everything == sorted(Path(name) for name in (LOG, RECORDS, SUMMARY, ENVIRONMENT)), finished.stdout[-3000:]
    assert len(everything) <= RETURNED_FILES
    assert all(LEGAL.fullmatch(part) and len(path.parts) <= 3 for path in everything for part in path.parts)


def test_the_tar_holds_every_record_under_legal_names(rehearsal):
    _, out, _ = rehearsal
    records = tar_records(out)
    assert all(LEGAL.fullmatch(part) for name in records for part in name.split("/")), sorted(records)
    passing = f"records/toy/cpu/toy-sum/.emulated/{file_name('toy-sum--gpu--fp64 (stand-in, x=1)')}.json"
    assert records[passing]["lever"]["record_id"] == "toy-sum--gpu--fp64 (stand-in, x=1)"  # the readable label inside
    assert records[passing]["verdict"] == "pass" and not records[passing]["interrupted"]
    assert records[passing]["provenance"]["emulated_gpu"]["gpu"] == "H200"  # the lent machine, emulated


def test_a_module_killed_at_its_limit_keeps_its_finished_cases(rehearsal):
    finished, out, records_folder = rehearsal
    killed = tar_records(out)["records/toy/cpu/toy-hang/.interrupted/toy-hang--gpu--fp64.json"]
    assert killed["interrupted"] is True
    assert [(case["case_id"], case["status"]) for case in killed["cases"]] == [("sum-seed0", "pass"), ("sum-seed1", "pass")]
    assert killed["completeness"]["missing"] == ["sum-seed2"]
    assert "still running 1 s after SIGINT: killed (SIGKILL)" in finished.stdout
    assert not list(records_folder.rglob("*.jsonl"))  # every case log became a record or was removed
    assert not list(records_folder.rglob(".cases"))


def test_the_log_holds_the_tracebacks_of_the_hang(rehearsal):
    _, out, _ = rehearsal
    log = (out / LOG).read_text()
    assert re.search(r"Timeout \(0:00:\d\d\)", log) and "in run" in log  # faulthandler's dump names the hung path's frame
    assert "test_late.py: skipped: its limit is 1000 s" in log


def test_the_summary_agrees_with_the_records_and_the_budget(rehearsal):
    finished, out, _ = rehearsal
    summary = json.loads((out / SUMMARY).read_text())
    records = tar_records(out)
    modules = {module["module"]: module for module in summary["modules"]}
    assert [modules[name]["status"] for name in ("test_deterministic_mode.py", "test_hangs.py", "test_late.py")] == [
        "passed", "stopped at its limit", "skipped"]
    assert "of the 60 s budget are left" in modules["test_late.py"]["reason"]
    assert modules["test_deterministic_mode.py"]["environment"] == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    assert sorted(summary["records"]) == sorted(records)
    for name, lever in summary["levers"].items():
        for shown in lever["records"]:
            record = records[shown["file"]]
            assert record["lever"]["name"] == name and shown["verdict"] == record["verdict"]
            assert sum(shown["cases"].values()) == len(record["cases"])
    assert summary["levers"]["toy-sum"]["verdict"] == "pass"
    # set before Python started; the inputs on the emulated GPU
    assert summary["levers"]["toy-sum"]["records"][0]["backends"] == ["sum cublas=:4096:8 on cuda:0"]
    assert summary["rehearsal"] is True and summary["emulated_gpu"] == "H200x1"
    assert summary["levers"]["toy-hang"]["verdict"] == "interrupted"
    assert summary["exit_code"] == finished.returncode == 1
    assert summary["outcome"] == "4 rehearsal cases ran to a verdict; test_hangs.py did not finish"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_without_a_gpu_gpu_check_refuses_in_one_line(tmp_path):
    finished = gpu_check(str(tmp_path / "out"))
    build = "a build without CUDA" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}, sees no device"
    assert finished.returncode == 2
    assert finished.stderr.strip().splitlines() == [
        f"gpu-check: CUDA is not visible here (torch {torch.__version__}, {build}): no GPU tier can run, nothing was run"]
    assert not (tmp_path / "out").exists()


REAL_MODULES = ("test_rope_fusion.py", "test_gradient_reduction.py")


@pytest.mark.slow(reason="gpu-check rehearsed on real GPU tiers under an emulated H200: the device's one command end to "
                         "end")
def test_the_devices_command_rehearsed_on_real_gpu_tiers(tmp_path):
    """The device's command as the README gives it (`scripts/gpu-check OUT --rehearsal`: an emulated
    H200, one GPU, as lent) on two of the component tests' own modules: RoPE's TE tier runs to a
    verdict, and the NCCL tier skips as on one real GPU, for want of a second."""
    tests = tmp_path / "component_tests"
    tests.mkdir()
    (tests / "conftest.py").write_text('pytest_plugins = ("correctness.pytest_plugin",)\n')
    for name in REAL_MODULES:
        (tests / name).write_text((ROOT / "component_tests" / name).read_text())
    out = tmp_path / "out"
    finished = gpu_check(str(out), "--rehearsal", "--tests", str(tests))
    summary = json.loads((out / SUMMARY).read_text())
    assert finished.returncode == summary["exit_code"] == 0, finished.stdout[-3000:]
    assert [module["status"] for module in summary["modules"]] == ["passed", "passed"]
    rope = [record for record in summary["levers"]["rope-fusion"]["records"] if record["device_type"] == "cuda"]
    assert rope and all(record["verdict"] == "pass" for record in rope)
    assert all(record["device"]["name"] == "NVIDIA H200" and record["device"]["emulated"] for record in rope)
    assert "/.emulated/" in rope[0]["file"]
    reduction = summary["levers"]["gradient-reduction-dtype"]["records"]
    nccl = next(record for record in reduction if record["device_type"] == "cuda")
    assert set(nccl["cases"]) == {"skip"}
    log = (out / LOG).read_text()
    assert "a rehearsal on the CPU on an emulated H200x1" in log and "needs a GPU of its own and this machine has 1" in log
