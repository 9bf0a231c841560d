"""--scale recipe (pytest and `correctness run`): every CPU tier builds its cases at the recipe's
rank-local shapes in place of its smoke shapes, and a lever whose case would need more memory than
the machine has skips naming it (the lever is then incomplete), where at the smoke scale the run
stops. benchmarks/recipe_scale.py runs them and gives their time and memory."""

import json
import os
import subprocess
import sys

import pytest

from correctness.errors import OverMemory
from correctness.fixtures import COMPONENT_TESTS_DIR, RECIPES_DIR
from correctness.lever import LeverOptions, NotApplicable
from correctness.memory import MEMORY_ENV
from correctness.recipe_sets import GEMMA
from correctness.registry import LEVER_SPECS

CPU_TIERS = ("cpu", "megatron-cpu", "te-cpu")
CPU_TESTS = [(spec.name, test) for spec in LEVER_SPECS for test in spec.tests if test.tier in CPU_TIERS]
GEMMA_FILE = RECIPES_DIR / f"{GEMMA}.yaml"
NO_MEMORY = str(10**6)  # bytes: every estimated case is over it


def shapes(levers) -> list:
    return [case.shape for lever in levers for case in lever.cases]


@pytest.mark.parametrize("lever_name, test", CPU_TESTS, ids=[f"{name}-{test.test}" for name, test in CPU_TESTS])
def test_every_cpu_tier_builds_the_recipes_shapes_at_the_recipe_scale(lever_name, test, monkeypatch):
    monkeypatch.setenv(MEMORY_ENV, str(10**15))  # about shapes here: nothing is refused for memory
    recipe = test.recipes[0]
    try:
        smoke = test.factory(recipe, LeverOptions())
    except NotApplicable:
        with pytest.raises(NotApplicable):
            test.factory(recipe, LeverOptions(scale="recipe"))
        return
    at_recipe = test.factory(recipe, LeverOptions(scale="recipe"))
    assert [lever.record_id for lever in at_recipe] == [lever.record_id for lever in smoke]
    assert shapes(at_recipe) != shapes(smoke), f"{lever_name} ({test.tier}): the same shapes at both scales"


def test_an_unknown_scale_is_refused():
    with pytest.raises(ValueError, match="scale must be one of smoke, recipe, not 'huge'"):
        LeverOptions(scale="huge")


def test_the_attention_lever_at_the_recipe_scale_runs_its_chunked_default_within_the_machines_memory(monkeypatch):
    """Gemma 4's 16 heads of 8,192 x 8,192 scores take 26 GB at once: the eager default runs one
    head at a time, so its cases are estimated at 8.5 GB; TE's unfused path (te-cpu) holds them all."""
    from correctness.attention import backend_lever as attention

    monkeypatch.setenv(MEMORY_ENV, str(12 * 10**9))
    (lever,) = attention.cpu_tier(GEMMA, LeverOptions(scale="recipe"))
    assert {case.shape.seq_len for case in lever.cases} == {8192}
    assert max(case.memory_bytes for case in lever.cases) < 12 * 10**9
    with pytest.raises(OverMemory, match=r"needs about 32\.\d GB \(seq_len 8192: 16 heads' 8192 x 8192 scores\)"):
        attention.te_cpu_tier(GEMMA, LeverOptions(scale="recipe"))


def pytest_run(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", *arguments],
                          capture_output=True, text=True, timeout=300, cwd=COMPONENT_TESTS_DIR.parent,
                          env={**os.environ, MEMORY_ENV: NO_MEMORY})


def test_pytest_at_the_recipe_scale_skips_a_lever_over_memory_naming_what_it_needs():
    test = str(COMPONENT_TESTS_DIR / "test_attention_backend.py") + "::test_sdpa_flash_cpu_against_eager_unfused"
    done = pytest_run(test, "--scale", "recipe")
    assert done.returncode == 0, done.stdout[-2000:]
    assert "1 skipped" in done.stdout
    assert "test_sdpa_flash_cpu_against_eager_unfused[over-memory]" in pytest_run(test, "--scale", "recipe", "--co").stdout
    assert "at the recipe scale: lever attention-backend: case gemma4-31b-" in done.stdout
    assert "seq_len 8192" in done.stdout and "1.0 MB of memory available here" in done.stdout
    at_smoke = pytest_run(test)
    assert at_smoke.returncode != 0 and "needs about" in at_smoke.stdout, "the smoke scale stops the run instead"


def test_correctness_run_at_the_recipe_scale_is_incomplete_where_a_needed_lever_is_over_memory(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "correctness.cli", "run", str(GEMMA_FILE), "--tier", "cpu", "--scale", "recipe",
         "--results-dir", str(tmp_path / "r"), "--json", "--", "-k", "test_sdpa_flash_cpu_against_eager_unfused"],
        capture_output=True, text=True, timeout=300, env={**os.environ, MEMORY_ENV: NO_MEMORY},
    )
    assert done.returncode == 1, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert "--scale" in report["pytest"]["arguments"] and "recipe" in report["pytest"]["arguments"]
    assert report["verdict"]["verdict"] == "incomplete"
    assert report["records"] == []


