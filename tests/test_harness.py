"""The harness (run_case, run_lever), lever declarations, verdicts and result records, on toy
levers built from the public API: row sums accumulated in BF16 (the default) or FP32 (the
candidate) against an FP64 reference."""

import json
import re
import math
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
import torch

import correctness.results as results_module
from correctness import (
    Case,
    Control,
    CorrectnessError,
    Lever,
    Mutated,
    ImplementationOutput,
    ImplementationUnavailable,
    RecipeRef,
    Rule,
    read_record,
    run_case,
    run_lever,
    write_record,
)
from correctness.harness import build_record
from correctness.tiers import CPU
from correctness.results import FORMAT, FORMAT_VERSION, assess, file_name
from correctness.rule import DEFAULT_FACTOR

RECIPE = RecipeRef(id="toy/cpu/running-sum", model="Toy", gpu="none", sha256="0" * 64)
SEEDS = (0, 1)


# Toy paths


@dataclass(frozen=True)
class RunningSum:
    """Row sums and their total of a [rows, columns] input, accumulated left to right."""

    name: str
    accumulate: torch.dtype
    output: torch.dtype = torch.float32

    def run(self, inputs: torch.Tensor) -> ImplementationOutput:
        rows = torch.zeros(inputs.shape[0], dtype=self.accumulate)
        for column in inputs.to(self.accumulate).unbind(-1):
            rows = rows + column
        total = torch.zeros((), dtype=self.accumulate)
        for row in rows:
            total = total + row
        backend = f"running-sum-{str(self.accumulate).removeprefix('torch.')}"
        return ImplementationOutput(
            tensors={"rows": rows.to(self.output), "total": total.to(self.output)}, backend=backend)


DEFAULT = RunningSum("bf16 accumulation", torch.bfloat16)
CANDIDATE = RunningSum("fp32 accumulation", torch.float32)
REFERENCE = RunningSum("fp64 reference", torch.float64, output=torch.float64)


@dataclass(frozen=True)
class WithNan:
    """A path whose `rows` output has a NaN at `index`."""

    base: Any
    index: int
    name: str = "nan candidate"

    def run(self, inputs: torch.Tensor) -> ImplementationOutput:
        output = self.base.run(inputs)
        rows = output.tensors["rows"].clone()
        rows[self.index] = math.nan
        return ImplementationOutput(tensors={**output.tensors, "rows": rows}, backend=output.backend)


@dataclass
class ChangesAfterFirstCall:
    """A path that runs `base` on its first `unchanged_calls` calls and `then` on every later call."""

    name: str
    base: Any
    then: Any
    calls: int = field(default=0)
    unchanged_calls: int = 1

    def run(self, inputs: torch.Tensor) -> ImplementationOutput:
        self.calls += 1
        return (self.base if self.calls <= self.unchanged_calls else self.then).run(inputs)


@dataclass(frozen=True)
class TotalOneUlpUp:
    """`base`, with its FP32 total moved to the next representable value: bitwise different and
    numerically irrelevant."""

    base: Any
    name: str = "fp32 accumulation, nudged"

    def run(self, inputs: torch.Tensor) -> ImplementationOutput:
        output = self.base.run(inputs)
        total = output.tensors["total"]
        nudged = torch.nextafter(total, torch.tensor(math.inf, dtype=total.dtype))
        return ImplementationOutput(tensors={**output.tensors, "total": nudged}, backend=output.backend)


@dataclass(frozen=True)
class Unavailable:
    name: str
    reason: str

    def run(self, inputs: torch.Tensor) -> ImplementationOutput:
        raise ImplementationUnavailable(self.reason)


@dataclass(frozen=True)
class ToyShape:
    rows: int
    columns: int

    def record(self) -> dict[str, Any]:
        return {"rows": self.rows, "columns": self.columns}


SHAPE = ToyShape(rows=8, columns=64)


