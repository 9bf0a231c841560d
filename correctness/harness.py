"""Runs a declared lever: every path on a case's inputs, comparisons, verdict, record.

For each case: the candidate first (a backend that refuses the case is found before anything
else runs), the FP64 reference, the default, the candidate again (both runs judged; bitwise
equality of the two is reported as determinism), the default again as a positive control (it must
pass), and every applicable negative control (each must fail). A case with no applicable control
fails: it would have no power. Where the rule asks for more runs (`rule.runs`), the candidate and
the default run that often and their spreads are recorded; where it asks for bitwise
repeatability, a candidate whose runs differ fails, and each control runs that often too (one
that is not repeatable fails the rule, as a control must). Streamed inputs run unit by unit, every
path on each unit, so only one unit's outputs are alive at a time.

A refusal (ImplementationUnavailable) skips the case; any other exception, from making the inputs, a path
or a comparison, fails it with the exception's message: a verdict is evidence or nothing. cuDNN's
own refusal of a graph ("no execution plan", "not supported": `cudnn_refusal`) is a refusal too,
whichever path meets it. A CUDA error that leaves the device in an error state (a sticky error: an
illegal memory access, a device-side assert: `sticky_cuda_error`) fails the case at once, every
candidate with it, and `device_fault` tells the caller (the pytest plugin) that the device can run
nothing more in this process.
"""

import contextlib
import datetime
import time
from dataclasses import dataclass, field, replace
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from correctness.catalogue import lever_reads
from correctness.compare import Baseline, OutputsAccumulator, RunSpread, SpreadAccumulator, outputs_baselines
from correctness.errors import ImplementationUnavailable
from correctness.lever import Case, Lever, Implementation, ImplementationOutput, Streamed, runs_backend
from correctness.memory import release_freed_memory
from correctness.emulated_gpu.kernels import snapshot as kernel_calls
from correctness.emulated_gpu.kernels import stand_ins_called
from correctness.emulated_gpu.session import active as emulation_active
from correctness.provenance import provenance
from correctness.recipe_binding import bound_ref
from correctness.results import (
    BACKEND,
    ERROR,
    FAIL,
    FLOOR_MEETS_RULE,
    FORMAT_LIMITED,
    INVARIANT,
    NO_CONTROL,
    NO_KERNEL_CHANGE,
    NO_POWER,
    NON_FINITE,
    NOT_REPEATABLE,
    OUTSIDE_RULE,
    PASS,
    SAME_KERNEL_DIFFERS,
    SKIP,
    SYSTEMATIC,
    CaseResult,
    ControlResult,
    Failure,
    FormatControl,
    FormatResult,
    Judgement,
    LeverRecord,
    PathRun,
    assess,
)
from correctness.tiers import GPU_MARKERS


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize(device)


# CUDA's sticky errors, as cudaGetErrorString words them (torch: "CUDA error: <that>"): after one the
# CUDA context is unusable and every later call in the process returns it (CUDA Runtime API,
# cudaError_t: cudaErrorIllegalAddress, Assert, LaunchFailure, IllegalInstruction, MisalignedAddress,
# InvalidAddressSpace, InvalidPc, HardwareStackError, LaunchTimeout, ECCUncorrectable).
STICKY_CUDA_ERRORS = (
    "an illegal memory access was encountered",
    "device-side assert triggered",
    "unspecified launch failure",
    "an illegal instruction was encountered",
    "misaligned address",
    "operation not supported on global/shared address space",
    "invalid program counter",
    "hardware stack error",
    "the launch timed out and was terminated",
    "uncorrectable ECC error encountered",
)
# cuDNN refusing a graph, as torch raises it: AT_CUDNN_FRONTEND_CHECK (aten/src/ATen/cuda/Exceptions.h)
# words a frontend error "cuDNN Frontend error: <the frontend's message>", e.g. "[cudnn_frontend]
# Error: No execution plans support the graph."; the legacy API's AT_CUDNN_CHECK "cuDNN error:
# CUDNN_STATUS_NOT_SUPPORTED". An execution failure (CUDNN_STATUS_EXECUTION_FAILED) is no refusal.
CUDNN_ERRORS = ("cudnn frontend error", "cudnn error", "cudnn_frontend")
CUDNN_REFUSALS = ("no execution plan", "no valid execution plan", "not supported", "cudnn_status_not_supported")


def sticky_cuda_error(text: str) -> bool:
    """Whether an error's message is one of CUDA's sticky errors (STICKY_CUDA_ERRORS)."""
    return any(sticky in text for sticky in STICKY_CUDA_ERRORS)


def cudnn_refusal(error: BaseException) -> bool:
    """Whether an exception is cuDNN refusing the graph it was given (CUDNN_REFUSALS)."""
    text = str(error).lower()
    return (isinstance(error, RuntimeError) and not isinstance(error, torch.OutOfMemoryError)
            and any(prefix in text for prefix in CUDNN_ERRORS) and any(refusal in text for refusal in CUDNN_REFUSALS)
            and not sticky_cuda_error(str(error)))


