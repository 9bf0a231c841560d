"""CUDA faults and cuDNN refusals, on the CPU by injection: a case whose path leaves the CUDA device
in an error state (a sticky error) fails, and the rest of its test module is reported as not run;
cuDNN's refusal of a graph skips the case; every other error still fails it.

The toy lever's tier says "cuda" while its paths compute on the CPU: the injected exceptions and a
monkeypatched torch.cuda are scaffolding for the classing logic, never judged numerics."""

from dataclasses import replace

import pytest
import torch

from correctness.harness import cudnn_refusal, device_fault, run_candidates, run_case, sticky_cuda_error
from correctness.lever import Control, Tier
from correctness.results import read_record
from tests.test_harness import CANDIDATE, Raises, toy_case, toy_lever

pytest_plugins = ("pytester",)

ON_CUDA = Tier(name="gpu", device="cuda")  # no markers: the plugin does not skip it for want of a GPU
ILLEGAL_ACCESS = "CUDA error: an illegal memory access was encountered\nCompile with `TORCH_USE_CUDA_DSA`."
NO_PLAN = "cuDNN Frontend error: [cudnn_frontend] Error: No execution plans support the graph."
NOT_SUPPORTED = ("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous"
                 " input.")


def host_case(seed):
    """The toy case, its inputs on the CPU whatever device the tier names."""
    case = toy_case(seed)
    return replace(case, make_inputs=lambda device: case.make_inputs(torch.device("cpu")))


def cuda_lever(candidate=CANDIDATE, **changes):
    return toy_lever(tier=ON_CUDA, candidate=candidate, cases=(host_case(0), host_case(1)), **changes)


