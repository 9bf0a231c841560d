"""Issue 10, lost or wrong data and resource exhaustion from tiny inputs: concurrent attaches, symlinked
and read-only recipes, record paths, record validation, stray temporary files, alias bombs, deep
nesting, far-apart and huge steps, endless inputs; and the one-line messages of read-only folders,
full disks, read-only filesystems, byte order marks, duplicate keys and a string format version.

Records come from a toy lever (row sums, generic wording), a fraction of a second each; the
concurrency test forks processes that attach at the same moment.
"""

import errno
import json
import multiprocessing
import os
import re
import resource
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from correctness.attach import attach, attach_convergence
from correctness.classify import load_reference
from correctness.cli import main
from correctness.commands import EXIT_BAD_INPUT
from correctness.convergence import read_curve
from correctness.errors import CorrectnessError, RecipeError
from correctness.fixtures import recipe_path
from correctness.recipes import load_recipe, validate_recipe
from correctness.yaml_documents import load_document, recipe_text, write_recipe
from correctness.lever import LeverOptions
from correctness.results import FORMAT_VERSION, read_record, write_record
from toy_records import toy_record

GEMMA = "gemma-4-31b/h100/attune-tp2-pp4-split13"
BOM = b"\xef\xbb\xbf"


# Toy records


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    folder = tmp_path_factory.mktemp("records")
    return {name: toy_record(folder, name=name) for name in ("a", "b")}


def entry_tests(recipe: Path) -> list[str]:
    return [entry["test"] for entry in load_recipe(recipe).field("correctness.component_tests")]


def cli(capsys, *args) -> tuple[int, str, str]:
    code = main([str(arg) for arg in args])
    out, err = capsys.readouterr()
    return code, out, err


def one_line(err: str) -> str:
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def edited(record: Path, folder: Path, edit) -> Path:
    data = json.loads(record.read_text())
    edit(data)
    out = folder / f"edited-{record.name}"
    out.write_text(json.dumps(data))
    return out


# Lost or wrong data: concurrent attaches


def _attach_at_once(barrier, recipe, record, answers):
    barrier.wait()
    try:
        answers.put((str(record), [item.action for item in attach(recipe, [record])]))
    except BaseException as error:  # reported to the parent, which fails the test
        answers.put((str(record), repr(error)))


PAIRS = 10


def test_concurrent_attaches_to_one_recipe_lose_no_update(records, tmp_path):
    """PAIRS pairs of processes, each pair attaching two different records to one recipe at the same
    moment (a barrier); every pair must leave both entries, and both must say "added"."""
    context = multiprocessing.get_context("fork")
    lost, answers_seen = [], []
    for pair in range(PAIRS):
        recipe = tmp_path / f"gemma-{pair}.yaml"
        shutil.copy(recipe_path(GEMMA), recipe)
        barrier, answers = context.Barrier(2), context.Queue()
        workers = [context.Process(target=_attach_at_once, args=(barrier, recipe, records[name], answers))
                   for name in ("a", "b")]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(60)
        answers_seen += [answers.get(timeout=5) for _ in workers]
        tests = entry_tests(recipe)
        lost += [(pair, name) for name in ("a", "b") if tests.count(f"toy sums {name}") != 1]
        assert sorted(os.listdir(tmp_path)) == sorted(f"gemma-{i}.yaml" for i in range(pair + 1))  # no lock left
    assert all(actions == ["added"] for _, actions in answers_seen), answers_seen
    assert lost == []


# Symlinks, read-only recipes, record paths


def test_a_symlinked_recipe_is_written_through_to_its_target(records, tmp_path):
    target_dir, link_dir = tmp_path / "recipes", tmp_path / "links"
    target_dir.mkdir(), link_dir.mkdir()
    target = target_dir / "gemma.yaml"
    shutil.copy(recipe_path(GEMMA), target)
    link = link_dir / "gemma.yaml"
    link.symlink_to(target)
    attach(link, [records["a"]])
    assert link.is_symlink() and link.resolve() == target
    assert "toy sums a" in entry_tests(target)
    assert sorted(os.listdir(link_dir)) == ["gemma.yaml"] and sorted(os.listdir(target_dir)) == ["gemma.yaml"]


