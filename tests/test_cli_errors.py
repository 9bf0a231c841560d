"""The command line's exit codes and messages: exit 2 and exactly one line on stderr for every user
error, 1 only for a check that failed, 0 for success; `--help`, `run --json`, a reader that goes away.

`correctness run` tests that would start pytest in this process replace pytest.main with a function
that fails the test: what they check must happen before pytest starts. The others run the command
in a subprocess, with the quick packed-loss lever (`-k loss`, about a second) or `--collect-only`.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from correctness import cli, commands
from correctness.fixtures import FIXTURES_DIR, recipe_path

GEMMA = "gemma-4-31b/h100/attune-tp2-pp4-split13"
NEMOTRON = "nemotron-3-super-120b-a12b/h200/attune-tp4-pp2-ep8-mt16k"
GEMMA_REFERENCE = FIXTURES_DIR / "references" / f"{GEMMA}.yaml"
CONVERGENCE = FIXTURES_DIR.parent / "tests" / "data" / "convergence"
QUIET = ("-p", "no:cacheprovider")


def call(capsys, *argv) -> tuple[int, str, str]:
    """cli.main in this process: (exit status, stdout, stderr)."""
    try:
        code = cli.main([str(arg) for arg in argv])
    except SystemExit as leaving:  # what argparse did before main() returned its status
        code = leaving.code
    out, err = capsys.readouterr()
    return code, out, err


def run_cli(*argv, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "correctness.cli", *map(str, argv)], cwd=cwd,
                          capture_output=True, text=True, timeout=600)


def one_line(err: str) -> bool:
    return err.count("\n") == 1 and err.endswith("\n") and "Traceback" not in err


@pytest.fixture
def no_pytest(monkeypatch):
    """pytest.main fails the test: the command must refuse before it starts the tests."""
    def started(*args, **kwargs):
        pytest.fail(f"pytest started: {args}")

    monkeypatch.setattr(pytest, "main", started)


def recipe_copy(tmp_path, name: str, edit, source: str = GEMMA):
    """The seed recipe with `edit(data)` applied, written to tmp_path/name."""
    data = yaml.safe_load(recipe_path(source).read_text())
    edit(data)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# --- usage --------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_help_prints_usage_once(capsys, command):
    code, out, _ = call(capsys, command, "--help")
    assert code == 0
    assert out.count("usage:") == 1, out


@pytest.mark.parametrize("argv", [["run"], ["converge", "one.log"], ["check", "a.yaml", "--no-such-option"], []])
def test_a_usage_error_is_one_line(capsys, argv):
    code, out, err = call(capsys, *argv)
    assert code == commands.EXIT_BAD_INPUT and out == ""
    assert one_line(err) and err.startswith("correctness"), err


@pytest.mark.parametrize("workers", ["-1", "-8"])
def test_a_negative_worker_count_is_refused(capsys, no_pytest, workers):
    code, out, err = call(capsys, "run", recipe_path(NEMOTRON), "--tier", "cpu", "--workers", workers)
    assert code == commands.EXIT_BAD_INPUT and out == ""
    assert one_line(err) and "--workers" in err and workers in err


# --- check: a model without model facts ------------------------------------------------------------


def test_check_refuses_a_model_without_model_facts(capsys, tmp_path):
    """Gemma's recipe under another model's name: its passing entries are evidence about Gemma-4-31B,
    not about this model, and no lever could have run at its shapes."""
    path = recipe_copy(tmp_path, "unknown-model.yaml", lambda data: data.update(model="Gemma-4-99B"))
    code, out, err = call(capsys, "check", path, "--reference", GEMMA_REFERENCE)
    assert code == commands.EXIT_BAD_INPUT and out == ""
    assert one_line(err) and "Gemma-4-99B" in err and "gemma-4-99b.yaml" in err, err


# --- run: refused before pytest starts --------------------------------------------------------------


def _drop_row_tokens(data):
    del data["workload"]["row_tokens"]


@pytest.mark.parametrize(("edit", "message"), [
    (lambda data: data["layout"].update(tp="two"), "layout.tp"),
    (_drop_row_tokens, "workload.row_tokens"),
    (lambda data: data.update(model="Gemma-4-99B"), "gemma-4-99b.yaml"),
])
def test_run_refuses_a_bad_recipe_before_pytest(capsys, tmp_path, no_pytest, edit, message):
    path = recipe_copy(tmp_path, "bad.yaml", edit)
    code, out, err = call(capsys, "run", path, "--tier", "cpu", "--results-dir", tmp_path / "results")
    assert code == commands.EXIT_BAD_INPUT and out == ""
    assert one_line(err) and message in err, err


@pytest.mark.parametrize("where", ["a file", "under a file", "read-only"])
def test_run_refuses_a_results_folder_it_cannot_write_before_pytest(capsys, tmp_path, no_pytest, where):
    blocker = tmp_path / "blocker"
    blocker.write_text("not a folder\n")
    results = {"a file": blocker, "under a file": blocker / "results", "read-only": tmp_path / "read-only"}[where]
    if where == "read-only":
        if os.geteuid() == 0:
            pytest.skip("root writes into a read-only folder")
        results.mkdir(mode=0o555)
    code, out, err = call(capsys, "run", recipe_path(NEMOTRON), "--tier", "cpu", "--results-dir", results)
    assert code == commands.EXIT_BAD_INPUT and out == ""
    assert one_line(err) and f"results folder {results}" in err, err


def tp3(data) -> None:
    """The seed at TP 3 on 12 GPUs, its fields and its run script alike (correctness.recipe_arguments)."""
    data["layout"].update(tp=3)
    data["gpu"].update(count=12)
    data["run"] = data["run"].replace("--tensor-model-parallel-size 2", "--tensor-model-parallel-size 3").replace(
        "--actor-num-gpus-per-node 8", "--actor-num-gpus-per-node 12")


def test_run_refuses_a_recipe_its_levers_cannot_shape_in_one_line(tmp_path):
    """TP 3 passes the schema but splits no Gemma tensor evenly: the levers fail while they are built
    (at pytest's collection). One line naming the reason, no pytest report."""
    path = recipe_copy(tmp_path, "tp3.yaml", tp3)
    finished = run_cli("run", path, "--tier", "cpu", "--results-dir", tmp_path / "results",
                       "--", "--collect-only", "-q", *QUIET, cwd=tmp_path)
    assert finished.returncode == commands.EXIT_BAD_INPUT
    assert one_line(finished.stderr) and "over TP 3" in finished.stderr, finished.stderr
    assert finished.stdout == ""


# --- run: its output ---------------------------------------------------------------------------------


def test_run_json_prints_a_summary_and_keeps_pytests_report_off_stdout(tmp_path):
    results = tmp_path / "results"
    finished = run_cli("run", recipe_path(NEMOTRON), "--tier", "cpu", "--results-dir", results, "--json",
                       "--", "-k", "loss", *QUIET, cwd=tmp_path)
    assert finished.returncode == 1, finished.stderr  # thd-packing and the offload, deselected: incomplete
    summary = json.loads(finished.stdout)  # stdout is the JSON alone
    assert summary["exit_status"] == 1 and summary["recipe"] == NEMOTRON
    assert summary["verdict"]["verdict"] == "incomplete"
    assert {lever["lever"]: lever["verdict"] for lever in summary["verdict"]["levers"]} == {
        "thd-packing": "not run", "packed-loss": "pass", "optimizer-offload": "not run"}
    (record,) = summary["records"]
    assert record["lever"] == "packed-loss" and record["verdict"] == "pass"
    assert record["cases"] == {"pass": 2}
    assert json.loads(open(record["path"]).read())["verdict"] == "pass"
    assert "test session starts" in finished.stderr and "lever verdicts" in finished.stderr


def test_run_prints_no_assert_rewrite_warning(tmp_path):
    finished = run_cli("run", recipe_path(NEMOTRON), "--tier", "cpu", "--", "--collect-only", "-q", *QUIET,
                       cwd=tmp_path)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert "test_packed_loss_cpu[" in finished.stdout
    assert "PytestAssertRewriteWarning" not in finished.stdout + finished.stderr


# --- a reader that goes away (`correctness ... | head`) -----------------------------------------------


@pytest.mark.parametrize(("argv", "status"), [
    (["check", recipe_path(GEMMA), "--json"], 0),
    (["converge", CONVERGENCE / "candidate.log", CONVERGENCE / "reference.log"], 0),
    (["run", recipe_path(NEMOTRON), "--tier", "cpu", "--json", "--", "--collect-only", "-q", *QUIET], 0),
], ids=["check", "converge", "run"])
def test_a_closed_stdout_is_no_traceback(tmp_path, argv, status):
    """The reader closes the pipe before a byte is read (`| head -0`): the command still ends with its
    own status, and stderr holds no BrokenPipeError."""
    process = subprocess.Popen([sys.executable, "-m", "correctness.cli", *map(str, argv)], cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    process.stdout.close()
    err = process.stderr.read()
    assert process.wait(timeout=600) == status, err
    assert "BrokenPipeError" not in err and "Traceback" not in err and "Exception ignored" not in err, err


@pytest.mark.parametrize("command", ["levers", "model-facts fixtures/configs/Llama-3.1-8B", "classify"])
def test_a_stdout_closed_from_the_start_is_one_line_and_exit_2(command):
    """`correctness levers >&-`: Python starts with sys.stdout None; a traceback said so before."""
    argv = command.split()
    if argv[0] == "classify":
        argv.append(str(recipe_path(GEMMA)))
    finished = subprocess.run(f"{sys.executable} -m correctness.cli {' '.join(argv)} >&-", shell=True,
                              cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 2, finished.stderr
    assert finished.stderr == "correctness: standard output is closed: nothing it prints could be read\n"