def device_error_state(device: torch.device) -> str | None:
    """Why a CUDA device can run nothing more (a sticky error returned by a synchronisation), in one
    line; None where it synchronises, or is no CUDA device."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    try:
        torch.cuda.synchronize(device)
    except Exception as error:  # noqa: BLE001 - whatever it raises, the device is not usable
        return f"{type(error).__name__}: {_first_line(error)}"
    return None


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


class _ImplementationError(Exception):
    """A path raised something other than a refusal: the case fails with this message."""


class _DeviceFault(_ImplementationError):
    """A path left the CUDA device in an error state: the case fails, and no other candidate runs."""


@dataclass
class _Runs:
    """One path's runs over a case's units (in its role: candidate, default, a control...): what
    ran, and for how long in all."""

    path: Implementation
    device: torch.device
    role: str
    seconds: float = 0.0
    backends: dict[str, None] = field(default_factory=dict)  # insertion-ordered set
    details: dict[str, Any] = field(default_factory=dict)

    def run(self, inputs: Any) -> ImplementationOutput:
        _synchronize(self.device)
        start = time.perf_counter()
        try:
            output = self.path.run(inputs)
            _synchronize(self.device)
        except ImplementationUnavailable:
            raise
        except Exception as error:
            if cudnn_refusal(error):
                raise ImplementationUnavailable(
                    f"{self.role} ({self.path.name}): cuDNN refuses the case: {_first_line(error)}"
                                      ) from error
            fault = _DeviceFault if sticky_cuda_error(str(error)) else _ImplementationError
            raise fault(f"{self.role} ({self.path.name}) raised {type(error).__name__}: {error}") from error
        self.seconds += time.perf_counter() - start
        self.backends[output.backend] = None
        for key, value in output.details.items():
            self.details.setdefault(key, value)
        return output

    def record(self) -> PathRun:
        return PathRun(
            path=self.path.name, backend=" | ".join(self.backends), details=self.details, seconds=self.seconds
        )


@dataclass
class _Judged:
    """A judged path's runs and its comparisons, accumulated over the units."""

    runs: _Runs
    comparisons: OutputsAccumulator

    def judgement(self) -> Judgement:
        return Judgement(run=self.runs.record(), tensors=self.comparisons.results())


def _shape_record(shape: Any) -> Mapping[str, Any]:
    record = getattr(shape, "record", None)
    return record() if callable(record) else {"description": str(shape)}


def case_identity(case: Case) -> dict[str, Any]:
    """The CaseResult fields that say which case it was."""
    return {
        "case_id": case.id,
        "source": case.source,
        "variant": case.variant,
        "seed": case.seed,
        "shape": _shape_record(case.shape),
        "required": case.required,
        "expected_backend": case.expected_backend,
        "recipe_runs": case.recipe_runs,
    }


def not_run(case: Case, reason: str) -> CaseResult:
    """A case skipped before anything of it ran, with the reason (the device can run nothing more)."""
    return _not_judged(case, time.perf_counter(), skip_reason=reason)


def device_fault(lever: Lever, result: CaseResult) -> str | None:
    """Where a failed case of a CUDA tier left its device in an error state, why (its sticky error,
    or what a synchronisation of the device now raises), in one line; else None."""
    if result.status != FAIL or lever.tier.device != "cuda":
        return None
    sticky = next((failure for failure in result.failures if failure.kind == ERROR and sticky_cuda_error(failure)),
                  None)
    if sticky is not None:
        return sticky.splitlines()[0]
    return device_error_state(torch.device(lever.tier.device))


def _not_judged(case: Case, started: float, *, skip_reason: str | None = None, error: str | None = None) -> CaseResult:
    """A case that skipped (with the reason) or failed with an error before it could be judged."""
    return CaseResult(
        **case_identity(case),
        status=SKIP if error is None else FAIL,
        skip_reason=skip_reason,
        failures=() if error is None else (Failure(error, kind=ERROR),),
        reference=None,
        default=None,
        candidate=None,
        candidate_repeat=None,
        deterministic=None,
        nondeterministic_tensors=(),
        runs=0,
        candidate_spread=(),
        default_spread=(),
        default_repeat=None,
        controls=(),
        secondary=(),
        invariants=(),
        systematic=(),
        resolution={},
        summary={},
        seconds=time.perf_counter() - started,
    )