def test_a_read_only_recipe_is_refused_in_one_line(records, gemma_copy, capsys):
    gemma_copy.chmod(0o444)
    before = gemma_copy.read_bytes()
    code, out, err = cli(capsys, "attach", records["a"], gemma_copy)
    assert code == EXIT_BAD_INPUT and out == ""
    assert f"recipe {gemma_copy}: read-only (mode 0444)" in one_line(err)
    with pytest.raises(RecipeError, match="read-only"):
        attach_convergence(gemma_copy, {"steps": 20, "result": "pass"}, "a note")
    assert gemma_copy.read_bytes() == before and stat.S_IMODE(gemma_copy.stat().st_mode) == 0o444
    assert attach(gemma_copy, [records["a"]], dry_run=True)[0].action == "added"  # a dry run writes nothing


@pytest.mark.parametrize("name", ["...yaml", "..yaml"])
def test_a_recipe_whose_id_would_leave_the_results_folder_is_refused(tmp_path, capsys, name):
    """`...yaml` gives the id `gemma-4-31b/h100/..`: its records would go to results/gemma-4-31b/h100/../.
    Refused on reading, before `run` runs anything."""
    dots = tmp_path / "recipes" / name
    dots.parent.mkdir()
    shutil.copy(recipe_path(GEMMA), dots)
    message = (f"recipe {dots}: its file name cannot name a results folder (its id would be"
               f" 'gemma-4-31b/h100/{dots.stem}')")
    with pytest.raises(RecipeError, match=re.escape(message)):
        load_recipe(dots)
    code, _, err = cli(capsys, "run", dots, "--results-dir", tmp_path / "results")
    assert code == EXIT_BAD_INPUT and message in one_line(err)
    assert sorted(os.listdir(tmp_path)) == ["recipes"]  # nothing written, results/.. included


@pytest.mark.parametrize(("recipe_id", "record_id"), [
    ("../outside", "lever--cpu--x"), ("a/../../b", "lever--cpu--x"), ("/tmp/absolute", "lever--cpu--x"),
    ("", "lever--cpu--x"), ("a//b", "lever--cpu--x"), ("gemma/h100/x", "../lever"), ("gemma/h100/x", ".."),
])
def test_record_paths_stay_inside_the_results_folder(records, tmp_path, recipe_id, record_id):
    """However a record came by its ids (a recipe id `..`, a record edited by hand), write_record
    puts nothing outside the results folder."""
    data = json.loads(records["a"].read_text())
    data["recipe"]["id"], data["lever"]["record_id"] = recipe_id, record_id
    results = tmp_path / "results"
    with pytest.raises(CorrectnessError, match="would place a record outside the results folder"):
        write_record(data, results)
    assert os.listdir(tmp_path) == []


# Records: schema and figures


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_a_record_with_a_non_finite_figure_is_refused_naming_the_field(records, gemma_copy, tmp_path, capsys, token):
    text = records["a"].read_text()
    bad = tmp_path / "nonfinite.json"
    bad.write_text(re.sub(r'"error": [-0-9.e]+', f'"error": {token}', text, count=1))
    before = gemma_copy.read_bytes()
    code, _, err = cli(capsys, "attach", bad, gemma_copy)
    assert code == EXIT_BAD_INPUT
    assert f"result record {bad}: field cases.0.candidate.tensors.0.error is " in one_line(err)
    assert "not a finite number" in err
    assert gemma_copy.read_bytes() == before


@pytest.mark.parametrize(("edit", "complaint"), [
    (lambda data: data.pop("lever"), "field lever: missing (a required field)"),
    (lambda data: data.update(cases={"sums-seed0": {}}), "field cases: {'sums-seed0': {}} is not of type 'array'"),
    (lambda data: data.update(cases="none"), "field cases: 'none' is not of type 'array'"),
    (lambda data: data.update(started="yesterday"), "field started: 'yesterday' is not a valid date-time"),
    (lambda data: data.update(finished="2026-13-01T00:00:00+00:00"), "field finished: '2026-13-01T00:00:00+00:00'"
                                                                      " is not a valid date-time"),
    (lambda data: data.update(finished="2026-12-01T00:00:00"), "field finished: '2026-12-01T00:00:00' is not a"
                                                                " valid date-time"),  # no time zone
    (lambda data: data.update(finished=20261201), "field finished: 20261201 is not of type 'string'"),
    (lambda data: data["cases"][0].pop("candidate"), "field cases.0.candidate: missing (a required field)"),
    (lambda data: data["cases"][0].update(status="maybe"), "field cases.0.status: 'maybe' is not one of"),
    (lambda data: data["lever"].update(cases="sums-seed0"), "field lever.cases: 'sums-seed0' is not of type 'array'"),
    (lambda data: data["cases"][0]["candidate"]["tensors"][0].update(error="small"),
     "field cases.0.candidate.tensors.0.error: 'small' is not of type 'number', 'null'"),
], ids=["no-lever", "cases-a-mapping", "cases-a-string", "started-not-a-date", "finished-month-13",
        "finished-no-zone", "finished-a-number", "case-without-candidate", "unknown-status", "lever-cases-a-string",
        "error-a-string"])
