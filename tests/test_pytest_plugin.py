"""The pytest plugin (correctness.pytest_plugin), run in throwaway projects with pytester."""

import pytest
import torch

from correctness.results import file_name, read_record

pytest_plugins = ("pytester",)

CONFTEST = 'pytest_plugins = ("correctness.pytest_plugin",)\n'

# A toy lever module for the throwaway project: sums of 64 BF16 values, the default accumulating in
# FP32, the candidates in FP64 (good) or dropping the last value (bad), against an FP64 reference.
TOY_LEVERS = '''
from dataclasses import dataclass

import pytest
import torch

from correctness import Case, Control, Lever, Mutated, ImplementationOutput, RecipeRef
from correctness.tiers import CPU, GPU, recipe_gpu_tier

RECIPE = RecipeRef(id="toy/cpu/sum", model="Toy", gpu="none", sha256="0" * 64)


@dataclass(frozen=True)
class Sum:
    name: str
    accumulate: torch.dtype
    output: torch.dtype = torch.float32
    drop_last: bool = False
    scale: float = 1.0

    def run(self, inputs):
        values = inputs[..., :-1] if self.drop_last else inputs
        total = (values.to(self.accumulate).sum(-1) * self.scale).to(self.output)
        return ImplementationOutput(tensors={"total": total}, backend=f"torch-sum-{self.name}")


def toy_case(seed, skip_reason=None):
    def make_inputs(device):
        generator = torch.Generator().manual_seed(seed)
        return torch.rand(4, 64, generator=generator).to(torch.bfloat16).to(device)

    return Case(id=f"sum-n64-seed{seed}", shape="4 rows of 64", seed=seed, source="synthetic",
                variant="uniform", make_inputs=make_inputs, skip_reason=skip_reason)


def toy_lever(candidate, cases=(toy_case(0), toy_case(1)), tier=CPU):
    return Lever(
        name="toy-sum", version=1, tier=tier, description="toy sums", recipe=RECIPE,
        cases=tuple(cases), candidate=candidate, default=Sum("fp32", torch.float32),
        reference=Sum("fp64 reference", torch.float64, output=torch.float64),
        controls=(Control(name="inputs doubled",
                          implementation=Mutated(base=candidate, mutation="doubled", mutate=lambda x: x * 2)),),
    )


GOOD = Sum("fp64", torch.float64)
BAD = Sum("drops last", torch.float32, drop_last=True)
SCALED = Sum("fp64 x (1 + 1e-4)", torch.float64, scale=1 + 1e-4)


def one_scaled_lever(options):
    return [toy_lever(SCALED)]


def one_good_lever(options):
    return [toy_lever(GOOD)]


def good_and_bad_levers(options):
    return [toy_lever(GOOD), toy_lever(BAD)]


def one_bad_lever(options):
    return [toy_lever(BAD)]


def levers_of_three_tiers(options):
    return [toy_lever(GOOD), toy_lever(BAD, tier=GPU), toy_lever(SCALED, tier=recipe_gpu_tier("H100"))]


def lever_with_a_skipped_case(options):
    return [toy_lever(GOOD, cases=(toy_case(0), toy_case(1, skip_reason="no captured inputs here")))]


def corrupt_inputs(device):
    raise ValueError("layer-00.safetensors: header too large")


def lever_with_a_corrupt_case(options):
    broken = Case(id="sum-corrupt", shape="4 rows of 64", seed=0, source="checkpoint", variant="captured",
                  make_inputs=corrupt_inputs, required=False)
    return [toy_lever(GOOD, cases=(toy_case(0), broken))]
'''


def toy_project(pytester, test_body: str) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(toy_levers=TOY_LEVERS, test_toy="import pytest\nfrom toy_levers import *\n\n" + test_body)
    pytester.syspathinsert()


def run(pytester, *args: str) -> pytest.RunResult:
    """Run pytest in the throwaway project, in process, without plugins it does not need."""
    return pytester.runpytest("-p", "no:cacheprovider", "-p", "no:hypothesispytest", *args)


def lever_test(factory: str, markers: str = "") -> str:
    return (
        f"{markers}@pytest.mark.levers(factory={factory})\n"
        "def test_sum(lever, case, lever_check):\n"
        "    lever_check(lever, case)\n"
    )