def _judgement_failures(role: str, judgement: Judgement, baseline: str = "default") -> list[Failure]:
    """One per tensor outside its bound; `baseline` names what the bound is made from (the default,
    or a format floor)."""
    failures = []
    for t in judgement.tensors:
        if t.nonfinite:
            failures.append(Failure(f"{role} {t.tensor}: non-finite values ({t.nonfinite})", kind=NON_FINITE,
                                    role=role, tensor=t.tensor))
        elif t.error > t.bound:
            failures.append(Failure(
                f"{role} {t.tensor}: error {t.error:.3e} > bound {t.bound:.3e}"
                f" ({baseline} error {t.default_error:.3e}); worst element at {list(t.worst.index)}:"
                f" {role} {t.worst.judged:.6g}, {baseline} {t.worst.default:.6g}, reference {t.worst.reference:.6g}",
                kind=OUTSIDE_RULE, role=role, tensor=t.tensor))
        elif t.slices is not None and t.slices.failing:
            worst = t.slices
            failures.append(Failure(
                f"{role} {t.tensor}: {worst.failing} of {worst.count} slices ({worst.scheme}) outside their bound;"
                f" worst {worst.worst}: error {worst.error:.3e} > bound {worst.bound:.3e}"
                f" ({baseline} error {worst.default_error:.3e}), {worst.error_over_bound:.2f} x",
                kind=OUTSIDE_RULE, role=role, tensor=t.tensor))
    return failures


def _kernel_failures(lever: Lever, case: Case, candidate: Judgement, default: PathRun) -> tuple[list[Failure], bool]:
    """Failures of the recipe's backend claim and of an unchanged kernel, and whether the
    candidate ran the default's own kernel (a kernel lever's "no kernel change")."""
    failures = []
    ran = candidate.run.backend
    if case.expected_backend is not None and not runs_backend(ran, case.expected_backend):
        failures.append(Failure(f"the recipe says {case.expected_backend} runs on this case; the candidate ran {ran}",
                                kind=BACKEND, role="candidate"))
    same_kernel = lever.compares_kernels and ran == default.backend
    if same_kernel:
        differ = [t.tensor for t in candidate.tensors if not t.bitwise_identical]
        if differ:
            failures.append(Failure(
                f"candidate and default both ran {ran}, yet differ bitwise on {', '.join(differ)}:"
                " the same kernel on the same inputs must give the same bits", kind=SAME_KERNEL_DIFFERS, role="candidate"))
    return failures, same_kernel


def systematic_tensors(candidate: Judgement, secondary: Iterable[Judgement]) -> tuple[str, ...]:
    """Tensors whose systematic error is flagged against the reference and against every secondary
    reference: a slope that FP32-rounded hyperparameters explain (the secondary reference computes
    with them) is not the candidate's own."""
    explained = [{t.tensor for t in extra.tensors if not t.systematic_flagged} for extra in secondary]
    return tuple(
        t.tensor for t in candidate.tensors
        if t.systematic_flagged and not any(t.tensor in names for names in explained)
    )


def _systematic_failures(candidate: Judgement, flagged: tuple[str, ...], baseline: str = "default") -> list[Failure]:
    failures = []
    for t in candidate.tensors:
        if t.tensor not in flagged:
            continue
        whole = t.systematic
        if whole.flagged:
            where, figures = "whole", whole
        else:
            where = f"slice {t.slices.systematic_worst} ({t.slices.systematic_flagged} flagged)"
            figures = t.slices.systematic
        failures.append(Failure(
            f"candidate {t.tensor}: systematic error ({where}): slope {figures.slope:+.2e} (threshold"
            f" {figures.slope_threshold:.2e}, {baseline} {figures.default_slope:+.2e}), offset {figures.offset:+.2e}"
            f" (threshold {figures.offset_threshold:.2e}, {baseline} {figures.default_offset:+.2e})",
            kind=SYSTEMATIC, role="candidate", tensor=t.tensor))
    return failures


def _spread_failure(role: str, spread: RunSpread) -> Failure:
    return Failure(f"{role} {spread.tensor}: not bitwise repeatable over {spread.runs} runs: {spread.differing_elements}"
                   f" of {spread.elements} elements differ from its first run (relative {spread.relative:.2e}, largest"
                   f" {spread.max_abs:.3g})", kind=NOT_REPEATABLE, role=role, tensor=spread.tensor)


def _resolution(candidate: Judgement) -> dict[str, Any]:
    """The smallest random error (the bound) and scale bias (the slope threshold) this case detects."""
    by_bound = min(candidate.tensors, key=lambda t: t.bound)
    by_slope = min(candidate.tensors, key=lambda t: t.systematic.slope_threshold)
    return {
        "error": by_bound.bound, "error_tensor": by_bound.tensor,
        "slope": by_slope.systematic.slope_threshold, "slope_tensor": by_slope.tensor,
    }


