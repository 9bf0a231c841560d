"""The unit tests' time limit (its hooks, imported by tests/conftest.py): a unit test's own call may
take at most UNIT_TEST_LIMIT seconds of CPU time on a CPU with BF16 hardware, unless it is marked
`@pytest.mark.slow(reason=...)` with the reason it needs more; over it, the test fails saying so.

CPU time, not wall time: the test's process and the subprocesses it waited for (a `correctness run`
it starts), so that a test is not failed for sharing the machine with pytest-xdist's other workers;
less what the worker's rank server had used before the test, where the test ends it (reaping it
counts everything its earlier ranks did).
It is counted where torch runs one thread per process (pytest-xdist's workers, as `make test` runs
them: correctness.pytest_plugin sets it), where CPU time is a single core's work; a shared fixture's
setup is charged to no test (benchmarks/test_durations.py lists them). The component tests are
exempt: their time is the recipe's cases, measured by benchmarks/cpu_tier.py."""

import functools
import os
import resource
from pathlib import Path

import pytest

UNIT_TEST_LIMIT = 10.0  # CPU seconds of a unit test's call, on BF16 hardware
LIMIT_VARIABLE = "CORRECTNESS_UNIT_TEST_LIMIT"  # another limit in seconds, enforced on any CPU (this suite's test of it)
CALL_SECONDS = pytest.StashKey[float]()
BF16_FLAGS = {"avx512_bf16", "amx_bf16"}
# oneDNN limited to an ISA without BF16 instructions (ONEDNN_MAX_CPU_ISA=AVX2 stands in for a CPU
# without BF16 hardware): the limit does not apply.
ISAS_WITHOUT_BF16 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}


@functools.cache
def bf16_hardware() -> bool:
    """Whether this CPU has BF16 instructions (avx512_bf16 or AMX) that oneDNN is allowed to use."""
    if os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() in ISAS_WITHOUT_BF16:
        return False
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return bool(BF16_FLAGS & set(flags))


def cpu_seconds() -> float:
    """CPU seconds this process and its waited-for children have used so far."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def rank_server_seconds() -> tuple[int | None, float]:
    """This process's rank server (correctness.distributed) and the CPU seconds it and its ended
    ranks have used so far (0 where none runs). A test that ends the server (a pytest session run
    in process stops it) reaps it, and with it everything earlier tests' ranks did: that much is
    not the test's own."""
    from correctness.distributed import rank_server_pid

    pid = rank_server_pid()
    if pid is None:
        return None, 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return pid, 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    return pid, sum(int(value) for value in fields[11:15]) / ticks  # utime, stime, cutime, cstime


def limit() -> float | None:
    """The limit in force here: None outside pytest-xdist's workers, and on a CPU without BF16 hardware."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return None
    if os.environ.get(LIMIT_VARIABLE):
        return float(os.environ[LIMIT_VARIABLE])
    return UNIT_TEST_LIMIT if bf16_hardware() else None


def over_limit(seconds: float, slow_reason: str | None, allowed: float | None) -> str | None:
    """The failure message of a unit test's call that took `seconds` of CPU time, or None."""
    if allowed is None or seconds <= allowed or slow_reason:
        return None
    return (f"the test took {seconds:.1f} s of CPU time, over the {allowed:g} s a unit test may take on"
            " BF16 hardware (tests/unit_time.py): make it cheaper, or mark it @pytest.mark.slow(reason=...)"
            " saying why it needs more")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    server, earlier = rank_server_seconds()
    started = cpu_seconds()
    yield
    spent = cpu_seconds() - started
    if server is not None and rank_server_seconds()[0] != server:  # ended, and reaped, during the call
        spent -= earlier
    item.stash[CALL_SECONDS] = spent


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.when != "call" or not report.passed:
        return
    marker = item.get_closest_marker("slow")
    reason = marker and (marker.kwargs.get("reason") or (marker.args[0] if marker.args else None))
    failure = over_limit(item.stash.get(CALL_SECONDS, 0.0), reason, limit())
    if failure:
        report.outcome, report.longrepr = "failed", failure
