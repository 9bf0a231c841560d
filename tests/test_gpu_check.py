"""The one prepared GPU command starts on a bare GPU image: torch, pytest, pyyaml and numpy, and
nothing of this project's other dependencies (the image has no ruamel.yaml, jsonschema, matplotlib,
hypothesis or transformers; safetensors and megatron-core may be missing too). Its parts on their
own: record file names, case logs and what recovers them, the modules' order and budget, the exit
status (tests/test_gpu_rehearsal.py runs the whole command on the CPU)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from correctness import gpu_check
from correctness.errors import CaseInputError, CorrectnessError
from correctness.gpu_check import Module, ModuleRun, fits, module_environment, outcome, plan, run_modules
from correctness.optimizer.checkpoint_values import load_slice
from correctness.megatron.layout import param_slices
from correctness.record_store import (CASES_FOLDER, INTERRUPTED_FOLDER, append_cases, case_log_path, case_logs,
                                      recover_case_logs, start_case_log)
from correctness.results import file_name, read_record, record_path
from toy_records import toy_case, toy_record

pytest_plugins = ("pytester",)

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


# Record file names


def test_a_legal_record_id_is_its_own_file_name():
    assert file_name("toy-sum--cpu--fp64") == "toy-sum--cpu--fp64"
    assert file_name("a_b.c-d") == "a_b.c-d"


def test_other_characters_become_underscores_and_a_hash_keeps_names_apart():
    name = file_name("deterministic-mode--gpu--sdpa-efficient (deterministic mode)")
    assert re.fullmatch(r"deterministic-mode--gpu--sdpa-efficient_deterministic_mode\.[0-9a-f]{8}", name)
    names = {file_name(label) for label in ("a b", "a_b", "a,b", "a=b", "a (b)", "a/b")}
    assert len(names) == 6 and all(re.fullmatch(r"[A-Za-z0-9._-]+", name) for name in names)


def test_a_record_path_is_named_by_its_file_name_and_still_refused_outside_the_folder(tmp_path):
    data = {"lever": {"record_id": "lever--gpu--sdpa (x=1, y)"}, "recipe": {"id": "toy/cpu/sum", "path": None}}
    assert record_path(data, tmp_path) == tmp_path / "toy/cpu/sum" / f"{file_name('lever--gpu--sdpa (x=1, y)')}.json"
    with pytest.raises(CorrectnessError, match="would place a record outside the results folder"):
        record_path({**data, "lever": {"record_id": "../x"}}, tmp_path)


# Case logs


CASES = (toy_case(0), toy_case(1))


@pytest.fixture(scope="module")
def complete(tmp_path_factory) -> dict:
    """The toy lever's record over two cases, both run, as JSON."""
    return read_record(toy_record(tmp_path_factory.mktemp("complete"), CASES))


def dead_pid() -> int:
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(finished.stdout)


def write_log(results: Path, record: dict, cases: list[dict], process: str = "main", pid: int | None = None) -> Path:
    """A case log as a session writes it, under a dead process's pid (or `pid`)."""
    path = case_log_path(record, results, "ab12", process)
    path = path.with_name(re.sub(r"\.[0-9]+\.jsonl$", f".{pid or dead_pid()}.jsonl", path.name))
    start_case_log(path, {**record, "cases": []})
    append_cases(path, cases)
    return path


def test_a_killed_sessions_case_log_becomes_an_interrupted_record_beside(tmp_path, complete):
    log = write_log(tmp_path, complete, complete["cases"][:1])
    with open(log, "a") as torn:
        torn.write('{"case": {"case_id": "sums-se')  # the line the kill cut short
    (written,) = recover_case_logs(tmp_path)
    assert written == record_path(complete, tmp_path).parent / INTERRUPTED_FOLDER / record_path(complete, tmp_path).name
    record = read_record(written)
    assert record["interrupted"] and [case["case_id"] for case in record["cases"]] == ["sums-seed0"]
    assert record["verdict"] == "incomplete" and record["completeness"]["missing"] == ["sums-seed1"]
    assert not log.exists() and not log.parent.exists()
    assert not record_path(complete, tmp_path).exists()  # never in the complete record's place


