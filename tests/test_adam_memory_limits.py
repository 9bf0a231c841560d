"""The optimizer-offload and precision-aware-Adam cases declare their peak memory (Case.memory_bytes),
so that at the recipe scale a machine with too little memory refuses them when they are built, in
seconds, instead of running them into swap: with CORRECTNESS_MEMORY_BYTES=5e8 both reached 2.5 GB and
ran on for minutes before the estimate. The estimate is held to a measured peak at the smoke scale."""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from correctness.adam_precision import lever as precision
from correctness.errors import OverMemory
from correctness.fixtures import COMPONENT_TESTS_DIR
from correctness.lever import LeverOptions
from correctness.memory import MEMORY_ENV
from correctness.optimizer import lever as offload
from correctness.recipe_sets import GEMMA

NEMOTRON = "nemotron-3-super-120b-a12b/h200/attune-tp4-pp2-ep8-mt16k"
SMALL = "5e8"  # bytes: the hostile trial's budget, as it wrote it
FACTORIES = {"optimizer-offload": offload.cpu_tier, "precision-aware-adam": precision.cpu_tier}


@pytest.mark.parametrize("given, value", [("5e8", 5 * 10**8), ("500000000", 5 * 10**8), ("2.5E9", 25 * 10**8)])
def test_a_budget_is_a_whole_number_of_bytes_in_either_form(monkeypatch, given, value):
    from correctness.memory import available_bytes

    monkeypatch.setenv(MEMORY_ENV, given)
    assert available_bytes() == value


@pytest.mark.parametrize("given", ["0.5", "1e-3", "inf", "nan", "-5e8", "5e8 bytes", "0"])
def test_a_budget_that_is_no_whole_number_of_bytes_is_refused(monkeypatch, given):
    from correctness.errors import RecipeError
    from correctness.memory import available_bytes

    monkeypatch.setenv(MEMORY_ENV, given)
    with pytest.raises(RecipeError, match=f"{MEMORY_ENV} must be a positive number of bytes, got '{given}'"):
        available_bytes()


@pytest.mark.parametrize("recipe", [GEMMA, NEMOTRON])
@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_at_the_recipe_scale_a_case_over_the_memory_is_refused_when_built(monkeypatch, name, recipe):
    monkeypatch.setenv(MEMORY_ENV, SMALL)
    started = time.monotonic()
    with pytest.raises(OverMemory) as refused:
        FACTORIES[name](recipe, LeverOptions(scale="recipe"))
    message = str(refused.value)
    assert message.startswith(f"lever {name}: case ") and "\n" not in message
    assert "units of up to 2,097,152 elements" in message
    assert "more than the 500.0 MB of memory available here (CORRECTNESS_MEMORY_BYTES)" in message
    assert time.monotonic() - started < 30, "refused before anything is drawn"


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_the_smoke_scale_fits_the_same_budget(monkeypatch, name):
    monkeypatch.setenv(MEMORY_ENV, SMALL)
    for recipe in (GEMMA, NEMOTRON):
        (built,) = FACTORIES[name](recipe, LeverOptions())
        assert all(0 < case.memory_bytes < 5 * 10**8 for case in built.cases)


def test_every_streamed_and_kept_case_says_its_memory():
    for lever in (*offload.cpu_tier(GEMMA, LeverOptions(scale="recipe")),
                  *precision.cpu_tier(GEMMA, LeverOptions(scale="recipe")),
                  *precision.cpu_tier(GEMMA, LeverOptions())):
        assert all(case.memory_bytes and case.memory_driver for case in lever.cases), lever.name
    (kept,) = precision.cpu_tier(GEMMA, LeverOptions())
    assert "kept for every case" in kept.cases[0].memory_driver
    (streamed,) = precision.cpu_tier(GEMMA, LeverOptions(scale="recipe"))
    assert "units of up to" in streamed.cases[0].memory_driver, "the recipe scale streams each case's own units"


def test_pytest_at_the_recipe_scale_skips_both_levers_naming_the_memory():
    tests = [str(COMPONENT_TESTS_DIR / "test_optimizer_offload.py") + "::test_offload_fraction_cpu",
             str(COMPONENT_TESTS_DIR / "test_precision_aware_adam.py") + "::test_precision_aware_adam_cpu"]
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", *tests,
                           "--scale", "recipe"], capture_output=True, text=True, timeout=300,
                          cwd=COMPONENT_TESTS_DIR.parent, env={**os.environ, MEMORY_ENV: SMALL})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "passed" not in done.stdout and "skipped" in done.stdout
    for name in FACTORIES:
        assert f"lever {name}: case " in done.stdout
    assert "of memory available here (CORRECTNESS_MEMORY_BYTES)" in done.stdout
    assert time.monotonic() - started < 240


ARENA_VARIATION = 150_000_000  # bytes
MEASURE = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from correctness.harness import run_case
    from correctness.lever import LeverOptions
    from correctness.adam_precision import lever as precision
    from correctness.optimizer import lever as offload

    def status(key):
        line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(key + ":"))
        return int(line.split()[1]) * 1024

    factory = {"optimizer-offload": offload.cpu_tier, "precision-aware-adam": precision.cpu_tier}[sys.argv[1]]
    (lever,) = factory(sys.argv[2], LeverOptions())
    cases = [case for case in lever.cases if case.skip_reason is None]
    run_case(lever, cases[0])  # imports, thread pools and allocator arenas: the process's, not a case's
    base = status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here
    results = [run_case(lever, case).status for case in cases]
    print(json.dumps({"peak": status("VmHWM") - base, "estimate": max(c.memory_bytes for c in cases),
                      "results": results}))
""")


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="measures Linux's VmHWM")
@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_the_estimate_holds_the_measured_peak_at_the_smoke_scale(name):
    """Peak resident memory above the process's own, measured: the estimate is above it, and within
    a small factor of it (an estimate far above would refuse cases that fit)."""
    done = subprocess.run([sys.executable, "-c", MEASURE, name, GEMMA], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(done.stdout.splitlines()[-1])
    assert set(measured["results"]) <= {"pass", "format-limited"}, "the cases ran"
    # The bound on the estimate allows for the part of the peak no estimate can follow: the arenas the
    # first case leaves, which vary by more than 100 MB between runs of the same case (Gemma's smoke
    # precision-aware-adam case: 59 MB to 180 MB measured above them, with one estimate of 237 MB).
    assert measured["peak"] <= measured["estimate"] <= 4 * measured["peak"] + ARENA_VARIATION, measured