def _format_result(
    format_name: str, roundings: tuple[str, ...], floor: Judgement, candidate: "_Candidate", repeat: bool,
    judged_runs: list[Judgement], controls: Mapping[str, Judgement], outside_rule: list[Failure],
) -> FormatResult:
    """The case against its candidate's format. Where the candidate is outside the rule
    (`outside_rule`, its lines; empty where it passes, or where the case fails for another reason)
    the findings say why it is not format-limited: the floor passes the rule on a tensor the
    candidate fails (its format can meet the rule there), the candidate is outside the format bound
    (worse than its format allows) or biased beyond the floor's rounding, or a control is within the
    format bound (the format bound could not tell it from the candidate)."""
    against_floor = Judgement(run=candidate.first.runs.record(), tensors=candidate.format_first.results())
    repeat_against_floor = (Judgement(run=candidate.repeat.runs.record(), tensors=candidate.format_repeat.results())
                            if repeat else None)
    format_controls = tuple(FormatControl(name=name, judgement=judgement) for name, judgement in controls.items())
    biased = systematic_tensors(against_floor, ())
    findings: list[Failure] = []
    if outside_rule:
        failing = dict.fromkeys(t.tensor for judgement in judged_runs for t in judgement.tensors if not t.passes)
        floor_passes = [name for name in failing if next(t for t in floor.tensors if t.tensor == name).passes]
        if floor_passes:
            findings.append(Failure(f"the {format_name} format floor passes the rule on {', '.join(floor_passes)}, where"
                                    f" the candidate fails it: a {format_name} implementation can meet the rule there",
                                    kind=FLOOR_MEETS_RULE, role="candidate"))
        role, baseline = f"candidate against the {format_name} floor", "floor"
        findings += [line.extended(f" (worse than {format_name} allows)")
                     for line in _judgement_failures(role, against_floor, baseline)]
        if repeat_against_floor is not None:
            findings += [line.extended(f" (worse than {format_name} allows)")
                         for line in _judgement_failures(f"{role} (repeat)", repeat_against_floor, baseline)]
        findings += [line.extended(f" (biased beyond the {format_name} floor's rounding)")
                     for line in _systematic_failures(against_floor, biased, "floor")]
        findings += [
            Failure(f"negative control '{control.name}' is within the {format_name} format bound (largest error/bound"
                    f" {control.power:.2f}, {control.judgement.worst.tensor}): the format bound cannot tell it from"
                    " the candidate", kind=NO_POWER, role=control.name, tensor=control.judgement.worst.tensor)
            for control in format_controls if not control.fails
        ]
    return FormatResult(
        format=format_name, roundings=roundings, floor=floor, candidate=against_floor,
        candidate_repeat=repeat_against_floor, controls=format_controls, systematic=biased,
        outside_rule=tuple(outside_rule) if not findings else (), findings=tuple(findings),
    )


@contextlib.contextmanager
def _cpu_settings(lever: Lever) -> Iterator[None]:
    """For a CPU lever, and a GPU lever on the emulated GPU (which computes on the CPU): torch's
    intra-op threads set to the lever's `cpu_threads` (None: left as they are), and denormal
    floats flushed to zero. Denormals (the tails of softmax's exponentials)
    slow an x86 core's arithmetic up to about 100x on some CPUs; values below 1.2e-38 (FP32) and
    2.2e-308 (FP64) change no figure (the records are identical with and without), and GPU kernels
    commonly flush them too. torch has no getter for the flag, so it is left off (its default)."""
    if lever.tier.device != "cpu" and emulation_active() is None:
        yield
        return
    saved = torch.get_num_threads()
    if lever.cpu_threads is not None:
        torch.set_num_threads(lever.cpu_threads)
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(saved)


def run_case(lever: Lever, case: Case, *, strict_systematic: bool = False) -> CaseResult:
    """Run one case of a lever and decide it: "pass", "fail", "no kernel change", or "skip" where
    the case or a backend refuses it. `strict_systematic`: a flagged systematic error fails it."""
    return run_candidates(lever, case, (lever.candidate,), strict_systematic=strict_systematic)[0]


def run_candidates(
    lever: Lever, case: Case, candidates: Sequence[Implementation], *, strict_systematic: bool = False,
    repeat: bool = True,
) -> tuple[CaseResult, ...]:
    """Judge several candidates on one case, computing the inputs, the reference, the default, its
    repeat and the lever's controls once: one CaseResult per candidate, in order, each as
    run_case would give it for a lever with that candidate (the controls are the lever's own, built
    on `lever.candidate`: they measure the bound's power on the case, whichever candidate is
    judged). A candidate that refuses the case skips; the others go on. `repeat=False` runs each
    candidate once (no determinism figure, `candidate_repeat` null): for screening many candidates."""
    if not candidates:
        raise ValueError(f"lever {lever.name}: run_candidates needs at least one candidate")
    with _cpu_settings(lever):
        return _run_candidates(lever, case, tuple(candidates), strict_systematic, repeat)


@dataclass
class _Invariants:
    """The lever's invariants checked on one role's runs, unit by unit: how many units broke each,
    and the first unit's account."""

    role: str
    units: int = 0
    broken: dict[str, list] = field(default_factory=dict)  # invariant name -> [count, first problem]

    def check(self, lever: Lever, unit: Any, tensors: Mapping[str, torch.Tensor]) -> None:
        self.units += 1
        for invariant in lever.invariants:
            problem = invariant.check(unit, tensors)
            if problem is not None:
                self.broken.setdefault(invariant.name, [0, problem])[0] += 1

    def failures(self) -> list[Failure]:
        units = "" if self.units == 1 else " on {count} of " + f"{self.units} units"
        return [
            Failure(f"{self.role} breaks the invariant '{name}'{units.format(count=count)}: {first}", kind=INVARIANT,
                    role=self.role)
            for name, (count, first) in self.broken.items()
        ]