def test_a_record_off_the_schema_is_refused_in_one_line_naming_the_field(records, gemma_copy, tmp_path, capsys,
                                                                        edit, complaint):
    bad = edited(records["a"], tmp_path, edit)
    before = gemma_copy.read_bytes()
    with pytest.raises(CorrectnessError) as refused:
        read_record(bad)
    assert str(refused.value) == f"result record {bad}: {complaint}" or str(refused.value).startswith(
        f"result record {bad}: {complaint}")
    code, _, err = cli(capsys, "attach", bad, gemma_copy)
    assert code == EXIT_BAD_INPUT and complaint in one_line(err)
    assert gemma_copy.read_bytes() == before


def test_a_real_lever_record_fits_the_record_schema(tmp_path):
    """A record of a real lever (the packed loss's CPU tier: slices none, invariants none) and of
    the attention lever's declaration with slices and invariants, as written, read back."""
    from correctness.harness import build_record, run_case
    from correctness.loss import lever as loss_packing

    lever = loss_packing.cpu_tier("nemotron-3-super-120b-a12b/h200/attune-tp4-pp2-ep8-mt16k", LeverOptions())[0]
    record = build_record(lever, [run_case(lever, case) for case in lever.cases], "2026-01-01T00:00:00+00:00", 1.0)
    data = read_record(write_record(record, tmp_path))
    assert data["format_version"] == FORMAT_VERSION and data["verdict"] == "pass"
    assert all(t["systematic"]["flagged"] is False for case in data["cases"] for t in case["candidate"]["tensors"])


def test_a_format_version_written_as_a_string_is_named_as_a_string(records, tmp_path):
    bad = edited(records["a"], tmp_path, lambda data: data.update(format_version="2"))
    with pytest.raises(CorrectnessError, match=re.escape(
            f"result record {bad}: format_version is the string '2'; this suite reads the number {FORMAT_VERSION}")):
        read_record(bad)


# Stray temporary files


def _dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def _stray(folder: Path, name: str, pid: int, age: float) -> Path:
    path = folder / f".{name}.{pid}.tmp"
    path.write_bytes(b"")
    os.utime(path, (time.time() - age, time.time() - age))
    return path


def test_stray_temporary_files_of_an_interrupted_attach_are_removed_on_the_next_one(records, gemma_copy):
    folder, name = gemma_copy.parent, gemma_copy.name
    live = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    try:
        dead_old = _stray(folder, name, _dead_pid(), age=300)  # interrupted five minutes ago: stray
        stale = _stray(folder, name, live[0].pid, age=3600)  # an hour old: stray, whoever has its pid now
        live_writer = _stray(folder, name, live[1].pid, age=0)  # a write in progress: kept
        dead_recent = _stray(folder, name, _dead_pid(), age=5)  # too young to tell from another host's write: kept
        other = _stray(folder, "other.yaml", _dead_pid(), age=300)  # another file's: not this write's business
        attach(gemma_copy, [records["a"]])
    finally:
        for process in live:
            process.kill()
            process.wait()
    assert not dead_old.exists() and not stale.exists()
    assert live_writer.exists() and dead_recent.exists() and other.exists()
    assert "toy sums a" in entry_tests(gemma_copy)


def test_stray_temporary_files_of_an_interrupted_record_write_are_removed_on_the_next_one(records, tmp_path):
    data = json.loads(records["a"].read_text())
    path = write_record(data, tmp_path)
    dead_old = _stray(path.parent, path.name, _dead_pid(), age=300)
    write_record(data, tmp_path)
    assert not dead_old.exists() and list(path.parent.iterdir()) == [path]


# Resource exhaustion: aliases and nesting


