"""The unit tests' time limit (tests/unit_time.py): a unit test over it fails saying so, one marked
slow with a reason passes, and one within it passes; the limit holds only where it is measured."""

from pathlib import Path

import pytest

from unit_time import LIMIT_VARIABLE, over_limit

pytest_plugins = ("pytester",)

TESTS = Path(__file__).parent

BURNING = '''
import time

import pytest


def burn(seconds):
    start = time.process_time()
    while time.process_time() - start < seconds:
        pass


def test_within_the_limit():
    burn(0.05)


def test_over_the_limit():
    burn(0.6)


@pytest.mark.slow(reason="it burns on purpose")
def test_over_the_limit_with_a_reason():
    burn(0.6)


@pytest.mark.slow
def test_over_the_limit_marked_without_a_reason():
    burn(0.6)
'''


def test_over_limit_names_the_time_the_limit_and_the_way_out():
    message = over_limit(12.34, None, 10.0)
    assert "12.3 s of CPU time, over the 10 s" in message and "@pytest.mark.slow(reason=...)" in message
    assert over_limit(9.9, None, 10.0) is None
    assert over_limit(12.34, "runs a seed recipe end to end", 10.0) is None
    assert over_limit(1e6, None, None) is None  # no limit in force (no BF16 hardware, or not an xdist worker)


@pytest.mark.slow(reason="the 0.3 s limit it sets for its inner session is in force for it too")
def test_a_test_over_the_limit_fails_unless_it_says_why(pytester, monkeypatch):
    monkeypatch.setenv(LIMIT_VARIABLE, "0.3")
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")  # the limit is counted in xdist's workers
    monkeypatch.syspath_prepend(str(TESTS))
    pytester.makeconftest("from unit_time import pytest_runtest_call, pytest_runtest_makereport\n"
                          "def pytest_configure(config):\n"
                          "    config.addinivalue_line('markers', 'slow(reason): allowed more')\n")
    pytester.makepyfile(test_burning=BURNING)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:xdist", "-p", "no:randomly")
    outcomes = {report.nodeid.rsplit("::", 1)[-1]: report.outcome
                for report in result.reprec.getreports("pytest_runtest_logreport") if report.when == "call"}
    assert outcomes == {"test_within_the_limit": "passed", "test_over_the_limit": "failed",
                        "test_over_the_limit_with_a_reason": "passed",
                        "test_over_the_limit_marked_without_a_reason": "failed"}, outcomes
    result.stdout.fnmatch_lines(["*over the 0.3 s a unit test may take on BF16 hardware*"])


def test_outside_xdists_workers_no_limit_is_counted(pytester, monkeypatch):
    monkeypatch.setenv(LIMIT_VARIABLE, "0.3")
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.syspath_prepend(str(TESTS))
    pytester.makeconftest("from unit_time import pytest_runtest_call, pytest_runtest_makereport\n"
                          "def pytest_configure(config):\n"
                          "    config.addinivalue_line('markers', 'slow(reason): allowed more')\n")
    pytester.makepyfile(test_burning=BURNING)
    pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:xdist").assert_outcomes(passed=4)