@dataclass
class _Candidate:
    """One candidate's two judged runs (and the rule's further runs) and what they changed."""

    first: _Judged
    repeat: _Judged
    secondary: list[_Judged]
    spread: SpreadAccumulator = field(default_factory=SpreadAccumulator)
    invariants: _Invariants | None = None
    repeat_invariants: _Invariants | None = None
    skip_reason: str | None = None
    error: str | None = None  # the candidate raised: it fails, the other candidates go on
    # Its first run and its repeat with the format floor in the default's place (levers with one).
    format_first: OutputsAccumulator | None = None
    format_repeat: OutputsAccumulator | None = None

    @property
    def active(self) -> bool:
        return self.skip_reason is None and self.error is None


@dataclass
class _ControlRuns:
    """One applicable negative control's runs: judged, its repeats' spread, and (levers with a format
    floor) its first run against the floor."""

    judged: _Judged
    spread: SpreadAccumulator = field(default_factory=SpreadAccumulator)
    against_floor: OutputsAccumulator | None = None


@dataclass
class _UnitBaselines:
    """What a unit's judged outputs are compared with: the reference's and the default's outputs and
    their shared baselines, and the format floor's outputs and baselines (None: no floor)."""

    reference: Mapping[str, torch.Tensor]
    default: Mapping[str, torch.Tensor]
    shared: dict[str, Baseline]
    floor: Mapping[str, torch.Tensor] | None = None
    floor_shared: dict[str, Baseline] | None = None

    def compare(self, comparisons: OutputsAccumulator, judged: Mapping[str, torch.Tensor]) -> None:
        comparisons.add(judged, self.default, self.reference, self.shared)

    def compare_with_floor(self, comparisons: OutputsAccumulator | None, judged: Mapping[str, torch.Tensor]) -> None:
        if self.floor is not None:
            comparisons.add(judged, self.floor, self.reference, self.floor_shared)