LAUGHS = "\n".join(
    ['x-laughs:', '  a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    + [f"  {name}: &{name} [{','.join([f'*{previous}'] * 9)}]" for previous, name in zip("abcdefgh", "bcdefghi")]
) + "\n"  # 9^9 = 387,420,489 values when expanded, from about 340 bytes


@pytest.fixture
def bomb(tmp_path):
    """The Gemma recipe with a billion-laughs block: valid against the recipe schema, 1e9 values expanded."""
    path = tmp_path / "bomb.yaml"
    path.write_text(recipe_path(GEMMA).read_text() + LAUGHS)
    return path


def test_an_alias_bomb_is_refused_before_anything_expands_it(bomb):
    assert 300 < len(LAUGHS) < 400
    started = time.perf_counter()
    with pytest.raises(RecipeError, match=rf"recipe {re.escape(str(bomb))}: its aliases expand to more than"):
        load_recipe(bomb)
    assert time.perf_counter() - started < 2.0


def test_a_few_aliases_are_still_read(gemma_copy):
    gemma_copy.write_text(gemma_copy.read_text() + "x-defaults: &defaults {a: 1, b: 2}\nx-use:\n  <<: *defaults\n"
                          "  b: 3\nx-list: [*defaults, *defaults]\n")
    recipe = load_recipe(gemma_copy)
    assert recipe.data["x-use"] == {"a": 1, "b": 3} and recipe.data["x-list"] == [{"a": 1, "b": 2}] * 2
    validate_recipe(recipe.data, recipe.id)


def test_a_reference_with_an_alias_bomb_is_refused(tmp_path):
    path = tmp_path / "reference.yaml"
    path.write_text("run: python train.py --lr 1\n" + LAUGHS)
    with pytest.raises(RecipeError, match="its aliases expand to more than"):
        load_reference(path)


def test_a_recursive_alias_is_refused(gemma_copy):
    gemma_copy.write_text(gemma_copy.read_text() + "x-self: &self [1, *self]\n")
    with pytest.raises(RecipeError, match="an alias refers to a value that contains it"):
        load_recipe(gemma_copy)


def _without_memory_to_spare():
    """For a child process: 6 GiB of address space (torch's import takes about 1), so that a
    regression fails with MemoryError instead of exhausting the machine."""
    resource.setrlimit(resource.RLIMIT_AS, (6 * 2**30, 6 * 2**30))


@pytest.mark.parametrize("command", ["check", "attach", "classify", "run"])
def test_every_recipe_command_refuses_an_alias_bomb_in_one_line(bomb, records, command):
    """Through the real command line, in a process of its own with a time and memory limit
    (before: 335 s and 7.5 GB for check and attach)."""
    args = {"attach": [records["a"], bomb], "run": [bomb, "--tier", "cpu"]}.get(command, [bomb])
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "correctness.cli", command, *map(str, args)], capture_output=True,
                          text=True, timeout=120, preexec_fn=_without_memory_to_spare)
    assert done.returncode == EXIT_BAD_INPUT, done.stderr[-2000:]
    assert "its aliases expand to more than" in one_line(done.stderr)
    assert time.perf_counter() - started < 60


def nested(levels: int) -> str:
    return "x-deep: " + "[" * levels + "]" * levels + "\n"


@pytest.mark.parametrize(("levels", "complaint"), [(100, "nested 101 levels deep, more than the 64 this suite reads"),
                                                   (600, "nested too deeply to read (more than 64 levels)")])
