"""Runs a declared lever: every path on a case's inputs, comparisons, verdict, record.

For each case: the candidate first (a backend that refuses the case is found before anything
else runs), the FP64 reference, the default, the candidate again (both runs judged; bitwise
equality of the two is reported as determinism), the default again as a positive control (it must
pass), and every applicable negative control (each must fail). A case with no applicable control
fails: it would have no power. Streamed inputs run unit by unit, every path on each unit, so only
one unit's outputs are alive at a time.

A refusal (PathUnavailable) skips the case; any other exception, from making the inputs, a path
or a comparison, fails it with the exception's message: a verdict is evidence or nothing.
"""

import contextlib
import datetime
import time
from dataclasses import dataclass, field, replace
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from correctness.compare import OutputsAccumulator, bitwise_equal, outputs_baselines
from correctness.errors import PathUnavailable
from correctness.lever import Case, Lever, Path, PathOutput, Streamed, runs_backend
from correctness.provenance import provenance
from correctness.results import (
    FAIL,
    NO_KERNEL_CHANGE,
    PASS,
    SKIP,
    CaseResult,
    ControlResult,
    Judgement,
    LeverRecord,
    PathRun,
    assess,
)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize(device)


class _PathError(Exception):
    """A path raised something other than a refusal: the case fails with this message."""


@dataclass
class _Runs:
    """One path's runs over a case's units (in its role: candidate, default, a control...): what
    ran, and for how long in all."""

    path: Path
    device: torch.device
    role: str
    seconds: float = 0.0
    backends: dict[str, None] = field(default_factory=dict)  # insertion-ordered set
    details: dict[str, Any] = field(default_factory=dict)

    def run(self, inputs: Any) -> PathOutput:
        _synchronize(self.device)
        start = time.perf_counter()
        try:
            output = self.path.run(inputs)
            _synchronize(self.device)
        except PathUnavailable:
            raise
        except Exception as error:
            raise _PathError(f"{self.role} ({self.path.name}) raised {type(error).__name__}: {error}") from error
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


def _identity(case: Case) -> dict[str, Any]:
    """The CaseResult fields that say which case it was."""
    return {
        "case_id": case.id,
        "source": case.source,
        "variant": case.variant,
        "seed": case.seed,
        "shape": _shape_record(case.shape),
        "required": case.required,
        "expected_backend": case.expected_backend,
    }


def _not_judged(case: Case, started: float, *, skip_reason: str | None = None, error: str | None = None) -> CaseResult:
    """A case that skipped (with the reason) or failed with an error before it could be judged."""
    return CaseResult(
        **_identity(case),
        status=SKIP if error is None else FAIL,
        skip_reason=skip_reason,
        failures=() if error is None else (error,),
        reference=None,
        default=None,
        candidate=None,
        candidate_repeat=None,
        deterministic=None,
        nondeterministic_tensors=(),
        default_repeat=None,
        controls=(),
        secondary=(),
        summary={},
        seconds=time.perf_counter() - started,
    )


def _judgement_failures(role: str, judgement: Judgement) -> list[str]:
    failures = []
    for t in judgement.tensors:
        if t.nonfinite:
            failures.append(f"{role} {t.tensor}: non-finite values ({t.nonfinite})")
        elif not t.passes:
            failures.append(
                f"{role} {t.tensor}: error {t.error:.3e} > bound {t.bound:.3e}"
                f" (default error {t.default_error:.3e}); worst element at {list(t.worst.index)}:"
                f" {role} {t.worst.judged:.6g}, default {t.worst.default:.6g}, reference {t.worst.reference:.6g}"
            )
    return failures


def _kernel_failures(lever: Lever, case: Case, candidate: Judgement, default: PathRun) -> tuple[list[str], bool]:
    """Failures of the recipe's backend claim and of an unchanged kernel, and whether the
    candidate ran the default's own kernel (a kernel lever's "no kernel change")."""
    failures = []
    ran = candidate.run.backend
    if case.expected_backend is not None and not runs_backend(ran, case.expected_backend):
        failures.append(f"the recipe says {case.expected_backend} runs on this case; the candidate ran {ran}")
    same_kernel = lever.compares_kernels and ran == default.backend
    if same_kernel:
        differ = [t.tensor for t in candidate.tensors if not t.bitwise_identical]
        if differ:
            failures.append(
                f"candidate and default both ran {ran}, yet differ bitwise on {', '.join(differ)}:"
                " the same kernel on the same inputs must give the same bits"
            )
    return failures, same_kernel


@contextlib.contextmanager
def _cpu_settings(lever: Lever) -> Iterator[None]:
    """For a CPU lever: torch's intra-op threads set to the lever's `cpu_threads` (None: left as
    they are), and denormal floats flushed to zero. Denormals (the tails of softmax's exponentials)
    slow an x86 core's arithmetic up to about 100x on some CPUs; values below 1.2e-38 (FP32) and
    2.2e-308 (FP64) change no figure (the records are identical with and without), and GPU kernels
    commonly flush them too. torch has no getter for the flag, so it is left off (its default)."""
    if lever.device != "cpu":
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


def run_case(lever: Lever, case: Case) -> CaseResult:
    """Run one case of a lever and decide it: "pass", "fail", "no kernel change", or "skip" where
    the case or a backend refuses it."""
    with _cpu_settings(lever):
        return _run_case(lever, case)