def toy_case(seed: int, **changes: Any) -> Case:
    def make_inputs(device: torch.device) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        return torch.rand(SHAPE.rows, SHAPE.columns, generator=generator).to(torch.bfloat16).to(device)

    case = Case(
        id=f"toy-r{SHAPE.rows}-c{SHAPE.columns}-seed{seed}",
        shape=SHAPE,
        seed=seed,
        source="synthetic",
        variant="uniform",
        make_inputs=make_inputs,
    )
    return replace(case, **changes)


def doubled_inputs_control(base: Any = CANDIDATE, **changes: Any) -> Control:
    control = Control(
        name="inputs doubled",
        implementation=Mutated(base=base, mutation="every input doubled", mutate=lambda inputs: inputs * 2),
    )
    return replace(control, **changes)


def toy_lever(**changes: Any) -> Lever:
    declaration = dict(
        name="running-sum",
        version=1,
        tier=CPU,
        description="FP32 accumulation against BF16 accumulation and an FP64 reference",
        recipe=RECIPE,
        cases=tuple(toy_case(seed) for seed in SEEDS),
        candidate=CANDIDATE,
        default=DEFAULT,
        reference=REFERENCE,
        controls=(doubled_inputs_control(),),
    )
    return Lever(**{**declaration, **changes})


# run_case


def test_a_good_candidate_passes_every_check():
    result = run_case(toy_lever(), toy_case(0))
    assert result.status == "pass" and result.failures == ()
    assert result.candidate.passes and result.candidate_repeat.passes and result.default_repeat.passes
    assert result.deterministic and result.nondeterministic_tensors == ()
    assert [t.tensor for t in result.candidate.tensors] == ["rows", "total"]
    assert result.candidate.run.backend == "running-sum-float32"
    assert result.shape == {"rows": 8, "columns": 64}


def test_the_negative_control_runs_mutated_and_fails_the_bound():
    control = run_case(toy_lever(), toy_case(0)).controls[0]
    assert control.name == "inputs doubled" and control.inapplicable_reason is None
    assert control.fails_bound and control.power > 1.0
    assert control.judgement.run.path == "fp32 accumulation (every input doubled)"
    assert control.judgement.run.details == {"mutation": "every input doubled"}


def test_a_candidate_over_the_bound_fails_naming_tensor_and_worst_element():
    # BF16 accumulation judged against FP32 accumulation as the default.
    lever = toy_lever(candidate=DEFAULT, default=CANDIDATE, controls=(doubled_inputs_control(DEFAULT),))
    result = run_case(lever, toy_case(0))
    assert result.status == "fail"
    rows_failure = next(f for f in result.failures if f.startswith("candidate rows:"))
    assert "> bound" in rows_failure and "worst element at [" in rows_failure


def test_a_negative_control_that_passes_fails_the_case_for_lack_of_power():
    powerless = Control(name="no-op", implementation=Mutated(base=CANDIDATE, mutation="nothing", mutate=lambda x: x))
    result = run_case(toy_lever(controls=(powerless,)), toy_case(0))
    assert result.status == "fail"
    assert result.candidate.passes
    assert len(result.failures) == 1
    assert result.failures[0].startswith("negative control 'no-op' passes the bound on every tensor")
    assert result.failures[0].endswith("no power on this case")


def test_a_case_where_no_control_applies_fails():
    never = doubled_inputs_control(why_inapplicable=lambda case: "toy sums have no window")
    result = run_case(toy_lever(controls=(never,)), toy_case(0))
    assert result.status == "fail"
    assert result.failures == ("no negative control applies to this case, so it could not fail",)
    assert result.controls[0].inapplicable_reason == "toy sums have no window"
    assert result.controls[0].judgement is None and result.controls[0].power is None