def test_deep_nesting_is_one_line(gemma_copy, tmp_path, levels, complaint):
    """100 levels: within Python's stack, refused by the depth limit; 600: beyond it (RecursionError)
    at Python's default recursion limit, which torch's compiler raises to 2000 in a process that has
    compiled (compile_fx.py), so the test sets it."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    try:
        _deep_nesting(gemma_copy, tmp_path, levels, complaint)
    finally:
        sys.setrecursionlimit(limit)


def _deep_nesting(gemma_copy, tmp_path, levels, complaint):
    gemma_copy.write_text(gemma_copy.read_text() + nested(levels))
    with pytest.raises(RecipeError, match=re.escape(f"recipe {gemma_copy}: {complaint}")):
        load_recipe(gemma_copy)
    if levels > 500:
        with pytest.raises(RecipeError, match=re.escape(f"recipe {gemma_copy}: nested too deeply")):
            load_document(gemma_copy)
    reference = tmp_path / "reference.yaml"
    reference.write_text("run: python train.py --lr 1\n" + nested(levels))
    with pytest.raises(RecipeError, match=re.escape(f"reference {reference}: nested")):
        load_reference(reference)


def test_a_hundred_thousand_levels_exit_two_in_one_line(gemma_copy, capsys):
    gemma_copy.write_text(gemma_copy.read_text() + nested(100_000))
    code, _, err = cli(capsys, "check", gemma_copy)
    assert code == EXIT_BAD_INPUT and f"recipe {gemma_copy}: nested too deeply to read" in one_line(err)


def test_a_deeply_nested_record_or_curve_is_one_line(tmp_path):
    deep = "[" * 100_000 + "]" * 100_000
    record, curve = tmp_path / "record.json", tmp_path / "curve.json"
    record.write_text('{"format": "correctness.lever-record", "format_version": 2, "x": ' + deep + "}")
    curve.write_text(deep)
    with pytest.raises(CorrectnessError, match=f"result record {re.escape(str(record))}: .*nested too deeply"):
        read_record(record)
    with pytest.raises(CorrectnessError, match=f"{re.escape(str(curve))}: .*nested too deeply"):
        read_curve(curve)


# Resource exhaustion: converge


FAR_APART = """
import json, sys, time, tracemalloc
from correctness.convergence import check_convergence, read_curve
curve = read_curve(sys.argv[1])
tracemalloc.start()  # numpy reports its arrays to tracemalloc
started = time.perf_counter()
coverage = check_convergence(curve, curve).check("step coverage")
seconds = time.perf_counter() - started
print(json.dumps({"steps": curve.steps.tolist(), "seconds": seconds, "peak": tracemalloc.get_traced_memory()[1],
                  "status": coverage.status, "value": coverage.value, "detail": coverage.detail}))
"""


def test_steps_far_apart_are_counted_not_listed(tmp_path):
    """Steps {1, 2, 2e8}: the work follows the three points, not the span (before: a range over
    every step, 300 s and 9.5 GB). In a process of its own with a memory limit, so that a
    regression fails instead of exhausting the machine."""
    path = tmp_path / "losses.json"
    path.write_text('{"1": 3.0, "2": 2.9, "2e8": 2.8}')
    done = subprocess.run([sys.executable, "-c", FAR_APART, str(path)], capture_output=True, text=True, timeout=120,
                          preexec_fn=_without_memory_to_spare)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(done.stdout)
    assert figures["steps"] == [1, 2, 200_000_000]
    assert figures["status"] == "fail" and figures["value"] == 199_999_997
    assert "steps missing from both curves (logging every 1): 3, 4, 5, 6, 7, 8, 9, 10 and 199,999,989 more" \
        in figures["detail"]
    assert figures["seconds"] < 1.0 and figures["peak"] < 10 * 2**20, figures


class _Alarm:
    """Fail instead of hanging: SIGALRM after `seconds` raises TimeoutError in the blocked call."""

    def __init__(self, seconds: int):
        self.seconds = seconds

    def __enter__(self):
        def ring(signum, frame):
            raise TimeoutError(f"still blocked after {self.seconds} s")

        self.previous = signal.signal(signal.SIGALRM, ring)
        signal.alarm(self.seconds)

    def __exit__(self, *exc):
        signal.alarm(0)
        signal.signal(signal.SIGALRM, self.previous)


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "losses.log"
    os.mkfifo(fifo)
    with _Alarm(5), pytest.raises(CorrectnessError, match=re.escape(f"{fifo}: not a regular file (a FIFO)")):
        read_curve(fifo)


def test_dev_zero_is_refused_without_reading_it():
    """In a process of its own with a memory limit: reading /dev/zero to its end never ends."""
    probe = "from correctness.convergence import read_curve; read_curve('/dev/zero')"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                          preexec_fn=_without_memory_to_spare)
    assert "CorrectnessError: /dev/zero: not a regular file (a character device)" in done.stderr


def test_an_input_over_its_limit_is_refused_by_its_size(tmp_path):
    """64 MiB for a loss curve or a record; 1 MiB for YAML, which PyYAML reads slowly."""
    for name, size in (("losses.log", 64 * 2**20 + 1), ("record.json", 64 * 2**20 + 1), ("recipe.yaml", 2**20 + 1)):
        with open(tmp_path / name, "wb") as out:
            out.truncate(size)  # sparse: nothing is written
    message = "larger than 64 MiB, the limit for an input file"
    with pytest.raises(CorrectnessError, match=f"{re.escape(str(tmp_path))}/losses.log: {message}"):
        read_curve(tmp_path / "losses.log")
    with pytest.raises(CorrectnessError, match=f"result record .*record.json: {message}"):
        read_record(tmp_path / "record.json")
    with pytest.raises(RecipeError, match="recipe .*recipe.yaml: larger than 1 MiB, the limit for a YAML file"):
        load_recipe(tmp_path / "recipe.yaml")


# Exit codes and messages: folders, disks and filesystems


@pytest.fixture
def read_only_folder(tmp_path):
    """A folder this process may not add files to, its recipe still writable in place: mode 0555, or,
    for root (whom modes do not stop), the immutable attribute (chattr +i; skipped where refused)."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    shutil.copy(recipe_path(GEMMA), folder / "gemma.yaml")
    root = os.geteuid() == 0
    if root:
        done = subprocess.run(["chattr", "+i", str(folder)], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot make a folder immutable here: {done.stderr.strip()}")
    else:
        folder.chmod(0o555)
    yield folder
    if root:
        subprocess.run(["chattr", "-i", str(folder)], check=True)
    folder.chmod(0o755)


def test_attach_in_a_read_only_folder_exits_two_in_one_line(records, read_only_folder, capsys):
    recipe = read_only_folder / "gemma.yaml"
    before = recipe.read_bytes()
    code, _, err = cli(capsys, "attach", records["a"], recipe)
    assert code == EXIT_BAD_INPUT
    assert re.search(rf"recipe {re.escape(str(recipe))}: cannot lock it for writing \((Permission denied|Operation "
                     rf"not permitted): {re.escape(str(read_only_folder))}\)$", one_line(err).strip()), err
    assert recipe.read_bytes() == before and os.listdir(read_only_folder) == ["gemma.yaml"]


@pytest.fixture
def filesystem(tmp_path):
    """mount(size) -> a folder on a fresh tmpfs of `size` bytes (unmounted after the test); the test
    is skipped where this process may not mount (not root, or a container without the capability)."""
    mounted = []

    def mount(size: int) -> Path:
        folder = tmp_path / f"fs{len(mounted)}"
        folder.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},nr_inodes=64", "tmpfs", str(folder)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(folder)
        return folder

    yield mount
    for folder in reversed(mounted):
        subprocess.run(["umount", "-l", str(folder)], check=False)