def _run_case(lever: Lever, case: Case) -> CaseResult:
    started = time.perf_counter()
    if case.skip_reason:
        return _not_judged(case, started, skip_reason=case.skip_reason)
    device = torch.device(lever.device)

    def judged(path: Path, role: str) -> _Judged:
        return _Judged(runs=_Runs(path=path, device=device, role=role), comparisons=OutputsAccumulator(rule=lever.rule))

    reference = _Runs(path=lever.reference, device=device, role="reference")
    default = _Runs(path=lever.default, device=device, role="default")
    candidate, repeat = judged(lever.candidate, "candidate"), judged(lever.candidate, "candidate (repeat)")
    default_repeat = judged(lever.default, "default (repeat)")
    secondary = [judged(path, "secondary reference") for path in lever.secondary_references]
    applicable = {control.name: control.why_inapplicable(case) for control in lever.controls}
    controls = {
        control.name: judged(control.path, f"control '{control.name}'")
        for control in lever.controls
        if applicable[control.name] is None
    }
    changed: dict[str, None] = {}
    try:
        inputs = case.make_inputs(device)
        for unit in inputs.units if isinstance(inputs, Streamed) else (inputs,):
            first = candidate.runs.run(unit)  # first: a refusal costs nothing else
            reference_out, default_out = reference.run(unit), default.run(unit)
            shared = outputs_baselines(default_out.tensors, reference_out.tensors, candidate.comparisons.offsets())
            second = repeat.runs.run(unit)
            candidate.comparisons.add(first.tensors, default_out.tensors, reference_out.tensors, shared)
            repeat.comparisons.add(second.tensors, default_out.tensors, reference_out.tensors, shared)
            changed.update((n, None) for n in first.tensors if not bitwise_equal(first.tensors[n], second.tensors[n]))
            del second
            for extra in secondary:
                extra.comparisons.add(first.tensors, default_out.tensors, extra.runs.run(unit).tensors)
            del first
            for other in (default_repeat, *controls.values()):
                other.comparisons.add(other.runs.run(unit).tensors, default_out.tensors, reference_out.tensors, shared)
    except PathUnavailable as unavailable:
        return _not_judged(case, started, skip_reason=str(unavailable))
    except _PathError as error:
        return _not_judged(case, started, error=str(error))
    except Exception as error:  # making the inputs, or comparing the outputs
        return _not_judged(case, started, error=f"{type(error).__name__}: {error}")

    control_results = tuple(
        ControlResult(
            name=control.name,
            inapplicable_reason=applicable[control.name],
            judgement=controls[control.name].judgement() if control.name in controls else None,
        )
        for control in lever.controls
    )
    candidate_judgement, repeat_judgement = candidate.judgement(), repeat.judgement()
    default_repeat_judgement = default_repeat.judgement()
    failures = _judgement_failures("candidate", candidate_judgement)
    failures += _judgement_failures("candidate (repeat)", repeat_judgement)
    failures += _judgement_failures("positive control (default repeated)", default_repeat_judgement)
    for control in control_results:
        if control.judgement is not None and control.judgement.passes:
            worst = control.judgement.worst
            failures.append(
                f"negative control '{control.name}' passes the bound on every tensor"
                f" (largest error/bound {worst.error_over_bound:.2f}, {worst.tensor}): no power on this case"
            )
    if all(control.judgement is None for control in control_results):
        failures.append("no negative control applies to this case, so it could not fail")
    kernel_failures, same_kernel = _kernel_failures(lever, case, candidate_judgement, default.record())
    failures += kernel_failures
    result = CaseResult(
        **_identity(case),
        status=FAIL if failures else (NO_KERNEL_CHANGE if same_kernel else PASS),
        skip_reason=None,
        failures=tuple(failures),
        reference=reference.record(),
        default=default.record(),
        candidate=candidate_judgement,
        candidate_repeat=repeat_judgement,
        deterministic=not changed,
        nondeterministic_tensors=tuple(changed),
        default_repeat=default_repeat_judgement,
        controls=control_results,
        secondary=tuple(extra.judgement() for extra in secondary),
        summary={},
        seconds=time.perf_counter() - started,
    )
    return replace(result, summary=dict(lever.summarize(result))) if lever.summarize else result


def lever_summary(lever: Lever) -> dict[str, Any]:
    """The lever's declaration as recorded: names of its paths and controls, and its rule."""
    return {
        "name": lever.name,
        "version": lever.version,
        "tier": lever.tier,
        "record_id": lever.record_id,
        "description": lever.description,
        "device": lever.device,
        "candidate": lever.candidate.name,
        "default": lever.default.name,
        "reference": lever.reference.name,
        "controls": [control.name for control in lever.controls],
        "cases": [case.id for case in lever.cases],
        "optional_cases": [case.id for case in lever.cases if not case.required],
        "compares_kernels": lever.compares_kernels,
        "rule": {"factor": lever.rule.factor, "slack": lever.rule.slack, "reason": lever.rule_reason},
    }


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def build_record(lever: Lever, cases: Iterable[CaseResult], started: str, seconds: float) -> LeverRecord:
    cases = tuple(cases)
    verdict, completeness = assess(
        {case.case_id: case.status for case in cases},
        [case.id for case in lever.cases],
        {case.id for case in lever.cases if not case.required},
    )
    return LeverRecord(
        lever=lever_summary(lever),
        recipe=lever.recipe,
        verdict=verdict,
        completeness=completeness,
        cases=cases,
        provenance=provenance(torch.device(lever.device)),
        started=started,
        finished=_now(),
        seconds=seconds,
    )


def run_lever(lever: Lever) -> LeverRecord:
    """Run every case of a lever and return its record (write it with results.write_record)."""
    started, clock = _now(), time.perf_counter()
    cases = [run_case(lever, case) for case in lever.cases]
    return build_record(lever, cases, started, time.perf_counter() - clock)