def test_a_candidate_producing_nan_fails_with_where():
    lever = toy_lever(candidate=WithNan(CANDIDATE, index=3))
    result = run_case(lever, toy_case(0))
    assert result.status == "fail"
    assert result.failures[0] == (
        "candidate rows: non-finite values (judged rows: 1 NaN and 0 Inf of 8 elements, first at [3])"
    )
    assert not result.candidate.passes
    assert result.deterministic  # the same NaN on both runs is not nondeterminism


def test_a_nondeterministic_candidate_is_reported_with_the_tensor_named():
    flaky = ChangesAfterFirstCall("fp32 accumulation", base=CANDIDATE, then=TotalOneUlpUp(CANDIDATE))
    result = run_case(toy_lever(candidate=flaky), toy_case(0))
    assert result.deterministic is False
    assert result.nondeterministic_tensors == ("total",)
    assert result.status == "pass"  # reported, not failed: both runs are within the bound


REPEATABLE = Rule(runs=3, bitwise_repeatable=True)


def test_under_a_repeatability_rule_a_candidate_whose_third_run_differs_fails():
    """Three runs are made: a change on the third run alone is caught (and missed by the default rule's two)."""
    def third_run_nudged():
        return ChangesAfterFirstCall("fp32 accumulation", base=CANDIDATE, then=TotalOneUlpUp(CANDIDATE), unchanged_calls=2)

    assert run_case(toy_lever(candidate=third_run_nudged()), toy_case(0)).deterministic is True
    result = run_case(toy_lever(candidate=third_run_nudged(), rule=REPEATABLE, rule_reason="toy"), toy_case(0))
    assert result.status == "fail" and result.deterministic is False and result.runs == 3
    assert result.failures == (
        f"candidate total: not bitwise repeatable over 3 runs: 1 of 1 elements differ from its first run (relative"
        f" {result.candidate_spread[0].relative:.2e}, largest {result.candidate_spread[0].max_abs:.3g})",
    )
    spread = result.candidate_spread[0]
    assert (spread.tensor, spread.runs, spread.differing_elements, spread.elements) == ("total", 3, 1, 1)
    assert 0 < spread.relative < 1e-6 and spread.max_abs > 0


def test_under_a_repeatability_rule_a_control_inside_the_bound_fails_by_its_spread():
    """A control that changes only low bits between runs has power under the repeatability rule and none under
    the default rule."""
    def flaky_control():
        return Control(name="total nudged after the first run", implementation=ChangesAfterFirstCall(
            "fp32 accumulation (nudged)", base=CANDIDATE, then=TotalOneUlpUp(CANDIDATE)))

    result = run_case(toy_lever(controls=(flaky_control(),), rule=REPEATABLE, rule_reason="toy"), toy_case(0))
    assert result.status == "pass", result.failures
    control = result.controls[0]
    assert not control.fails_bound and control.fails_repeatability and control.fails
    assert [s.tensor for s in control.spread] == ["total"]
    powerless = run_case(toy_lever(controls=(flaky_control(),)), toy_case(0))
    assert powerless.status == "fail" and powerless.controls[0].spread is None
    assert powerless.failures[0].startswith("negative control 'total nudged after the first run' passes the bound")
    repeatable = Control(name="no-op", implementation=Mutated(base=CANDIDATE, mutation="nothing", mutate=lambda x: x))
    result = run_case(toy_lever(controls=(repeatable,), rule=REPEATABLE, rule_reason="toy"), toy_case(0))
    assert result.failures[0].endswith("and is bitwise repeatable over 3 runs: no power on this case")


def test_the_default_spread_is_recorded_and_not_judged():
    flaky_default = ChangesAfterFirstCall("bf16 accumulation", base=DEFAULT, then=TotalOneUlpUp(DEFAULT), unchanged_calls=2)
    result = run_case(toy_lever(default=flaky_default, rule=REPEATABLE, rule_reason="toy"), toy_case(0))
    assert result.status == "pass", result.failures
    assert [s.tensor for s in result.default_spread] == ["total"] and result.default_spread[0].runs == 3
    assert result.candidate_spread == () and result.deterministic is True