def test_a_full_disk_exits_two_in_one_line_and_leaves_the_recipe(records, filesystem, capsys):
    folder = filesystem(256 * 1024)
    recipe = folder / "gemma.yaml"
    shutil.copy(recipe_path(GEMMA), recipe)
    with open(folder / "filler", "wb", buffering=0) as filler:  # take every block left
        with pytest.raises(OSError, match="No space left on device"):
            while True:
                filler.write(b"x" * 4096)
    before = recipe.read_bytes()
    code, _, err = cli(capsys, "attach", records["a"], recipe)
    assert code == EXIT_BAD_INPUT
    assert f"recipe {recipe}: cannot be written (No space left on device)" in one_line(err)
    assert recipe.read_bytes() == before and sorted(os.listdir(folder)) == ["filler", "gemma.yaml"]


def test_a_full_disk_anywhere_in_the_write_is_one_line(records, gemma_copy, capsys, monkeypatch):
    """Where nothing can be mounted: the temporary file's fsync reports ENOSPC, as it may on NFS."""
    real_fsync = os.fsync

    def full(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".tmp"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full)
    before = gemma_copy.read_bytes()
    code, _, err = cli(capsys, "attach", records["a"], gemma_copy)
    assert code == EXIT_BAD_INPUT
    assert f"recipe {gemma_copy}: cannot be written (No space left on device)" in one_line(err)
    assert gemma_copy.read_bytes() == before and os.listdir(gemma_copy.parent) == ["gemma.yaml"]


def test_a_read_only_filesystem_exits_two_in_one_line(records, filesystem, capsys):
    folder = filesystem(1024 * 1024)
    recipe = folder / "gemma.yaml"
    shutil.copy(recipe_path(GEMMA), recipe)
    subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)
    before = recipe.read_bytes()
    code, _, err = cli(capsys, "attach", records["a"], recipe)
    assert code == EXIT_BAD_INPUT
    assert f"recipe {recipe}: cannot be written (Read-only file system)" in one_line(err)
    with pytest.raises(RecipeError, match=re.escape(f"recipe {recipe}: cannot be written (Read-only file system)")):
        write_recipe(recipe, load_document(recipe))  # without attach's check first: the write's own error
    assert recipe.read_bytes() == before


