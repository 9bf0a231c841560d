"""Stopping a run: Ctrl-C (SIGINT) and SIGTERM end `pytest` and `correctness run` in order, with exit
status 130 / 143, leaving no process of the run (rank server, ranks, multiprocessing's resource
tracker) and no temporary folder of the suite's (correctness-gloo-*, pymp-*); a run killed outright
(SIGKILL) still leaves no process for long; an interrupted session's records land beside a complete
one, never over it.

Each run starts in a session of its own, with a temporary folder (TMPDIR) of its own: what is left
of it is what that session and that folder still hold."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from correctness import distributed
from correctness.distributed import Stopped, rank_server_pid, run_ranks, stop_rank_server
from correctness.fixtures import recipe_path
from correctness.record_store import INTERRUPTED_FOLDER
from correctness.results import read_record
from test_pytest_plugin import CONFTEST, TOY_LEVERS

pytest_plugins = ("pytester",)

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads processes from /proc (Linux)")

GEMMA = "gemma-4-31b/h100/attune-tp2-pp4-split13"
SUITE_FOLDERS = ("correctness-gloo-", "pymp-")  # the temporary folders a run of the suite makes
READY_WITHIN = 90.0  # seconds for a run to start its ranks (torch's import, on a loaded machine)
STOPPED_WITHIN = 10.0  # seconds from the signal to the run's exit
GONE_WITHIN = 10.0  # seconds from the run's exit until none of its processes is left

# A component test whose two gloo ranks say they exist (a file each), then sleep. The rank server
# imports torch alone: the suite's megatron-core modules would only slow the start.
RANKS_TEST = '''
import os
import time
from pathlib import Path

import correctness.distributed as distributed

distributed.PRELOADED = ["torch", "torch.distributed"]


def sleep_in_ranks(rank, world_size, markers):
    Path(markers, f"rank-{rank}").write_text(str(os.getpid()))
    time.sleep(120)


def test_ranks_sleep():
    Path(os.environ["MARKERS"], "started").write_text("")
    distributed.run_ranks(sleep_in_ranks, 2, os.environ["MARKERS"], timeout=300)
'''

# Slows the quiet collection `correctness run` makes before its session (--collect-only) only.
SLOW_COLLECTION = '''
import os
import time
from pathlib import Path


def pytest_collection_modifyitems(config, items):
    if config.option.collectonly and os.environ.get("SLOW_COLLECTION"):
        Path(os.environ["MARKERS"], "collecting").write_text("")
        time.sleep(60)
'''

# `correctness run` with its component tests taken from the folder given first.
RUN_DRIVER = textwrap.dedent('''
    import sys
    from correctness.commands import run
    run.COMPONENT_TESTS = sys.argv.pop(1)
    from correctness.cli import main
    sys.exit(main(sys.argv[1:]))
''')


class Run:
    """A command started in a session of its own, with its own temporary folder and marker folder."""

    def __init__(self, tmp_path: Path, command: list[str], **environment: str) -> None:
        # Not below tmp_path: multiprocessing's socket lies in it, and a socket's path has at most 107 bytes.
        self.temporary = Path(tempfile.mkdtemp(prefix="stopping-"))
        self.markers = tmp_path / "markers"
        self.markers.mkdir()
        self.output = tmp_path / "output.txt"
        env = {**os.environ, "TMPDIR": str(self.temporary), "MARKERS": str(self.markers), **environment}
        with open(self.output, "wb") as output:
            self.process = subprocess.Popen(command, cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, stdout=output,
                                            stderr=subprocess.STDOUT, start_new_session=True,
                                            preexec_fn=_default_sigint)

    def wait_for(self, *markers: str) -> None:
        deadline = time.monotonic() + READY_WITHIN
        while not all((self.markers / marker).exists() for marker in markers):
            assert self.process.poll() is None, f"the run ended early ({self.process.returncode}):\n{self.log()}"
            assert time.monotonic() < deadline, f"no {markers} within {READY_WITHIN:g} s:\n{self.log()}"
            time.sleep(0.1)

    def stop(self, signum: int, group: bool = False) -> tuple[int, float]:
        """Send the signal (to the whole session's process group, as a terminal's Ctrl-C does, or to
        the run's own process); its exit status and how long it took to come."""
        sent = time.monotonic()
        (os.killpg if group else os.kill)(self.process.pid, signum)
        try:
            status = self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            status = None
        return status, time.monotonic() - sent

    def processes_left(self) -> list[str]:
        """The processes of the run's session that are still there once it has had GONE_WITHIN seconds."""
        deadline = time.monotonic() + GONE_WITHIN
        while (left := session_processes(self.process.pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        return left

    def folders_left(self) -> list[str]:
        return sorted(path.name for path in self.temporary.iterdir() if path.name.startswith(SUITE_FOLDERS))

    def log(self) -> str:
        return self.output.read_text(errors="replace")[-4000:]

    def end(self) -> None:
        """Whatever happened, nothing of the run outlives the test."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        if session_processes(self.process.pid):
            os.killpg(self.process.pid, signal.SIGKILL)
        shutil.rmtree(self.temporary, ignore_errors=True)


def _default_sigint() -> None:
    # A child inherits an ignored SIGINT (a CI runner's, a shell's background job): Python then
    # leaves Ctrl-C ignored. Here the child takes it, as from a terminal.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def session_processes(session: int) -> list[str]:
    """The live processes of a session (a zombie is dead: it holds nothing but its pid), each as
    "pid command line"."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            command = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # it ended meanwhile
            continue
        state, _parent, _group, its_session = text[text.rindex(")") + 2:].split()[:4]
        if int(its_session) == session and state != "Z":
            found.append(f"{stat.parent.name} {command[:160]}")
    return found


@pytest.fixture
def ranks_project(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_ranks.py").write_text(RANKS_TEST)
    return tmp_path


def pytest_run(project: Path) -> Run:
    return Run(project, [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_ranks.py"])


@pytest.mark.parametrize(("signum", "group", "status"), [(signal.SIGINT, True, 130), (signal.SIGTERM, False, 143)],
                         ids=["ctrl-c", "sigterm"])
def test_a_signal_mid_gloo_run_stops_pytest_and_leaves_nothing(ranks_project, signum, group, status):
    run = pytest_run(ranks_project)
    try:
        run.wait_for("rank-0", "rank-1")
        code, took = run.stop(signum, group=group)
        assert code == status, run.log()
        assert took < STOPPED_WITHIN, run.log()
        assert run.processes_left() == [], run.log()
        assert run.folders_left() == [], run.log()
    finally:
        run.end()


def test_a_killed_runs_ranks_and_rank_server_end_with_it(ranks_project):
    """SIGKILL cannot be handled (its folders stay), but no process of the run outlives it for long:
    the ranks end when their caller does, then the rank server and the resource tracker."""
    run = pytest_run(ranks_project)
    try:
        run.wait_for("rank-0", "rank-1")
        code, _ = run.stop(signal.SIGKILL)
        assert code == -signal.SIGKILL
        assert run.processes_left() == [], run.log()
    finally:
        run.end()


@pytest.fixture
def component_tests(tmp_path):
    """A stand-in for component_tests/: the ranks' test, and a collection that can be slowed."""
    folder = tmp_path / "component_tests"
    folder.mkdir()
    (folder / "conftest.py").write_text(SLOW_COLLECTION)
    (folder / "test_ranks.py").write_text(RANKS_TEST)
    return folder


def correctness_run(tmp_path: Path, tests: Path, **environment: str) -> Run:
    return Run(tmp_path, [sys.executable, "-c", RUN_DRIVER, str(tests), "run", str(recipe_path(GEMMA)), "--tier", "cpu",
                          "--results-dir", str(tmp_path / "results")], **environment)


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["ctrl-c", "sigterm"])
def test_a_signal_during_the_preflight_collection_stops_correctness_run_before_any_test(tmp_path, component_tests,
                                                                                        signum, status):
    run = correctness_run(tmp_path, component_tests, SLOW_COLLECTION="1")
    try:
        run.wait_for("collecting")
        code, took = run.stop(signum)
        assert code == status, run.log()
        assert took < STOPPED_WITHIN, run.log()
        assert not (run.markers / "started").exists(), run.log()
        assert "stopped by " + signal.Signals(signum).name in run.log()
        assert run.processes_left() == [], run.log()
    finally:
        run.end()


def test_sigterm_mid_gloo_run_stops_correctness_run_and_leaves_nothing(tmp_path, component_tests):
    run = correctness_run(tmp_path, component_tests)
    try:
        run.wait_for("rank-0", "rank-1")
        code, took = run.stop(signal.SIGTERM)
        assert code == 143, run.log()
        assert took < STOPPED_WITHIN, run.log()
        assert run.processes_left() == [], run.log()
        assert run.folders_left() == [], run.log()
    finally:
        run.end()


def add_one(rank, world_size):
    return rank + 1


def test_the_rank_server_stops_and_the_next_run_starts_another(monkeypatch):
    monkeypatch.setattr(distributed, "PRELOADED", ["torch", "torch.distributed"])  # a quick start
    assert run_ranks(add_one, 2) == [1, 2]
    first = rank_server_pid()
    assert first is not None
    stop_rank_server()
    assert rank_server_pid() is None
    with pytest.raises(ProcessLookupError):
        os.kill(first, 0)  # gone, and reaped
    try:
        assert run_ranks(add_one, 2) == [1, 2]
        assert rank_server_pid() not in (None, first)
    finally:
        stop_rank_server()  # the next test's runs start one with every module preloaded


# A toy lever's test whose session is stopped after its first case (of two) has run.
STOPPED_AFTER_FIRST_CASE = '''
import os

import pytest

from correctness.distributed import Stopped
from toy_levers import one_good_lever


@pytest.mark.levers(factory=one_good_lever)
def test_sum(lever, case, lever_check):
    lever_check(lever, case)
    if os.environ.get("STOP_WITH") == "SIGINT":
        raise KeyboardInterrupt
    if os.environ.get("STOP_WITH") == "SIGTERM":
        raise Stopped(15)
'''


def records_in(results: Path) -> list[Path]:
    """The records in a results folder, not those kept beside (in hidden folders)."""
    return [path for path in sorted(results.rglob("*.json"))
            if not any(part.startswith(".") for part in path.relative_to(results).parts)]


@pytest.mark.parametrize(("stop", "status"), [("SIGINT", 130), ("SIGTERM", 143)])
def test_an_interrupted_session_keeps_the_complete_record_and_writes_its_own_beside(pytester, monkeypatch, stop,
                                                                                   status):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(toy_levers=TOY_LEVERS, test_toy=STOPPED_AFTER_FIRST_CASE)
    pytester.syspathinsert()
    results = pytester.path / "records"
    arguments = ("-p", "no:cacheprovider", "-p", "no:hypothesispytest", "--results-dir", str(results))
    monkeypatch.delenv("STOP_WITH", raising=False)
    pytester.runpytest(*arguments).assert_outcomes(passed=2)
    [held] = records_in(results)
    before = held.read_bytes()

    monkeypatch.setenv("STOP_WITH", stop)
    result = pytester.runpytest(*arguments, no_reraise_ctrlc=True)
    assert result.ret == status
    assert held.read_bytes() == before
    kept = read_record(held.parent / INTERRUPTED_FOLDER / held.name)
    assert kept["interrupted"] is True and [case["case_id"] for case in kept["cases"]] == ["sum-n64-seed0"]
    result.stdout.fnmatch_lines([f"*record: {held.name}", f"    in *{INTERRUPTED_FOLDER}"])


def test_a_session_stopped_after_a_levers_last_case_writes_it_as_complete(pytester, monkeypatch):
    """Interrupted is a lever run's state, not the session's: a lever all of whose selected cases
    ran before the stop has a complete record, which replaces the held one."""
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(toy_levers=TOY_LEVERS, test_toy=STOPPED_AFTER_FIRST_CASE
                        + "\n\ndef test_after():\n    raise KeyboardInterrupt\n")
    results = pytester.path / "records"
    pytester.syspathinsert()
    monkeypatch.delenv("STOP_WITH", raising=False)
    result = pytester.runpytest("-p", "no:cacheprovider", "-p", "no:hypothesispytest", "--results-dir", str(results),
                                no_reraise_ctrlc=True)
    assert result.ret == 130
    [held] = records_in(results)
    record = read_record(held)
    assert record["interrupted"] is False and record["verdict"] == "pass"
    assert not (held.parent / INTERRUPTED_FOLDER).exists()


def test_stopped_is_a_keyboard_interrupt_with_the_shells_exit_status():
    assert isinstance(Stopped(signal.SIGTERM), KeyboardInterrupt)
    assert Stopped(signal.SIGTERM).exit_status == 143 and Stopped(signal.SIGINT).exit_status == 130