def test_a_repeatability_record_round_trips_through_json(tmp_path):
    flaky = Control(name="total nudged after the first run", implementation=ChangesAfterFirstCall(
        "fp32 accumulation (nudged)", base=CANDIDATE, then=TotalOneUlpUp(CANDIDATE)))
    record = run_lever(toy_lever(controls=(flaky,), rule=REPEATABLE, rule_reason="toy"))
    path = results_module.write_record(record, tmp_path)
    data = results_module.read_record(path)
    assert data["lever"]["rule"]["runs"] == 3 and data["lever"]["rule"]["bitwise_repeatable"] is True
    control = data["cases"][0]["controls"][0]
    assert control["fails"] and not control["fails_bound"] and control["spread"][0]["tensor"] == "total"
    assert results_module.LeverRecord.from_json(data) == record


def test_a_rule_refuses_fewer_than_two_runs():
    with pytest.raises(ValueError, match="runs must be an integer of at least 2"):
        Rule(runs=1)


def test_a_path_raising_path_unavailable_skips_the_case_with_its_reason():
    lever = toy_lever(candidate=Unavailable("fused sum", reason="fused sum: no kernel for 64 columns"))
    result = run_case(lever, toy_case(0))
    assert result.status == "skip"
    assert result.skip_reason == "fused sum: no kernel for 64 columns"
    assert result.failures == () and result.candidate is None


def test_a_case_with_a_skip_reason_skips_without_making_inputs():
    def must_not_run(device: torch.device) -> torch.Tensor:
        raise AssertionError("make_inputs ran for a skipped case")

    case = toy_case(0, skip_reason="no captured inputs given", make_inputs=must_not_run)
    result = run_case(toy_lever(), case)
    assert result.status == "skip" and result.skip_reason == "no captured inputs given"
    assert result.case_id == case.id and result.seed == 0


def test_a_default_that_changes_between_calls_fails_the_positive_control():
    off_by_one = Mutated(base=DEFAULT, mutation="one added", mutate=lambda x: x + 1)
    drifting = ChangesAfterFirstCall("bf16 accumulation", base=DEFAULT, then=off_by_one)
    result = run_case(toy_lever(default=drifting), toy_case(0))
    assert result.status == "fail"
    assert not result.default_repeat.passes
    assert any(f.startswith("positive control (default repeated) rows: error") for f in result.failures)
    assert result.candidate.passes


@dataclass(frozen=True)
class Raises:
    """A path that raises `error` (not a refusal): a kernel error, out-of-memory, an assertion."""

    name: str
    error: Exception

    def run(self, inputs: torch.Tensor) -> ImplementationOutput:
        raise self.error


@dataclass
class Counted:
    """`base`, counting its calls."""

    base: Any
    calls: int = 0

    @property
    def name(self) -> str:
        return self.base.name

    def run(self, inputs: torch.Tensor) -> ImplementationOutput:
        self.calls += 1
        return self.base.run(inputs)


@dataclass(frozen=True)
class Renamed:
    """`base`, reporting another backend name (as a path that ran another kernel would)."""

    base: Any
    backend: str

    @property
    def name(self) -> str:
        return self.base.name

    def run(self, inputs: torch.Tensor) -> ImplementationOutput:
        output = self.base.run(inputs)
        return ImplementationOutput(tensors=output.tensors, backend=self.backend, details=output.details)


@pytest.mark.parametrize(
    "error",
    [RuntimeError("cuDNN Error: CUDNN_STATUS_EXECUTION_FAILED"), torch.OutOfMemoryError("CUDA out of memory"),
     AssertionError("qkv_format not supported")],
    ids=["kernel-error", "out-of-memory", "assertion"],
)
def test_an_error_that_is_not_a_refusal_fails_the_case_with_its_message(error):
    result = run_case(toy_lever(candidate=Raises("fused sum", error)), toy_case(0))
    assert result.status == "fail"
    assert result.failures == (f"candidate (fused sum) raised {type(error).__name__}: {error}",)
    assert result.candidate is None and result.skip_reason is None


