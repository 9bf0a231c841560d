"""A command writes only a new file or a regular file it may replace (correctness.files.output_target):
never one of its inputs (however the path is spelled), a read-only file, a FIFO, a device, a folder,
nor through a symlink out of its folder. Each is refused in one line, exit 2, and the target keeps
its bytes and mode; a new path and an existing writable file are still written. Through the real
command line: `report -o`, `model-facts -o`, `converge --plot`, `run --report`."""

import os
import shutil
import stat
from pathlib import Path

import pytest

from correctness import cli
from correctness.commands import EXIT_BAD_INPUT, EXIT_OK
from correctness.fixtures import CONFIGS_DIR, recipe_path
from correctness.recipes import load_recipe
from correctness.report_page import REPORT_NAME
from correctness.results import records_folder
from toy_records import toy_record

GEMMA = "gemma-4-31b/h100/attune-tp2-pp4-split13"
CONVERGENCE = Path(__file__).resolve().parent / "data" / "convergence"
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def call(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main([str(arg) for arg in argv])
    out, err = capsys.readouterr()
    return code, out, err


def snapshot(path: Path) -> tuple:
    """What must not change: the kind, mode, device number and (for a regular file) bytes."""
    status = os.lstat(path)
    data = path.read_bytes() if stat.S_ISREG(status.st_mode) else None
    return status.st_mode, status.st_rdev, status.st_ino, data


def assert_refused(result: tuple[int, str, str], *words: str) -> None:
    code, out, err = result
    assert code == EXIT_BAD_INPUT and out == "", (code, out, err)
    assert err.count("\n") == 1 and err.endswith("\n") and "Traceback" not in err, err
    assert all(word in err for word in words), err


@pytest.fixture
def record(tmp_path) -> Path:
    return toy_record(tmp_path / "results")


# --- report -o ---------------------------------------------------------------------------------------


def test_report_is_not_written_over_its_own_record(record, capsys):
    before = snapshot(record)
    assert_refused(call(capsys, "report", record, "-o", record), "is its input")
    assert snapshot(record) == before


def test_report_is_not_written_over_a_record_of_a_folder_it_reads_however_spelled(record, tmp_path, capsys,
                                                                                monkeypatch):
    before = snapshot(record)
    monkeypatch.chdir(tmp_path)
    relative = record.relative_to(tmp_path)
    spelled = Path(".") / "results" / ".." / relative  # another spelling of the same file
    assert_refused(call(capsys, "report", "results", "-o", spelled), "is its input")
    linked = tmp_path / "results" / "hard.html"
    os.link(record, linked)  # the same file under another name
    assert_refused(call(capsys, "report", record, "-o", linked), "is its input")
    symlink = record.parent / "link.html"
    symlink.symlink_to(record.name)  # a symlink in the record's folder, to the record
    assert_refused(call(capsys, "report", "results", "-o", symlink), "is its input")
    assert snapshot(record) == before


def test_report_is_not_written_over_a_read_only_file(record, tmp_path, capsys):
    target = tmp_path / "kept.html"
    target.write_text("keep me\n")
    target.chmod(0o444)
    before = snapshot(target)
    assert_refused(call(capsys, "report", record, "-o", target), "read-only (mode 0444)")
    assert snapshot(target) == before


def test_report_is_not_written_over_a_fifo(record, tmp_path, capsys):
    fifo = tmp_path / "pipe.html"
    os.mkfifo(fifo)
    before = snapshot(fifo)
    assert_refused(call(capsys, "report", record, "-o", fifo), "a FIFO")
    assert snapshot(fifo) == before and stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_report_is_not_written_over_a_device(record, tmp_path, capsys):
    """As root, over a /dev/null of its own (os.mknod): root could replace the real one. Otherwise
    over /dev/null itself, which this process could not replace even if the policy let it try."""
    if IS_ROOT:
        device = tmp_path / "null"
        os.mknod(device, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    else:
        device = Path(os.devnull)
    before = snapshot(device)
    assert_refused(call(capsys, "report", record, "-o", device), "a character device")
    assert snapshot(device) == before and stat.S_ISCHR(os.lstat(device).st_mode)


def test_report_is_not_written_through_a_symlink_out_of_its_folder(record, tmp_path, capsys):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    target = elsewhere / "precious.txt"
    target.write_text("precious\n")
    out = tmp_path / "out"
    out.mkdir()
    link = out / "report.html"
    link.symlink_to(target)
    before = snapshot(target)
    assert_refused(call(capsys, "report", record, "-o", link), "a symlink to", "outside its folder")
    assert snapshot(target) == before and link.is_symlink()


def test_report_is_not_written_over_a_folder(record, tmp_path, capsys):
    folder = tmp_path / "a-folder"
    folder.mkdir()
    (folder / "inside.txt").write_text("x")
    assert_refused(call(capsys, "report", record, "-o", folder), "a folder")
    assert folder.is_dir() and os.listdir(folder) == ["inside.txt"]


def test_every_target_is_checked_before_any_report_is_written(tmp_path, capsys):
    """Without -o, one report per recipe: a refused one leaves the others unwritten too."""
    first = toy_record(tmp_path / "results")
    other = tmp_path / "other.yaml"
    shutil.copy(recipe_path(GEMMA), other)
    second = toy_record(tmp_path / "results", recipe=load_recipe(other))
    assert first.parent != second.parent
    os.mkfifo(second.parent / REPORT_NAME)
    assert_refused(call(capsys, "report", tmp_path / "results"), "a FIFO")
    assert not (first.parent / REPORT_NAME).exists()


def test_report_writes_a_new_file_and_replaces_a_writable_one_keeping_its_mode(record, tmp_path, capsys):
    new = tmp_path / "new.html"
    code, out, err = call(capsys, "report", record, "-o", new)
    assert code == EXIT_OK and err == "" and "<html" in new.read_text()
    old = tmp_path / "old.html"
    old.write_text("an earlier report\n")
    old.chmod(0o640)
    code, _, err = call(capsys, "report", record, "-o", old)
    assert code == EXIT_OK and err == "" and "<html" in old.read_text()
    assert stat.S_IMODE(old.stat().st_mode) == 0o640
    link = tmp_path / "latest.html"
    link.symlink_to("new.html")  # a link within its folder is written through, and stays a link
    code, _, err = call(capsys, "report", record, "-o", link)
    assert code == EXIT_OK and err == "" and link.is_symlink()


# --- model-facts -o, converge --plot, run --report ------------------------------------------------------


@pytest.fixture
def config(tmp_path) -> Path:
    folder = tmp_path / "Qwen3-32B"
    shutil.copytree(CONFIGS_DIR / "Qwen3-32B", folder)
    return folder / "config.json"


def test_model_facts_are_not_written_over_the_config_or_a_read_only_file(config, tmp_path, capsys):
    before = snapshot(config)
    assert_refused(call(capsys, "model-facts", config, "-o", config), "is its input")
    assert_refused(call(capsys, "model-facts", config.parent, "-o", config), "is its input")
    assert snapshot(config) == before
    read_only = tmp_path / "facts.yaml"
    read_only.write_text("name: kept\n")
    read_only.chmod(0o400)
    kept = snapshot(read_only)
    assert_refused(call(capsys, "model-facts", config, "-o", read_only), "read-only (mode 0400)")
    assert snapshot(read_only) == kept
    fifo = tmp_path / "facts-pipe.yaml"
    os.mkfifo(fifo)
    assert_refused(call(capsys, "model-facts", config, "-o", fifo), "a FIFO")
    written = tmp_path / "qwen3-32b.yaml"
    code, _, err = call(capsys, "model-facts", config, "-o", written)
    assert code == EXIT_OK and err == "" and "name: Qwen3-32B" in written.read_text()


def test_converge_plots_over_no_curve_and_no_device(tmp_path, capsys):
    candidate, reference = tmp_path / "candidate.log", tmp_path / "reference.log"
    shutil.copy(CONVERGENCE / "candidate.log", candidate)
    shutil.copy(CONVERGENCE / "reference.log", reference)
    before = snapshot(candidate)
    assert_refused(call(capsys, "converge", candidate, reference, "--plot", candidate), "is its input")
    assert snapshot(candidate) == before
    fifo = tmp_path / "plot.png"
    os.mkfifo(fifo)
    assert_refused(call(capsys, "converge", candidate, reference, "--plot", fifo), "a FIFO")
    plot = tmp_path / "curves.png"
    code, out, _ = call(capsys, "converge", candidate, reference, "--plot", plot)
    assert code in (0, 1) and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_report_refuses_a_report_it_may_not_replace_before_any_test_runs(tmp_path, capsys, monkeypatch):
    def started(*args, **kwargs):
        pytest.fail(f"pytest started: {args}")

    monkeypatch.setattr(pytest, "main", started)
    recipe = tmp_path / "gemma.yaml"
    shutil.copy(recipe_path(GEMMA), recipe)
    results = tmp_path / "results"
    ref = load_recipe(recipe).ref
    folder = records_folder({"id": ref.id, "path": ref.path}, results)
    folder.mkdir(parents=True)
    os.mkfifo(folder / REPORT_NAME)
    assert_refused(call(capsys, "run", recipe, "--tier", "cpu", "--results-dir", results, "--report"), "a FIFO")