class _CaseSchedule:
    """The per-unit schedule of one case: every path's runs on each unit, in order (the candidates'
    first runs, the reference, the default, the format floor, each candidate's repeats and secondary
    references, the default's repeats, the controls), accumulated into their judgements."""

    def __init__(self, lever: Lever, case: Case, candidates: tuple[Implementation, ...], repeat: bool):
        self.lever, self.repeat, self.several = lever, repeat, len(candidates) > 1
        self.device = torch.device(lever.tier.device)
        self.reference = _Runs(path=lever.reference, device=self.device, role="reference")
        self.default = _Runs(path=lever.default, device=self.device, role="default")
        self.default_repeat = self._judged(lever.default, "default (repeat)")
        self.default_invariants = _Invariants(role="the default")
        self.default_spread = SpreadAccumulator()
        floor = lever.format_floor
        self.floor = self._judged(floor.implementation, f"format floor ({floor.format})") if floor else None
        self.candidates = [self._candidate(path) for path in candidates]
        self.applicable = {control.name: control.why_inapplicable(case) for control in lever.controls}
        self.controls = {
            control.name: _ControlRuns(
                judged=self._judged(control.implementation, f"control '{control.name}'"),
                against_floor=self._accumulator() if floor else None,
            )
            for control in lever.controls
            if self.applicable[control.name] is None
        }

    def _accumulator(self) -> OutputsAccumulator:
        return OutputsAccumulator(rule=self.lever.rule, slicing=self.lever.slicing)

    def _judged(self, path: Implementation, role: str) -> _Judged:
        return _Judged(runs=_Runs(path=path, device=self.device, role=role), comparisons=self._accumulator())

    def _candidate(self, path: Implementation) -> _Candidate:
        role = f"candidate {path.name}" if self.several else "candidate"
        with_floor = self.floor is not None
        return _Candidate(
            first=self._judged(path, "candidate"),
            repeat=self._judged(path, "candidate (repeat)"),
            secondary=[self._judged(extra, "secondary reference") for extra in self.lever.secondary_references],
            invariants=_Invariants(role=role),
            repeat_invariants=_Invariants(role=f"{role} (repeat)"),
            format_first=self._accumulator() if with_floor else None,
            format_repeat=self._accumulator() if with_floor else None,
        )

    def run_unit(self, unit: Any) -> bool:
        """Run every path on one unit; False where no candidate ran on it (each refused or raised)."""
        firsts = self._candidates_first(unit)
        if not firsts:
            return False
        offsets = self.candidates[min(firsts)].first.comparisons.offsets()
        baselines = self._baselines(unit, offsets)
        for index, first in firsts.items():
            self._judge_candidate(self.candidates[index], unit, first.tensors, baselines)
        del firsts
        for again in range(1, self.lever.rule.runs):
            repeated = self.default_repeat.runs.run(unit).tensors
            if again == 1:
                baselines.compare(self.default_repeat.comparisons, repeated)
            self.default_spread.add(again, baselines.default, repeated)
        control_runs = self.lever.rule.runs if self.lever.rule.bitwise_repeatable else 1
        for control in self.controls.values():
            control_first = control.judged.runs.run(unit).tensors
            baselines.compare(control.judged.comparisons, control_first)
            baselines.compare_with_floor(control.against_floor, control_first)
            for again in range(1, control_runs):
                control.spread.add(again, control_first, control.judged.runs.run(unit).tensors)
        return True

    @contextlib.contextmanager
    def _failing_alone(self, candidate: _Candidate) -> Iterator[None]:
        """Where several candidates are judged, one that raises fails alone and the others go on;
        where one is, or the device is left in an error state, the case fails."""
        try:
            yield
        except _ImplementationError as path_error:
            if not self.several or isinstance(path_error, _DeviceFault):
                raise
            candidate.error = str(path_error)

    def _candidates_first(self, unit: Any) -> dict[int, ImplementationOutput]:
        """Every active candidate's first run on the unit, before any other path: a refusal costs nothing else."""
        firsts = {}
        for index, candidate in enumerate(self.candidates):
            if not candidate.active:
                continue
            try:
                with self._failing_alone(candidate):
                    firsts[index] = candidate.first.runs.run(unit)
            except ImplementationUnavailable as unavailable:
                candidate.skip_reason = str(unavailable)
        return firsts

    def _baselines(self, unit: Any, offsets: Mapping[str, int]) -> _UnitBaselines:
        """The reference's, the default's and the format floor's runs on the unit; the default's
        invariants checked and the floor judged."""
        reference, default = self.reference.run(unit).tensors, self.default.run(unit).tensors
        self.default_invariants.check(self.lever, unit, default)
        baselines = _UnitBaselines(
            reference=reference, default=default,
            shared=outputs_baselines(default, reference, offsets, self.lever.slicing),
        )
        if self.floor is not None:
            baselines.floor = self.floor.runs.run(unit).tensors
            baselines.compare(self.floor.comparisons, baselines.floor)
            baselines.floor_shared = outputs_baselines(baselines.floor, reference, offsets, self.lever.slicing)
        return baselines

    def _judge_candidate(
        self, candidate: _Candidate, unit: Any, first: Mapping[str, torch.Tensor], baselines: _UnitBaselines
    ) -> None:
        """A candidate's first run judged, its repeats run and judged, its secondary references run."""
        baselines.compare(candidate.first.comparisons, first)
        baselines.compare_with_floor(candidate.format_first, first)
        candidate.invariants.check(self.lever, unit, first)
        if self.repeat:
            with self._failing_alone(candidate):
                self._repeat_candidate(candidate, unit, first, baselines)
            if not candidate.active:
                return
        for extra in candidate.secondary:
            extra.comparisons.add(first, baselines.default, extra.runs.run(unit).tensors)

    def _repeat_candidate(
        self, candidate: _Candidate, unit: Any, first: Mapping[str, torch.Tensor], baselines: _UnitBaselines
    ) -> None:
        """The candidate's repeat, judged, and the rule's further runs, each against its first run."""
        second = candidate.repeat.runs.run(unit).tensors
        baselines.compare(candidate.repeat.comparisons, second)
        baselines.compare_with_floor(candidate.format_repeat, second)
        candidate.repeat_invariants.check(self.lever, unit, second)
        candidate.spread.add(1, first, second)
        del second
        for again in range(2, self.lever.rule.runs):
            candidate.spread.add(again, first, candidate.repeat.runs.run(unit).tensors)


def _run_candidates(
    lever: Lever, case: Case, candidates: tuple[Implementation, ...], strict_systematic: bool, repeat: bool
) -> tuple[CaseResult, ...]:
    started = time.perf_counter()
    if case.skip_reason:
        return tuple(_not_judged(case, started, skip_reason=case.skip_reason) for _ in candidates)
    schedule = _CaseSchedule(lever, case, candidates, repeat)
    error: str | None = None
    try:
        inputs = case.make_inputs(schedule.device)
        streamed = isinstance(inputs, Streamed)
        for unit in inputs.units if streamed else (inputs,):
            if not schedule.run_unit(unit):
                break
            if streamed:
                release_freed_memory()  # else the C heap keeps every unit's freed tensors
    except ImplementationUnavailable as unavailable:  # the reference, the default or a control refuses: no judgement
        return tuple(_not_judged(case, started, skip_reason=str(unavailable)) for _ in candidates)
    except _ImplementationError as path_error:
        error = str(path_error)
    except Exception as other:  # making the inputs, or comparing the outputs
        error = f"{type(other).__name__}: {other}"
    if error is not None:
        return tuple(_not_judged(case, started, error=error) for _ in candidates)
    return _decide(schedule, case, strict_systematic, started)