def test_an_error_in_a_control_names_the_control():
    broken = Control(name="broken", implementation=Raises("broken sum", ValueError("bad shape")))
    result = run_case(toy_lever(controls=(doubled_inputs_control(), broken)), toy_case(0))
    assert result.status == "fail"
    assert result.failures == ("control 'broken' (broken sum) raised ValueError: bad shape",)


def test_an_error_making_the_inputs_fails_the_case_and_the_lever():
    def corrupt(device: torch.device) -> torch.Tensor:
        raise CorrectnessError("checkpoint case layer-00.safetensors: header is not JSON")

    lever = toy_lever(cases=(toy_case(0), toy_case(1, make_inputs=corrupt)))
    record = run_lever(lever)
    failed = record.cases[1]
    assert failed.status == "fail"
    assert failed.failures == ("CorrectnessError: checkpoint case layer-00.safetensors: header is not JSON",)
    assert record.verdict == "fail"


def test_a_refusing_candidate_is_found_before_the_reference_and_the_default_run():
    reference, default = Counted(REFERENCE), Counted(DEFAULT)
    lever = toy_lever(candidate=Unavailable("fused sum", "no kernel"), reference=reference, default=default)
    assert run_case(lever, toy_case(0)).status == "skip"
    assert (reference.calls, default.calls) == (0, 0)


def test_a_candidate_running_another_backend_than_the_recipe_says_fails_naming_both():
    case = toy_case(0, expected_backend="running-sum-fused")
    result = run_case(toy_lever(), case)
    assert result.status == "fail"
    assert result.failures == (
        "the recipe says running-sum-fused runs on this case; the candidate ran running-sum-float32",
    )
    assert result.expected_backend == "running-sum-fused"
    assert run_case(toy_lever(), toy_case(0, expected_backend="running-sum-float32")).status == "pass"
    detailed = toy_lever(candidate=Renamed(CANDIDATE, "running-sum-fused (sub-backend 1)"))
    assert run_case(detailed, case).status == "pass"  # the detail in parentheses is not part of the name


def test_a_kernel_lever_whose_candidate_ran_the_defaults_kernel_is_no_kernel_change():
    same = Renamed(DEFAULT, "running-sum-bfloat16")  # the default's own kernel, under the candidate's role
    lever = toy_lever(candidate=same, controls=(doubled_inputs_control(same),), compares_kernels=True)
    result = run_case(lever, toy_case(0))
    assert result.status == "no kernel change" and result.failures == ()
    assert all(t.bitwise_identical for t in result.candidate.tensors)
    assert run_lever(lever).verdict == "no kernel change"
    assert run_case(replace(lever, compares_kernels=False), toy_case(0)).status == "pass"


def test_the_same_kernel_giving_other_bits_fails():
    nudged = Renamed(TotalOneUlpUp(DEFAULT), "running-sum-bfloat16")
    lever = toy_lever(candidate=nudged, controls=(doubled_inputs_control(nudged),), compares_kernels=True)
    result = run_case(lever, toy_case(0))
    assert result.status == "fail"
    assert result.failures == (
        "candidate and default both ran running-sum-bfloat16, yet differ bitwise on total:"
        " the same kernel on the same inputs must give the same bits",
    )


def test_a_record_lacking_a_declared_case_is_incomplete_and_says_which():
    lever = toy_lever()
    record = build_record(lever, [run_case(lever, lever.cases[0])], started="2026-01-01T00:00:00+00:00", seconds=1.0)
    assert record.verdict == "incomplete"
    assert record.completeness.missing == (lever.cases[1].id,)


