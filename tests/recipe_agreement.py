"""`correctness check` after `correctness run` and `correctness attach`: it must say about each lever
what the run said (as CPU evidence, where the run was on the CPU)."""

import json
import subprocess
import sys
from pathlib import Path

from correctness.recipe_verdict import NOT_RUN


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "correctness.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=900)


def run_attach_check(recipe: Path, tmp_path: Path, *run_args: str, check_args: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """Run the recipe's component tests (JSON), attach every record that ran a case to a copy of the
    recipe (same file name, so the same id), check the copy (JSON); return (run, check)."""
    finished = cli("run", str(recipe), "--results-dir", str(tmp_path / "results"), "--json", *run_args, cwd=tmp_path)
    assert finished.returncode in (0, 1), finished.stdout[-3000:] + finished.stderr[-6000:]
    run = json.loads(finished.stdout)
    run["report"] = finished.stderr  # pytest's report and the verdicts, off stdout under --json
    assert run["exit_status"] == finished.returncode == (0 if run["verdict"]["verdict"] == "pass" else 1)
    copy = tmp_path / "copy" / recipe.name
    copy.parent.mkdir()
    copy.write_bytes(recipe.read_bytes())
    paths = [record["path"] for record in run["records"] if record["verdict"] != "skip"]
    if paths:
        attached = cli("attach", *paths, str(copy), cwd=tmp_path)
        assert attached.returncode == 0, attached.stderr
    checked = cli("check", str(copy), "--json", *check_args, cwd=tmp_path)
    assert checked.returncode in (0, 1), checked.stderr
    return run, json.loads(checked.stdout)


def assert_check_agrees_with_run(run: dict, check: dict) -> None:
    """Lever by lever: check's CPU evidence is the run's verdict (none where the lever did not run)."""
    said = {lever["lever"]: lever["verdict"] for lever in run["verdict"]["levers"]}
    shown = {finding["lever"]: finding["cpu_result"] for finding in check["findings"] if finding.get("lever")}
    assert set(shown) == set(said), (shown, said)
    for lever, verdict in said.items():
        assert shown[lever] == (None if verdict == NOT_RUN else verdict), (lever, shown[lever], verdict)


def assert_fits_a_terminal(report: str) -> None:
    """`correctness run`'s report: every line at most LINE_WIDTH, and every line of the lever verdict
    tables (but the records' names and folders beneath them) at most TABLE_WIDTH."""
    from correctness.report import LINE_WIDTH, TABLE_WIDTH

    lines = report.splitlines()
    assert max(map(len, lines)) <= LINE_WIDTH, max(lines, key=len)
    tables = report.split(" lever verdicts ")[1].split("short test summary")[0].splitlines()[1:]
    tables = [line for line in tables if not line.startswith(("  record: ", "    in ", "===="))]
    assert tables and max(map(len, tables)) <= TABLE_WIDTH, max(tables, key=len)