@dataclass(frozen=True)
class _CaseFindings:
    """What the decisions of a case's candidates share: the controls' results, the default's repeat
    (the positive control), and the failures that belong to the case, not to a candidate."""

    controls: tuple[ControlResult, ...]
    default_repeat: Judgement
    failures: list[Failure]


def _case_findings(schedule: _CaseSchedule) -> _CaseFindings:
    lever, controls = schedule.lever, schedule.controls
    control_results = tuple(
        ControlResult(
            name=control.name,
            inapplicable_reason=schedule.applicable[control.name],
            judgement=controls[control.name].judged.judgement() if control.name in controls else None,
            spread=(controls[control.name].spread.spreads()
                    if control.name in controls and lever.rule.bitwise_repeatable else None),
        )
        for control in lever.controls
    )
    default_repeat = schedule.default_repeat.judgement()
    failures = _judgement_failures("positive control (default repeated)", default_repeat)
    failures += schedule.default_invariants.failures()
    for control in control_results:
        if control.judgement is not None and not control.fails:
            worst = control.judgement.worst
            repeatable = (f", and is bitwise repeatable over {lever.rule.runs} runs"
                          if lever.rule.bitwise_repeatable else "")
            failures.append(Failure(
                f"negative control '{control.name}' passes the bound on every tensor and slice (largest error/bound"
                f" {worst.error_over_bound:.2f}, {worst.tensor}){repeatable}: no power on this case",
                kind=NO_POWER, role=control.name, tensor=worst.tensor))
    if all(control.judgement is None for control in control_results):
        failures.append(Failure("no negative control applies to this case, so it could not fail", kind=NO_CONTROL))
    return _CaseFindings(controls=control_results, default_repeat=default_repeat, failures=failures)


def _decide(schedule: _CaseSchedule, case: Case, strict_systematic: bool, started: float) -> tuple[CaseResult, ...]:
    """The decision step: each candidate's CaseResult from what the schedule accumulated."""
    if not any(candidate.active for candidate in schedule.candidates):
        return tuple(_not_judged(case, started, skip_reason=c.skip_reason, error=c.error) for c in schedule.candidates)
    findings = _case_findings(schedule)
    results = []
    for candidate in schedule.candidates:
        if not candidate.active:
            results.append(_not_judged(case, started, skip_reason=candidate.skip_reason, error=candidate.error))
            continue
        result = _decide_candidate(schedule, case, candidate, findings, strict_systematic, started)
        summarize = schedule.lever.summarize
        results.append(replace(result, summary=dict(summarize(result))) if summarize else result)
    return tuple(results)


@dataclass(frozen=True)
class _CandidateJudgements:
    """A candidate's judgements on a case: its first run, its repeat (None where it runs once), the
    secondary references' and its runs' spread, and the tensors whose systematic error is its own."""

    first: Judgement
    repeat: Judgement | None
    secondary: tuple[Judgement, ...]
    spread: tuple[RunSpread, ...]
    systematic: tuple[str, ...]

    @staticmethod
    def of(candidate: _Candidate, repeat: bool) -> "_CandidateJudgements":
        first = candidate.first.judgement()
        repeated = candidate.repeat.judgement() if repeat else None
        secondary = tuple(extra.judgement() for extra in candidate.secondary)
        return _CandidateJudgements(
            first=first, repeat=repeated, secondary=secondary, spread=candidate.spread.spreads(),
            systematic=systematic_tensors(first, secondary),
        )

    @property
    def runs(self) -> list[Judgement]:
        return [self.first] + ([self.repeat] if self.repeat is not None else [])


def _decide_candidate(
    schedule: _CaseSchedule, case: Case, candidate: _Candidate, findings: _CaseFindings, strict_systematic: bool,
    started: float,
) -> CaseResult:
    """One candidate's verdict: outside the rule, failing for another reason, format-limited (outside
    the rule only as far as its format's floor is), running the default's own kernel, or passing."""
    lever = schedule.lever
    judged = _CandidateJudgements.of(candidate, schedule.repeat)
    outside_rule = _judgement_failures("candidate", judged.first)
    if judged.repeat is not None:
        outside_rule += _judgement_failures("candidate (repeat)", judged.repeat)
    failures = candidate.invariants.failures() + candidate.repeat_invariants.failures()
    if lever.rule.bitwise_repeatable and schedule.repeat:
        failures += [_spread_failure("candidate", spread) for spread in judged.spread]
    failures += findings.failures
    kernel_failures, same_kernel = _kernel_failures(lever, case, judged.first, schedule.default.record())
    failures += kernel_failures
    format_result = None
    if schedule.floor is None and strict_systematic:
        failures += _systematic_failures(judged.first, judged.systematic)
    elif schedule.floor is not None:
        format_result = _candidate_format(schedule, candidate, judged, outside_rule if not failures else [])
        if strict_systematic and not outside_rule:
            # A narrower format's rounding biases what it computes (BF16 moments shrink): strict
            # systematic checks judge a candidate with a floor against the floor's own bias.
            failures += _systematic_failures(format_result.candidate, format_result.systematic, "floor")
    limited = bool(outside_rule) and format_result is not None and not failures and not format_result.findings
    if outside_rule and not limited:
        failures = outside_rule + failures + (list(format_result.findings) if format_result else [])
    status = FAIL if failures else (FORMAT_LIMITED if limited else NO_KERNEL_CHANGE if same_kernel else PASS)
    return CaseResult(
        **case_identity(case),
        status=status,
        skip_reason=None,
        failures=tuple(failures),
        reference=schedule.reference.record(),
        default=schedule.default.record(),
        candidate=judged.first,
        candidate_repeat=judged.repeat,
        deterministic=not judged.spread if schedule.repeat else None,
        nondeterministic_tensors=tuple(spread.tensor for spread in judged.spread),
        runs=lever.rule.runs if schedule.repeat else 1,
        candidate_spread=judged.spread,
        default_spread=schedule.default_spread.spreads(),
        default_repeat=findings.default_repeat,
        controls=findings.controls,
        secondary=judged.secondary,
        invariants=tuple(invariant.name for invariant in lever.invariants),
        systematic=judged.systematic,
        resolution=_resolution(judged.first),
        summary={},
        seconds=time.perf_counter() - started,
        format=format_result,
    )