def test_an_optional_case_that_skips_leaves_the_verdict_alone_and_a_required_one_does_not():
    optional = toy_case(1, skip_reason="no captured inputs given", required=False)
    assert run_lever(toy_lever(cases=(toy_case(0), optional))).verdict == "pass"
    required = toy_case(1, skip_reason="backend refused", required=True)
    record = run_lever(toy_lever(cases=(toy_case(0), required)))
    assert record.verdict == "incomplete"
    assert record.completeness.required_skipped == (required.id,)


@dataclass
class SeesThreads:
    """`base`, noting torch's CPU threads while it runs."""

    base: Any
    seen: list = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.base.name

    def run(self, inputs: torch.Tensor) -> ImplementationOutput:
        self.seen.append(torch.get_num_threads())
        return self.base.run(inputs)


def denormals_survive() -> bool:
    tiny = torch.tensor([1e-39], dtype=torch.float32)  # below FP32's smallest normal, 1.18e-38
    return bool((tiny * 1.0).item() != 0.0)


class SeesDenormals(SeesThreads):
    def run(self, inputs: torch.Tensor) -> ImplementationOutput:
        self.seen.append(denormals_survive())
        return self.base.run(inputs)


def test_a_cpu_case_runs_with_denormals_flushed_and_restores_them_after():
    if not torch.set_flush_denormal(False):
        pytest.skip("this CPU cannot flush denormals (no SSE3)")
    assert denormals_survive()
    candidate = SeesDenormals(CANDIDATE)
    lever = toy_lever(candidate=candidate, controls=(doubled_inputs_control(candidate),))
    assert run_case(lever, toy_case(0)).status == "pass"
    assert set(candidate.seen) == {False}
    assert denormals_survive()


def test_a_lever_may_run_its_cases_on_a_given_number_of_threads():
    before = torch.get_num_threads()
    candidate = SeesThreads(CANDIDATE)
    lever = toy_lever(candidate=candidate, controls=(doubled_inputs_control(candidate),), cpu_threads=1)
    assert run_case(lever, toy_case(0)).status == "pass"
    assert set(candidate.seen) == {1}
    assert torch.get_num_threads() == before


def test_a_gpu_lever_on_the_emulated_gpu_runs_with_the_cpus_settings():
    """The emulated GPU computes on the CPU: a GPU tier's lever there gets its `cpu_threads` and flushed
    denormals, as a CPU lever does (two threads made the Adam levers' emulated tiers several times slower)."""
    from correctness.emulated_gpu.gpus import parse_emulated
    from correctness.emulated_gpu.session import emulated_gpu
    from correctness.tiers import GPU

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        threads, denormals = SeesThreads(CANDIDATE), SeesDenormals(CANDIDATE)
        on_the_host = toy_case(0)  # the toy sums are CPU code: their inputs stay on the CPU
        on_the_host = replace(on_the_host, make_inputs=lambda device, make=on_the_host.make_inputs: make("cpu"))
        for seeing in (threads, denormals):
            lever = toy_lever(tier=GPU, candidate=seeing, controls=(doubled_inputs_control(seeing),), cpu_threads=1)
            with emulated_gpu(parse_emulated("H100x1")):
                assert run_case(lever, on_the_host).status == "pass"
        assert set(threads.seen) == {1} and torch.get_num_threads() == 2
        assert set(denormals.seen) == {False} or not torch.set_flush_denormal(False)
    finally:
        torch.set_num_threads(before)


# run_lever and the lever verdict


def test_run_lever_records_every_case_and_the_declaration():
    lever = toy_lever()
    record = run_lever(lever)
    assert record.verdict == "pass"
    assert [case.case_id for case in record.cases] == [case.id for case in lever.cases]
    assert record.lever["record_id"] == "running-sum--cpu--fp32 accumulation"
    assert record.lever["controls"] == ["inputs doubled"]
    assert record.lever["rule"] == {
        "factor": lever.rule.factor, "slack": lever.rule.slack, "reason": None,
        "systematic_factor": lever.rule.systematic_factor, "systematic_floor_eps": lever.rule.systematic_floor_eps,
        "systematic_noise_sigmas": lever.rule.systematic_noise_sigmas,
        "runs": 2, "bitwise_repeatable": False,
    }
    assert record.lever["slicing"] is None and record.lever["invariants"] == []
    assert record.recipe == RECIPE
    assert record.provenance["device"]["type"] == "cpu"