def test_levers_parametrise_a_test_per_case_with_the_case_ids(pytester):
    toy_project(pytester, lever_test("one_good_lever"))
    result = run(pytester, "--collect-only", "-q")
    result.stdout.fnmatch_lines(
        ["test_toy.py::test_sum[[]sum-n64-seed0[]]", "test_toy.py::test_sum[[]sum-n64-seed1[]]"]
    )
    assert result.ret == pytest.ExitCode.OK


def test_several_levers_prefix_case_ids_with_the_candidate(pytester):
    toy_project(pytester, lever_test("good_and_bad_levers"))
    result = run(pytester, "--collect-only", "-q")
    result.stdout.fnmatch_lines(
        [
            "test_toy.py::test_sum[[]fp64-sum-n64-seed0[]]",
            "test_toy.py::test_sum[[]fp64-sum-n64-seed1[]]",
            "test_toy.py::test_sum[[]drops last-sum-n64-seed0[]]",
            "test_toy.py::test_sum[[]drops last-sum-n64-seed1[]]",
        ]
    )


def test_a_levers_marker_without_factory_is_a_usage_error(pytester):
    toy_project(pytester, lever_test("one_good_lever").replace("factory=", "fatcory="))
    result = run(pytester, "--collect-only", "-q")
    assert result.ret == pytest.ExitCode.INTERRUPTED  # a collection error
    result.stdout.fnmatch_lines(["E   *UsageError: test_toy.py::test_sum: write the marker as levers(factory=...)*"])


def test_a_passing_run_writes_one_record_per_lever(pytester):
    toy_project(pytester, lever_test("one_good_lever"))
    records = pytester.path / "records"
    result = run(pytester, "--results-dir", str(records))
    result.assert_outcomes(passed=2)
    (path,) = records.rglob("*.json")
    assert path == records / "toy/cpu/sum" / "toy-sum--cpu--fp64.json"
    record = read_record(path)
    assert record["verdict"] == "pass"
    assert [case["case_id"] for case in record["cases"]] == ["sum-n64-seed0", "sum-n64-seed1"]


def test_records_go_under_the_rootdir_by_default(pytester):
    toy_project(pytester, lever_test("one_good_lever"))
    run(pytester).assert_outcomes(passed=2)
    assert read_record(pytester.path / "results/toy/cpu/sum/toy-sum--cpu--fp64.json")["verdict"] == "pass"


def test_the_terminal_summary_has_a_verdict_table_per_lever(pytester):
    toy_project(pytester, lever_test("one_good_lever"))
    result = run(pytester, "--results-dir", str(pytester.path / "records"))
    result.stdout.fnmatch_lines(
        [
            "*= lever verdicts =*",
            "toy-sum [[]cpu[]] · recipe toy/cpu/sum · PASS",
            "  fp64 vs fp32",
            "  candidate ran: torch-sum-fp64",
            "  case / result * err/bound * err/default * systematic * repeat * default * controls",
            "  sum-n64-seed0",
            "    pass *(total)*same*pass*1 fail, least *",
            "  sum-n64-seed1",
            "    pass *(total)*same*pass*1 fail, least *",
            "  record: toy-sum--cpu--fp64.json",
            "    in records/toy/cpu/sum",  # relative to where pytest ran
        ]
    )
    assert "recipe verdicts" not in result.stdout.str()  # a recipe of another project: no verdict here
    wide = run(pytester, "--results-dir", str(pytester.path / "records"), "--wide")
    wide.stdout.fnmatch_lines(["  case * result * candidate ran * err/bound *inputs doubled err/bound",
                               "  sum-n64-seed0 * pass * torch-sum-fp64 *"])


def test_a_failing_case_reports_the_full_case_report(pytester):
    toy_project(pytester, lever_test("one_bad_lever"))
    records = pytester.path / "records"
    result = run(pytester, "--results-dir", str(records))
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(
        [
            "toy-sum · case sum-n64-seed0 (seed 0, synthetic): FAIL",
            "  - candidate total: error * > bound * (default error *); worst element at [[]*",
            "  path * backend * tensor * error * default err * bound * err/bound*",
            "  candidate * torch-sum-drops last * total *",
        ]
    )
    result.stdout.fnmatch_lines(["*toy-sum [[]cpu[]] · recipe toy/cpu/sum · FAIL", "  drops last vs fp32"])
    assert read_record(records / "toy/cpu/sum" / f"{file_name('toy-sum--cpu--drops last')}.json")["verdict"] == "fail"