def cpu_device_calls(monkeypatch, synchronize=lambda *args: None):
    """torch.cuda as a GPU machine's would answer, its synchronisation `synchronize`."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)


@pytest.mark.parametrize("text", [ILLEGAL_ACCESS, "CUDA error: device-side assert triggered",
                                  "CUDA error: unspecified launch failure", "CUDA error: misaligned address"])
def test_a_sticky_cuda_error_fails_the_case_and_says_the_device_is_unusable(text):
    lever = cuda_lever(Raises("fused sum", RuntimeError(text)))
    result = run_case(lever, host_case(0))
    assert result.status == "fail" and result.failures[0].startswith("candidate (fused sum) raised RuntimeError: CUDA error")
    assert device_fault(lever, result) == f"candidate (fused sum) raised RuntimeError: {text.splitlines()[0]}"


def test_an_error_after_which_the_device_cannot_synchronise_is_a_fault(monkeypatch):
    broken = []

    def synchronize(*args):
        if broken:
            raise torch.AcceleratorError("CUDA error: an unknown error has occurred")

    class Breaks:
        name = "fused sum"

        def run(self, inputs):
            broken.append(True)
            raise torch.AcceleratorError("CUDA error: an unknown error has occurred")

    cpu_device_calls(monkeypatch, synchronize)
    lever = cuda_lever(Breaks())
    result = run_case(lever, host_case(0))
    assert result.status == "fail"
    assert device_fault(lever, result) == "AcceleratorError: CUDA error: an unknown error has occurred"


def test_an_ordinary_error_on_a_device_that_still_works_is_a_failure_and_no_fault(monkeypatch):
    cpu_device_calls(monkeypatch)
    lever = cuda_lever(Raises("fused sum", ValueError("bad shape")))
    result = run_case(lever, host_case(0))
    assert result.status == "fail" and device_fault(lever, result) is None
    on_cpu = toy_lever(candidate=Raises("fused sum", RuntimeError(ILLEGAL_ACCESS)))
    assert device_fault(on_cpu, run_case(on_cpu, toy_case(0))) is None  # a CPU tier has no CUDA device to lose


def test_a_sticky_error_stops_every_other_candidate_of_the_case():
    lever = cuda_lever()
    results = run_candidates(lever, host_case(0), (Raises("faulting sum", RuntimeError(ILLEGAL_ACCESS)), CANDIDATE))
    assert [result.status for result in results] == ["fail", "fail"]
    assert all("an illegal memory access" in result.failures[0] for result in results)


def test_an_ordinary_candidate_error_leaves_the_other_candidates_judged():
    lever = cuda_lever()
    results = run_candidates(lever, host_case(0), (Raises("broken sum", ValueError("bad shape")), CANDIDATE))
    assert [result.status for result in results] == ["fail", "pass"]


@pytest.mark.parametrize("text", [NO_PLAN, NOT_SUPPORTED,
                                  "cuDNN Frontend error: No valid execution plans built."])
def test_cudnn_refusing_the_graph_skips_the_case_with_its_message(text):
    result = run_case(cuda_lever(Raises("cudnn sum", RuntimeError(text))), host_case(0))
    assert result.status == "skip", result.failures
    assert result.skip_reason == f"candidate (cudnn sum): cuDNN refuses the case: {text}"


def test_cudnn_refusing_a_control_skips_the_case():
    refused = Control(name="refused", implementation=Raises("cudnn sum", RuntimeError(NO_PLAN)))
    result = run_case(cuda_lever(controls=(refused,)), host_case(0))
    assert result.status == "skip" and "cuDNN refuses the case" in result.skip_reason


@pytest.mark.parametrize("error", [RuntimeError("cuDNN Frontend error: CUDNN_STATUS_EXECUTION_FAILED"),
                                   RuntimeError("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR"),
                                   torch.OutOfMemoryError("cuDNN error: not supported, out of memory"),
                                   RuntimeError("flash attention: head dim not supported"),
                                   RuntimeError(f"cuDNN Frontend error: not supported; {ILLEGAL_ACCESS}")])
def test_other_cudnn_errors_are_no_refusals(error):
    assert not cudnn_refusal(error)
    assert run_case(cuda_lever(Raises("cudnn sum", error)), host_case(0)).status == "fail"


def test_sticky_errors_are_told_by_cudas_words():
    assert sticky_cuda_error(ILLEGAL_ACCESS)
    assert not sticky_cuda_error("CUDA error: invalid argument")
    assert not sticky_cuda_error("CUDA out of memory. Tried to allocate 2.00 GiB")


# The pytest plugin: the rest of the module is not run

FAULTING_MODULE = '''
import pytest
import torch

from correctness import Case, Control, Lever, Mutated, ImplementationOutput, RecipeRef
from correctness.lever import Tier

RECIPE = RecipeRef(id="toy/gpu/sum", model="Toy", gpu="none", sha256="0" * 64)
ON_CUDA = Tier(name="gpu", device="cuda")


class Sum:
    def __init__(self, name, dtype, output=torch.float32, fault=None):
        self.name, self.dtype, self.output, self.fault = name, dtype, output, fault

    def run(self, inputs):
        if self.fault:
            raise RuntimeError(self.fault)
        return ImplementationOutput(
            tensors={"total": inputs.to(self.dtype).sum(-1).to(self.output)}, backend=f"sum-{self.name}")


def case(seed):
    return Case(id=f"sum-seed{seed}", shape="4 x 64", seed=seed, source="synthetic", variant="uniform",
                make_inputs=lambda device: torch.rand(4, 64, generator=torch.Generator().manual_seed(seed)).bfloat16())


def lever(candidate):
    return Lever(name="toy-sum", version=1, tier=ON_CUDA, description="toy sums", recipe=RECIPE,
                 cases=(case(0), case(1), case(2)), candidate=candidate, default=Sum("fp32", torch.float32),
                 reference=Sum("fp64", torch.float64, output=torch.float64),
                 controls=(Control(name="doubled", implementation=Mutated(base=candidate, mutation="doubled",
                                                                          mutate=lambda x: x * 2)),))


def faulting(options):
    return [lever(Sum("fused", torch.float32, fault="CUDA error: an illegal memory access was encountered"))]


def healthy(options):
    return [lever(Sum("fp64 sum", torch.float64))]
'''


def test_after_a_fault_the_rest_of_the_module_is_not_run_and_another_module_runs(pytester, tmp_path):
    pytester.makeconftest('pytest_plugins = ("correctness.pytest_plugin",)\n')
    body = ("import pytest\nfrom faulting_levers import *\n\n@pytest.mark.levers(factory={factory})\n"
            "def test_sum(lever, case, lever_check):\n    lever_check(lever, case)\n")
    pytester.makepyfile(faulting_levers=FAULTING_MODULE, test_a_faulting=body.format(factory="faulting"),
                        test_b_healthy=body.format(factory="healthy"))
    pytester.syspathinsert()
    results = tmp_path / "records"
    outcome = pytester.runpytest("-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-rs",
                                 "--results-dir", str(results))
    outcome.assert_outcomes(failed=1, skipped=2, passed=3)
    outcome.stdout.fnmatch_lines([
        "*the CUDA device is now in an error state (candidate (fused) raised RuntimeError: CUDA error: an illegal"
        " memory access was encountered): the rest of this module is not run*",
        "SKIPPED [[]2[]]*not run: an earlier case left the CUDA device in an error state: case sum-seed0:"
        " candidate (fused) raised RuntimeError: CUDA error: an illegal memory access was encountered",
    ])
    (record,) = [read_record(path) for path in results.rglob("*.json") if "fused" in path.name]
    statuses = {case["case_id"]: case["status"] for case in record["cases"]}
    assert statuses == {"sum-seed0": "fail", "sum-seed1": "skip", "sum-seed2": "skip"}
    assert record["verdict"] == "fail"