def test_the_case_logs_of_a_sessions_workers_make_one_record(tmp_path, complete):
    write_log(tmp_path, complete, complete["cases"][1:], process="gw1")
    write_log(tmp_path, complete, complete["cases"][:1], process="gw0")
    (written,) = recover_case_logs(tmp_path)
    assert [case["case_id"] for case in read_record(written)["cases"]] == ["sums-seed0", "sums-seed1"]


def test_a_live_sessions_case_log_is_left_alone(tmp_path, complete):
    log = write_log(tmp_path, complete, complete["cases"][:1], pid=os.getpid())
    assert recover_case_logs(tmp_path) == [] and log.exists()
    assert [found.path for found in case_logs(tmp_path)] == [log]


LOGGING_PROJECT = """
from pathlib import Path

import pytest
from toy_levers import *


@pytest.mark.levers(factory=one_good_lever)
def test_sum(lever, case, lever_check):
    lever_check(lever, case)


def test_the_cases_are_logged_as_they_finish(request):
    (log,) = Path(request.config.getoption("results_dir")).rglob("*.jsonl")
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [next(iter(line)) for line in lines] == ["record", "case", "case"]
"""


def test_a_session_logs_each_case_removes_its_logs_and_recovers_a_killed_ones(pytester, complete):
    from tests.test_pytest_plugin import CONFTEST, TOY_LEVERS

    results = pytester.path / "results"
    write_log(results, complete, complete["cases"][:1])
    place = record_path(complete, results)
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(toy_levers=TOY_LEVERS, test_toy="import json\n" + LOGGING_PROJECT)
    pytester.syspathinsert()
    result = pytester.runpytest("-p", "no:cacheprovider", "--results-dir", str(results))
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["*records of killed sessions*",
                                 f"  made from the case logs of a session killed before its end: {place.name}"])
    assert not list(results.rglob("*.jsonl")) and not list(results.rglob(CASES_FOLDER))
    assert read_record(place.parent / INTERRUPTED_FOLDER / place.name)["interrupted"]


# The modules' order, budget and environment


def test_the_attention_and_thd_modules_run_first_then_offload_where_megatron_is(tmp_path):
    for name in ("test_zeta.py", "test_optimizer_offload.py", "test_thd_packing.py", "test_alpha.py",
                 "test_attention_backend.py", "helpers.py"):
        (tmp_path / name).write_text("")
    with_megatron = [module.name for module in plan(tmp_path, {}, megatron=True)]
    assert with_megatron == ["test_attention_backend.py", "test_thd_packing.py", "test_optimizer_offload.py",
                             "test_alpha.py", "test_zeta.py"]
    assert [module.name for module in plan(tmp_path, {}, megatron=False)] == [
        "test_attention_backend.py", "test_thd_packing.py", "test_alpha.py", "test_optimizer_offload.py", "test_zeta.py"]
    limits = {module.name: module.limit for module in plan(tmp_path, {"test_zeta.py": 7.0}, megatron=False)}
    assert limits["test_zeta.py"] == 7.0 and limits["test_alpha.py"] == gpu_check.DEFAULT_MODULE_LIMIT
    assert limits["test_attention_backend.py"] == gpu_check.MODULE_LIMITS["test_attention_backend.py"]