def test_a_skipped_case_skips_with_its_reason_and_is_recorded(pytester):
    toy_project(pytester, lever_test("lever_with_a_skipped_case"))
    records = pytester.path / "records"
    result = run(pytester, "--results-dir", str(records), "-rs")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["SKIPPED [[]1[]] *: no captured inputs here"])
    record = read_record(records / "toy/cpu/sum/toy-sum--cpu--fp64.json")
    assert [case["status"] for case in record["cases"]] == ["pass", "skip"]


def test_a_case_that_raises_is_a_failed_case_in_the_record_and_the_lever_fails(pytester):
    toy_project(pytester, lever_test("lever_with_a_corrupt_case"))
    records = pytester.path / "records"
    result = run(pytester, "--results-dir", str(records))
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*toy-sum [[]cpu[]] · recipe toy/cpu/sum · FAIL",
                                 "  error in sum-corrupt: ValueError: layer-00.safetensors: header too large"])
    record = read_record(records / "toy/cpu/sum/toy-sum--cpu--fp64.json")
    assert record["verdict"] == "fail"
    assert [(case["case_id"], case["status"]) for case in record["cases"]] == [("sum-n64-seed0", "pass"),
                                                                             ("sum-corrupt", "fail")]
    assert record["cases"][1]["failures"] == [{"kind": "error", "role": None, "tensor": None,
                                               "text": "ValueError: layer-00.safetensors: header too large"}]


def test_a_run_of_some_cases_only_is_incomplete(pytester):
    toy_project(pytester, lever_test("one_good_lever"))
    records = pytester.path / "records"
    result = run(pytester, "--results-dir", str(records), "-k", "seed0")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([
        "*toy-sum [[]cpu[]] · recipe toy/cpu/sum · INCOMPLETE",
        "  INCOMPLETE: 1 declared case(s) not in this run (deselected or interrupted): sum-n64-seed1",
    ])
    record = read_record(records / "toy/cpu/sum/toy-sum--cpu--fp64.json")
    assert record["verdict"] == "incomplete" and record["completeness"]["missing"] == ["sum-n64-seed1"]


