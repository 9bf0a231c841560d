"""`correctness converge` (correctness.commands.converge): the table, exit codes, --json (every
figure at full precision), and the plot."""

import json
import subprocess
import sys

import pytest

from correctness import cli, commands
from correctness.convergence import check_convergence, read_curve
from correctness.convergence.checks import FUNCTION, NOT_APPLIED, round_correlation, round_difference
from toy_curves import BLOCK_FIELDS, DATA, decaying, upward_drift


@pytest.fixture
def converge(monkeypatch, capsys):
    """Run `correctness converge ARGS` through the real command line; (exit code, stdout, stderr)."""
    monkeypatch.setattr(cli, "COMMANDS", {"converge": cli.COMMANDS["converge"]})

    def run(*args):
        code = cli.main(["converge", *map(str, args)])
        out, err = capsys.readouterr()
        return code, out, err

    return run


def write_curves(tmp_path, candidate, reference):
    paths = tmp_path / "candidate.json", tmp_path / "reference.json"
    for path, losses in zip(paths, (candidate, reference)):
        path.write_text(json.dumps([float(x) for x in losses]))
    return paths


def test_command_passes_with_a_table_and_the_block(converge):
    code, out, _ = converge(DATA / "candidate.log", DATA / "reference.log")
    assert code == commands.EXIT_OK
    assert "PASS" in out.splitlines()[0] and "16 compared (first 4 skipped)" in out
    assert "recipe block: steps 20, result pass, correlation" in out


def test_command_fails_with_exit_one(converge, tmp_path):
    reference = decaying(20)
    candidate = reference.copy()
    candidate[-1] *= 1.06
    code, out, _ = converge(*write_curves(tmp_path, candidate, reference))
    assert code == commands.EXIT_FAIL and "FAIL" in out.splitlines()[0]


def test_command_bad_input_exits_two_with_one_line(converge, tmp_path):
    candidate, reference = write_curves(tmp_path, decaying(20), decaying(19))
    code, out, err = converge(candidate, reference)
    assert code == commands.EXIT_BAD_INPUT and out == ""
    assert err.count("\n") == 1 and "has 20 steps" in err and "has 19" in err and str(candidate) in err


def test_command_json_has_the_block_fields_and_every_check(converge):
    code, out, _ = converge(DATA / "candidate.log", DATA / "reference.log", "--json", "--thresholds", "function")
    data = json.loads(out)
    assert code == 0 and data["result"] == "pass" and data["skipped_steps"] == 0
    assert all(field in data for field in BLOCK_FIELDS)
    assert [c["name"] for c in data["checks"]] == ["finite losses", "step coverage", "correlation",
                                                    "point-wise tolerance", "final loss", "residual outliers", "drift"]
    assert data["checks"][-1]["status"] == NOT_APPLIED and data["thresholds"]["final_loss_tolerance"] == 0.03


def test_command_json_keeps_every_figure_at_full_precision(converge):
    """Rounding is for the table and the recipe block: --json carries the computed figures as they are."""
    candidate, reference = DATA / "candidate.log", DATA / "reference.log"
    result = check_convergence(read_curve(candidate), read_curve(reference), FUNCTION)
    correlation, final = result.correlation, result.final_loss_difference
    assert round_correlation(correlation) != correlation and round_difference(final) != final  # rounding shows here
    code, out, _ = converge(candidate, reference, "--json", "--thresholds", "function")
    data = json.loads(out)
    assert code == commands.EXIT_OK
    assert data["correlation"] == correlation == data["checks"][2]["value"]
    assert data["final_loss_difference"] == final == data["checks"][4]["value"]
    _, table, _ = converge(candidate, reference, "--thresholds", "function")
    assert f"correlation {round_correlation(correlation)}, final_loss_difference {round_difference(final)}" in table


def test_command_writes_a_png(converge, tmp_path):
    candidate, reference = upward_drift(100, end=0.04)
    plot = tmp_path / "curves.png"
    code, out, _ = converge(*write_curves(tmp_path, candidate, reference), "--plot", plot)
    assert code == commands.EXIT_FAIL and f"plot: {plot}" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_command_plot_to_a_missing_folder_is_bad_input(converge, tmp_path):
    code, _, err = converge(DATA / "candidate.log", DATA / "reference.log", "--plot", tmp_path / "no" / "x.png")
    assert code == commands.EXIT_BAD_INPUT and f"plot {tmp_path / 'no' / 'x.png'}: cannot be written" in err


def test_matplotlib_is_imported_only_to_plot():
    probe = ("import sys; from correctness.commands import converge; from correctness import convergence; "
             "print('matplotlib' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