def _candidate_format(
    schedule: _CaseSchedule, candidate: _Candidate, judged: _CandidateJudgements, outside_rule: list[Failure]
) -> FormatResult:
    floor = schedule.lever.format_floor
    control_judgements = {
        name: Judgement(run=control.judged.runs.record(), tensors=control.against_floor.results())
        for name, control in schedule.controls.items()
    }
    return _format_result(
        floor.format, floor.roundings, schedule.floor.judgement(), candidate, schedule.repeat, judged.runs,
        control_judgements, outside_rule,
    )


def lever_summary(lever: Lever) -> dict[str, Any]:
    """The lever's declaration as recorded: names of its paths and controls, and its rule."""
    return {
        "name": lever.name,
        "version": lever.version,
        "tier": lever.tier.name,
        "record_id": lever.record_id,
        "description": lever.description,
        "device": lever.tier.device,
        "candidate": lever.candidate.name,
        "default": lever.default.name,
        "reference": lever.reference.name,
        "controls": [control.name for control in lever.controls],
        "cases": [case.id for case in lever.cases],
        "optional_cases": [case.id for case in lever.cases if not case.required],
        "compares_kernels": lever.compares_kernels,
        "scale": lever.scale if lever.tier.device == "cpu" or emulation_active() is not None else None,
        "rule": {
            "factor": lever.rule.factor, "slack": lever.rule.slack, "reason": lever.rule_reason,
            "systematic_factor": lever.rule.systematic_factor, "systematic_floor_eps": lever.rule.systematic_floor_eps,
            "systematic_noise_sigmas": lever.rule.systematic_noise_sigmas,
            "runs": lever.rule.runs, "bitwise_repeatable": lever.rule.bitwise_repeatable,
        },
        "slicing": None if lever.slicing is None else lever.slicing.describe(),
        "invariants": [invariant.name for invariant in lever.invariants],
        "format_floor": None if lever.format_floor is None else {
            "format": lever.format_floor.format, "roundings": list(lever.format_floor.roundings),
            "path": lever.format_floor.implementation.name,
        },
    }


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def build_record(lever: Lever, cases: Iterable[CaseResult], started: str, seconds: float,
                 emulated_stand_ins: Mapping[str, Any] | None = None) -> LeverRecord:
    """The lever's record of its cases' results; its recipe reference carries the values of the
    recipe arguments the lever reads (correctness.recipe_binding). Under an emulated GPU,
    `emulated_stand_ins` are the kernel stand-ins its cases called (correctness.emulated_gpu.kernels)."""
    cases = tuple(cases)
    verdict, completeness = assess(
        {case.case_id: case.status for case in cases},
        [case.id for case in lever.cases],
        {case.id for case in lever.cases if not case.required},
    )
    return LeverRecord(
        lever=lever_summary(lever),
        recipe=bound_ref(lever.recipe, lever_reads(lever.name)),
        verdict=verdict,
        completeness=completeness,
        cases=cases,
        provenance=provenance(torch.device(lever.tier.device), recipe_gpu=GPU_MARKERS.get(lever.tier.name),
                              emulated_stand_ins=None if emulated_stand_ins is None else dict(emulated_stand_ins)),
        started=started,
        finished=_now(),
        seconds=seconds,
    )


def run_lever(lever: Lever, *, strict_systematic: bool = False) -> LeverRecord:
    """Run every case of a lever and return its record (write it with results.write_record)."""
    started, clock, calls = _now(), time.perf_counter(), kernel_calls()
    cases = [run_case(lever, case, strict_systematic=strict_systematic) for case in lever.cases]
    return build_record(lever, cases, started, time.perf_counter() - clock, stand_ins_called(since=calls))