def test_each_case_carries_its_levers_tier_markers(pytester, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    toy_project(pytester, lever_test("levers_of_three_tiers"))
    selected = {
        "h100": ["fp64 x (1 + 1e-4)"],
        "te": ["fp64 x (1 + 1e-4)"],
        "gpu": ["drops last"],
        "not gpu and not te and not h100 and not h200": ["fp64"],
    }
    for expression, candidates in selected.items():
        result = run(pytester, "--collect-only", "-q", "-m", expression)
        result.stdout.fnmatch_lines([f"test_toy.py::test_sum[[]{candidate}-sum-n64-seed{seed}[]]"
                                     for candidate in candidates for seed in (0, 1)])
        assert f"{2 * len(candidates)}/6 tests collected" in result.stdout.str(), expression
    result = run(pytester, "-rs", "--results-dir", str(pytester.path / "records"))
    result.assert_outcomes(passed=2, skipped=4)
    result.stdout.fnmatch_lines_random([
        "SKIPPED [[]2[]] *: needs a CUDA GPU (gpu); this machine has none",
        "SKIPPED [[]2[]] *: needs a CUDA GPU (h100, te) for Transformer Engine; this machine has none",
    ])


HARDWARE_TESTS = """
@pytest.mark.gpu
def test_gpu():
    pass

@pytest.mark.h100
def test_h100():
    pass

@pytest.mark.h200
def test_h200():
    pass

@pytest.mark.te
def test_te():
    pass
"""


def test_hardware_markers_skip_without_a_gpu_naming_what_is_missing(pytester, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    toy_project(pytester, HARDWARE_TESTS + "\n" + lever_test("one_good_lever", markers="@pytest.mark.h100\n"))
    result = run(pytester, "-rs")
    result.assert_outcomes(skipped=6)
    result.stdout.fnmatch_lines_random(
        [
            "SKIPPED [[]1[]] *: needs a CUDA GPU (gpu); this machine has none",
            "SKIPPED [[]3[]] *: needs a CUDA GPU (h100); this machine has none",
            "SKIPPED [[]1[]] *: needs a CUDA GPU (h200); this machine has none",
            "SKIPPED [[]1[]] *: needs a CUDA GPU (te)*Transformer Engine*",
        ]
    )
    assert not (pytester.path / "results").exists()  # no lever case ran, so no record


def test_strict_markers_accepts_the_plugin_markers(pytester, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    toy_project(pytester, HARDWARE_TESTS + "\n" + lever_test("one_good_lever"))
    result = run(pytester, "--strict-markers", "-W", "error::pytest.PytestUnknownMarkWarning")
    assert result.ret == pytest.ExitCode.OK
    result.assert_outcomes(passed=2, skipped=4)


def test_strict_markers_still_refuses_an_unknown_marker(pytester):
    toy_project(pytester, "@pytest.mark.h300\ndef test_h300():\n    pass\n")
    result = run(pytester, "--strict-markers")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(["*'h300' not found in `markers` configuration option*"])


@pytest.mark.parametrize(("cores", "workers", "threads"), [(2, 2, 1), (16, 2, 8), (2, 4, 1), (8, 1, 8)])
def test_xdist_workers_share_the_cores(monkeypatch, cores, workers, threads):
    from correctness import pytest_plugin

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(pytest_plugin.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    chosen = []
    monkeypatch.setattr(pytest_plugin.torch, "set_num_threads", chosen.append)
    pytest_plugin.share_cpu_threads(workers)
    assert chosen == [threads]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    pytest_plugin.share_cpu_threads(workers)
    assert chosen == [threads]  # the user's setting stands


def test_a_systematic_error_is_reported_and_fails_only_with_strict_systematic(pytester):
    toy_project(pytester, lever_test("one_scaled_lever"))
    plain = run(pytester, "--results-dir", str(pytester.path / "plain"))
    plain.assert_outcomes(passed=2)
    plain.stdout.fnmatch_lines(["  sum-n64-seed0", "    pass*FLAGGED total*"])
    strict = run(pytester, "--strict-systematic", "--results-dir", str(pytester.path / "strict"))
    strict.assert_outcomes(failed=2)
    strict.stdout.fnmatch_lines(["*candidate total: systematic error (whole): slope +1.0*"])


def test_levers_selects_the_named_levers_tests_and_their_marker_names_a_lever_that_does_not_apply(pytester):
    toy_project(pytester, lever_test("one_good_lever").replace("factory=one_good_lever", "factory=one_good_lever, lever='toy-sum'")
                + "\n\ndef not_here(options):\n    raise NotApplicable('no toy here')\n\n\n"
                + lever_test("not_here").replace("factory=not_here", "factory=not_here, lever='rope-fusion'")
                .replace("def test_sum", "def test_rope"))
    (pytester.path / "test_toy.py").write_text("from correctness.lever import NotApplicable\n"
                                               + (pytester.path / "test_toy.py").read_text())
    result = run(pytester, "--collect-only", "-q", "--levers", "rope-fusion")
    result.stdout.fnmatch_lines(["test_toy.py::test_rope[[]not-applicable[]]", "*1/3 tests collected (2 deselected)*"])
    assert run(pytester, "--collect-only", "-q", "--levers", "no-such-lever").ret == pytest.ExitCode.USAGE_ERROR


def test_a_factory_that_builds_a_lever_its_marker_does_not_declare_is_a_usage_error(pytester):
    toy_project(pytester, lever_test("one_good_lever").replace("factory=one_good_lever", "factory=one_good_lever, lever='fp8'"))
    result = run(pytester, "--collect-only", "-q")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(["E   *UsageError: test_toy.py::test_sum: its factory builds toy-sum, which its marker"
                                 " does not declare (fp8)"])


def test_every_component_test_of_the_suite_declares_its_lever():
    import ast
    from correctness.fixtures import COMPONENT_TESTS_DIR

    for module in COMPONENT_TESTS_DIR.glob("test_*.py"):
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "levers":
                assert "lever" in {keyword.arg for keyword in node.keywords}, f"{module.name}:{node.lineno}"