def test_run_lever_fails_when_any_case_fails():
    lever = toy_lever(cases=(toy_case(0), toy_case(1, skip_reason="not today")), candidate=WithNan(CANDIDATE, 0))
    assert run_lever(lever).verdict == "fail"


@pytest.mark.parametrize(
    ("statuses", "optional", "verdict"),
    [
        ({"a": "pass", "b": "pass"}, (), "pass"),
        ({"a": "pass", "b": "fail"}, (), "fail"),
        ({"a": "skip", "b": "fail"}, (), "fail"),
        ({"a": "skip", "b": "pass"}, (), "incomplete"),  # a required case skipped
        ({"a": "skip", "b": "pass"}, ("a",), "pass"),  # an optional one
        ({"a": "skip", "b": "skip"}, (), "skip"),
        ({"a": "pass"}, (), "incomplete"),  # b declared, not in the record
        ({"a": "pass"}, ("b",), "incomplete"),  # optional or not, a case missing from the record
        ({"a": "no kernel change", "b": "no kernel change"}, (), "no kernel change"),
        ({"a": "no kernel change", "b": "pass"}, (), "pass"),
        ({"a": "no kernel change", "b": "skip"}, (), "incomplete"),
        ({}, (), "skip"),
    ],
)
def test_the_lever_verdict(statuses, optional, verdict):
    assert assess(statuses, declared=("a", "b"), optional=optional)[0] == verdict


def test_completeness_names_the_missing_and_the_skipped_cases():
    verdict, completeness = assess({"a": "pass", "b": "skip", "c": "skip"}, declared=("a", "b", "c", "d"), optional={"c"})
    assert verdict == "incomplete"
    assert completeness.missing == ("d",)
    assert completeness.required_skipped == ("b",) and completeness.optional_skipped == ("c",)
    assert (completeness.declared, completeness.ran) == (4, 1)


# Lever declarations


def test_a_lever_without_negative_controls_is_refused():
    with pytest.raises(ValueError, match="lever running-sum: declares no negative controls"):
        toy_lever(controls=())


def test_a_lever_without_cases_is_refused():
    with pytest.raises(ValueError, match="lever running-sum: declares no cases"):
        toy_lever(cases=())


def test_a_lever_with_repeated_case_ids_is_refused_naming_the_id():
    with pytest.raises(ValueError, match=r"case ids repeat: \['toy-r8-c64-seed0', 'toy-r8-c64-seed0'\]"):
        toy_lever(cases=(toy_case(0), toy_case(1), toy_case(0)))


def test_a_lever_overriding_the_rule_must_say_why():
    looser = Rule(factor=DEFAULT_FACTOR + 1)
    with pytest.raises(ValueError, match="lever running-sum: overrides the rule .* without a rule_reason"):
        toy_lever(rule=looser)
    assert toy_lever(rule=looser, rule_reason="a toy needs a looser rule").rule == looser


def test_record_id_names_lever_tier_and_candidate():
    assert toy_lever().record_id == "running-sum--cpu--fp32 accumulation"


# Records