def test_a_module_whose_limit_does_not_fit_is_skipped_with_the_reason(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(gpu_check.time, "monotonic", lambda: clock[0])

    def run(module: Module) -> ModuleRun:
        clock[0] += 50.0
        return ModuleRun(module=module.name, limit=module.limit, status="passed", seconds=50.0)

    modules = [Module(Path(f"test_{name}.py"), limit) for name, limit in (("a", 60), ("b", 60), ("c", 30), ("d", 10))]
    runs: list[ModuleRun] = []
    run_modules(modules, 100.0, run, runs)
    assert [(run.module, run.status) for run in runs] == [
        ("test_a.py", "passed"), ("test_b.py", "skipped"), ("test_c.py", "passed"), ("test_d.py", "skipped")]
    assert runs[1].reason == "its limit is 60 s and 50 s of the 100 s budget are left"
    assert runs[3].reason == "its limit is 10 s and 0 s of the 100 s budget are left"
    assert fits(Module(Path("test_a.py"), 30.0), 30.0, 100.0) is None


def test_only_a_module_of_deterministic_tiers_gets_the_cublas_workspace_before_it_starts(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert module_environment(Module(Path("test_deterministic_mode.py"), 1.0)) == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    assert module_environment(Module(Path("test_attention_backend.py"), 1.0)) == {}
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the user's own is kept
    assert module_environment(Module(Path("test_deterministic_mode.py"), 1.0)) == {}


def test_the_gpu_selection_is_every_gpu_tier_and_megatron():
    assert set(gpu_check.gpu_markers().split(" or ")) == {"gpu", "te", "h100", "h200", "megatron"}


# The exit status


def lever_with(device_type: str, **cases: int) -> dict:
    return {"records": [{"device_type": device_type, "cases": {status.replace("_", " "): count
                                                              for status, count in cases.items()}}]}


@pytest.mark.parametrize(("levers", "statuses", "rehearsal", "expected"), [
    ({"a": lever_with("cuda", skip=3)}, ["passed"], False,
     (1, "no GPU case passed or failed: this run is no evidence (the log says why)")),
    ({"a": lever_with("cpu", **{"pass": 2})}, ["passed"], False,
     (1, "no GPU case passed or failed: this run is no evidence (the log says why)")),
    ({"a": lever_with("cpu", **{"pass": 2})}, ["passed"], True, (0, "2 rehearsal cases ran to a verdict, none failed")),
    ({"a": lever_with("cuda", **{"pass": 1, "no_kernel_change": 1, "skip": 4})}, ["passed", "skipped"], False,
     (0, "2 GPU cases ran to a verdict, none failed")),
    ({"a": lever_with("cuda", fail=1)}, ["failed", "stopped at its limit"], False,
     (1, "1 GPU case ran to a verdict; failures in m0.py; m1.py did not finish")),
])
def test_the_exit_status_needs_a_gpu_case_decided_and_nothing_failed_or_cut(levers, statuses, rehearsal, expected):
    runs = [ModuleRun(module=f"m{index}.py", limit=1.0, status=status) for index, status in enumerate(statuses)]
    assert outcome(runs, levers, rehearsal) == expected


def test_the_environment_report_names_the_switches_that_change_the_numbers(tmp_path):
    report = tmp_path / "deep" / "environment.txt"
    finished = run([sys.executable, "scripts/gpu_preflight.py", "--report", str(report)],
                   {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "NVIDIA_TF32_OVERRIDE": "0"})
    assert finished.returncode == 0, finished.stderr
    text = report.read_text()
    for expected in ("== torch", "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = ",
                     "torch.backends.cuda.matmul.allow_tf32 = ", "torch.backends.cudnn.allow_tf32 = ",
                     "NVIDIA_TF32_OVERRIDE=0", "== packages", "megatron-core", "== nvidia-smi"):
        assert expected in text, expected


def test_gpu_check_lets_an_h200_stand_in_for_the_recipes_h100_unless_told_otherwise():
    assert gpu_check.with_stand_in(["-k", "sdpa"]) == ["--gpu-stand-in", "h200=h100", "-k", "sdpa"]
    assert gpu_check.with_stand_in(["--gpu-stand-in=gh200=h100"]) == ["--gpu-stand-in=gh200=h100"]