def test_a_record_says_the_scale_its_cases_were_built_at():
    from correctness.attention import backend_lever as attention
    from correctness.harness import lever_summary

    options = LeverOptions(scale="recipe")
    (cpu,) = options.recorded(attention.cpu_tier(GEMMA, options))
    (smoke,) = LeverOptions().recorded(attention.cpu_tier(GEMMA, LeverOptions()))
    assert (lever_summary(cpu)["scale"], lever_summary(smoke)["scale"]) == ("recipe", "smoke")
    gpu = LeverOptions(scale="recipe").recorded(attention.gpu_sdpa_tier(GEMMA, LeverOptions(scale="recipe")))
    assert {lever_summary(lever)["scale"] for lever in gpu} == {None}, "a GPU tier's shapes are not --scale's"


@pytest.mark.parametrize("scales, said", [
    ((("smoke",), ("smoke",)), "at the smoke scale"),
    ((("recipe",), ("recipe",)), "at the recipe's scale"),
    ((("recipe",), ("smoke",)), "partly at the smoke scale, partly at the recipe's"),
])
def test_the_recipes_verdict_says_the_scale_of_its_cpu_evidence(scales, said):
    from correctness.recipe_verdict import LeverEvidence, RecipeVerdict

    levers = tuple(LeverEvidence(lever=f"lever-{n}", flags=("--flag a -> b",), tiers=(("cpu", "pass"),), device=("cpu",),
                                 format=None, reasons=(), scales=scale) for n, scale in enumerate(scales))
    verdict = RecipeVerdict(recipe="r", basis="b", changes=(), levers=levers, catalogue=(), other_changes={},
                            convergence_passes=False)
    assert verdict.on_cpu_only and verdict.cpu_scale == said


def test_megatrons_offload_at_the_recipe_scale_is_refused_naming_the_parameters_it_holds_at_once(monkeypatch):
    from correctness.optimizer import lever as offload

    monkeypatch.setenv(MEMORY_ENV, str(24 * 10**9))
    with pytest.raises(OverMemory, match=r"needs about 111\.2 GB \(556,051,968 parameters held at once by Megatron's"):
        offload.megatron_cpu_tier(GEMMA, LeverOptions(scale="recipe"))
    (streamed,) = offload.cpu_tier(GEMMA, LeverOptions(scale="recipe"))
    assert all(case.memory_bytes < 3 * 10**9 and "units of up to 2,097,152 elements" in case.memory_driver
               for case in streamed.cases), "a streamed case holds one unit at a time"


def test_a_streamed_case_hands_the_heaps_freed_memory_back_after_every_unit(monkeypatch):
    from correctness import harness
    from correctness.optimizer import lever as offload

    (lever,) = offload.cpu_tier(GEMMA, LeverOptions())
    case = next(case for case in lever.cases if case.skip_reason is None)
    units = sum(1 for _ in case.make_inputs("cpu").units)
    trims = []
    monkeypatch.setattr(harness, "release_freed_memory", lambda: trims.append(1))
    (result,) = harness.run_candidates(lever, case, [lever.candidate])
    assert result.status == "pass" and len(trims) == units > 1


def test_the_benchmark_plans_each_lever_at_the_recipe_scale_and_names_a_refusals_memory():
    script = COMPONENT_TESTS_DIR.parent / "benchmarks" / "recipe_scale.py"
    done = subprocess.run([sys.executable, str(script), "--plan", "--levers", "rope-fusion,optimizer-offload",
                           "--recipes", "gemma"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, MEMORY_ENV: str(24 * 10**9)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert max(len(line) for line in done.stdout.splitlines()) <= 160
    lines = done.stdout.replace("\n    ", " ").splitlines()  # each figure's line, unwrapped
    assert any(line.startswith("rope-fusion (megatron-cpu) at gemma-4-31b: megatron-rope-unfused: 2 cases") for line in lines)
    assert any(line.startswith("optimizer-offload (megatron-cpu) at gemma-4-31b: refused: lever optimizer-offload")
               and "111.2 GB" in line for line in lines)
    assert any(line.startswith("optimizer-offload (cpu) at gemma-4-31b: offload-0.8: 2 cases") for line in lines)


def test_the_gradient_reductions_ranks_at_gemmas_recipe_scale_are_refused_naming_their_parameters(monkeypatch):
    from correctness.grad_reduction import lever as reduction

    monkeypatch.setenv(MEMORY_ENV, str(24 * 10**9))
    with pytest.raises(OverMemory, match=r"needs about 74\.2 GB \(239,490,560 parameters on each of 8 ranks"):
        reduction.cpu_tier(GEMMA, LeverOptions(scale="recipe"))