def test_write_then_read_record_round_trips(tmp_path):
    record = run_lever(toy_lever())
    path = write_record(record, tmp_path)
    assert path == tmp_path / "toy/cpu/running-sum" / f"{file_name('running-sum--cpu--fp32 accumulation')}.json"
    assert path.name.startswith("running-sum--cpu--fp32_accumulation.")  # the id's other characters made legal
    data = read_record(path)
    assert (data["format"], data["format_version"]) == (FORMAT, FORMAT_VERSION)
    assert data["verdict"] == "pass"
    assert data["recipe"] == {"id": RECIPE.id, "model": "Toy", "gpu": "none", "sha256": RECIPE.sha256,
                              "model_facts": None, "model_facts_sha256": None, "model_arguments_checked": [],
                              "model_arguments_unchecked": None, "path": None, "arguments": {}, "arguments_sha256": None}
    assert data["interrupted"] is False
    assert [case["case_id"] for case in data["cases"]] == [case.case_id for case in record.cases]
    first = data["cases"][0]
    assert first["candidate"]["passes"] is True
    assert first["candidate"]["tensors"][0]["error"] == record.cases[0].candidate.tensors[0].error
    assert first["controls"][0]["applies"] is True and first["controls"][0]["fails_bound"] is True
    assert first["shape"] == {"rows": 8, "columns": 64}


def test_non_finite_figures_are_written_as_null(tmp_path):
    record = run_lever(toy_lever(candidate=WithNan(CANDIDATE, 0)))
    path = write_record(record, tmp_path)
    constants = []
    json.loads(path.read_text(), parse_constant=constants.append)  # called on NaN, Infinity, -Infinity
    assert constants == []
    rows = read_record(path)["cases"][0]["candidate"]["tensors"][0]
    assert rows["tensor"] == "rows"
    assert rows["error"] is None and rows["error_over_bound"] is None and rows["worst"]["judged"] is None
    assert rows["passes"] is False


def test_write_record_leaves_no_temporary_files(tmp_path):
    path = write_record(run_lever(toy_lever()), tmp_path)
    assert list(path.parent.iterdir()) == [path]


def test_write_record_replaces_an_existing_record_whole(tmp_path):
    record = run_lever(toy_lever())
    path = write_record(record, tmp_path)
    path.write_text("{" + " " * 1_000_000 + "}")  # longer than any record
    write_record(record, tmp_path)
    assert read_record(path) == json.loads(json.dumps(results_module.record_to_json(record)))
    assert list(path.parent.iterdir()) == [path]


def test_a_failed_write_keeps_the_old_record_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    record = run_lever(toy_lever())
    path = write_record(record, tmp_path)
    before = path.read_bytes()

    def refuse(source, target):
        raise OSError("disk full")

    monkeypatch.setattr("correctness.files.os.replace", refuse)
    with pytest.raises(CorrectnessError, match=r"result record .*: cannot be written \(disk full\)$"):
        write_record(record, tmp_path)
    assert path.read_bytes() == before
    assert list(path.parent.iterdir()) == [path]


@pytest.mark.parametrize(
    ("content", "complaint"),
    [
        (b'{"hello": "world"}', "not a correctness.lever-record file"),
        (b'["correctness.lever-record"]', "not a correctness.lever-record file"),
        (b'{"format": "correctness.lever-record", "format_version": 1}', f"format version 1, this suite reads {FORMAT_VERSION}"),
        (b'{"format": "correctness.lever-record"}', f"format version None, this suite reads {FORMAT_VERSION}"),
        (b'{"format": "correctness.lever-record", "format_vers', "cannot be read as JSON"),
        (b"\xff\xfe not text", "cannot be read as JSON"),
    ],
    ids=["other-json", "a-list", "other-version", "no-version", "truncated", "not-utf8"],
)
def test_read_record_refuses_with_a_one_line_message_naming_the_file(tmp_path, content, complaint):
    path = tmp_path / "record.json"
    path.write_bytes(content)
    with pytest.raises(CorrectnessError) as refused:
        read_record(path)
    message = str(refused.value)
    assert message.startswith(f"result record {path}: ")
    assert complaint in message and "\n" not in message


def test_read_record_refuses_a_missing_file_naming_it(tmp_path):
    path = tmp_path / "absent.json"
    with pytest.raises(CorrectnessError, match=re.escape(f"result record {path}: cannot be read")):
        read_record(path)