def test_a_failed_write_reports_its_own_error_not_the_cleanups(gemma_copy, monkeypatch):
    """On a read-only filesystem creating the temporary file fails, and so does removing it."""
    document = load_document(gemma_copy)
    real_open, real_unlink = os.open, os.unlink

    def refuse_open(path, *args, **kwargs):
        if str(path).endswith(".tmp"):
            raise OSError(errno.EROFS, "the write's own error", str(path))
        return real_open(path, *args, **kwargs)

    def refuse_unlink(path, *args, **kwargs):
        if str(path).endswith(".tmp"):
            raise OSError(errno.EROFS, "the cleanup's error", str(path))
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse_open)
    monkeypatch.setattr(os, "unlink", refuse_unlink)
    monkeypatch.setattr(Path, "unlink", lambda self, missing_ok=False: refuse_unlink(self))
    with pytest.raises(RecipeError, match=re.escape(f"recipe {gemma_copy}: cannot be written (the write's own error)")):
        write_recipe(gemma_copy, document)


# Exit codes and messages: byte order marks, duplicate keys


def test_a_utf8_byte_order_mark_is_read_and_kept(records, gemma_copy, tmp_path):
    with_bom = tmp_path / "bom.yaml"
    with_bom.write_bytes(BOM + gemma_copy.read_bytes())
    assert load_recipe(with_bom).model == "Gemma-4-31B"
    write_recipe(with_bom, load_document(with_bom))  # an unchanged round trip: the same bytes
    assert with_bom.read_bytes() == BOM + gemma_copy.read_bytes()
    attach(with_bom, [records["a"]])
    attach(gemma_copy, [records["a"]])
    assert with_bom.read_bytes() == BOM + gemma_copy.read_bytes()
    assert recipe_text(load_document(with_bom)) == gemma_copy.read_text()


def test_a_byte_order_mark_in_a_curve_or_a_record_is_not_a_character(records, tmp_path):
    csv, losses = tmp_path / "losses.csv", tmp_path / "losses.json"
    csv.write_bytes(BOM + b"step,loss\n1,2.5\n2,2.4\n")
    losses.write_bytes(BOM + b"[2.5, 2.4]")
    assert read_curve(csv).steps.tolist() == read_curve(losses).steps.tolist() == [1, 2]
    record = tmp_path / "record.json"
    record.write_bytes(BOM + records["a"].read_bytes())
    assert read_record(record) == read_record(records["a"])


DUPLICATE = "model: Another-Model\n"


def test_a_duplicate_key_is_named_with_its_line(records, gemma_copy, capsys):
    text = gemma_copy.read_text()
    first = next(number for number, line in enumerate(text.splitlines(), 1) if line.startswith("model:"))
    gemma_copy.write_text(text.replace("\nmodel:", f"\n{DUPLICATE}model:", 1))
    expected = f"recipe {gemma_copy}: duplicate key 'model' at line {first + 1}"
    with pytest.raises(RecipeError, match=re.escape(f"{expected} (first at line {first})")):
        load_recipe(gemma_copy)
    with pytest.raises(RecipeError, match=re.escape(expected)):
        load_document(gemma_copy)
    code, _, err = cli(capsys, "attach", records["a"], gemma_copy)
    assert code == EXIT_BAD_INPUT and expected in one_line(err)
    code, _, err = cli(capsys, "check", gemma_copy)
    assert code == EXIT_BAD_INPUT and expected in one_line(err)


def test_a_nested_duplicate_key_is_named_and_merges_are_not_duplicates(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("base: &base {a: 1}\nuse:\n  <<: *base\n  a: 2\nlayout:\n  tp: 2\n  pp: 4\n  tp: 4\n")
    with pytest.raises(RecipeError, match=re.escape(f"recipe {path}: duplicate key 'tp' at line 8 (first at line 6)")):
        load_recipe(path)
    path.write_text("layout: {tp: 2, tp: 4}\n")
    with pytest.raises(RecipeError, match=re.escape(f"recipe {path}: duplicate key 'tp' at line 1 (first at line 1)")):
        load_recipe(path)
    path.write_text("model: M\ngpu: {type: H100}\nbase: &base {a: 1}\nuse:\n  <<: *base\n  a: 2\n")
    assert load_recipe(path).data["use"] == {"a": 2}
