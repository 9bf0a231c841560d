"""Runs a declared lever: every path on a case's inputs, comparisons, verdict, record.

For each case: the FP64 reference, the default, the candidate twice (both judged; bitwise
equality of the two is reported as determinism), the default again as a positive control (it must
pass), and every applicable negative control (each must fail). A case with no applicable control
fails: it would have no power. Streamed inputs run unit by unit, every path on each unit, so only
one unit's outputs are alive at a time.
"""

import datetime
import time
from dataclasses import dataclass, field, replace
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from correctness.compare import OutputsAccumulator, bitwise_equal, outputs_baselines
from correctness.errors import PathUnavailable
from correctness.lever import Case, Lever, Path, PathOutput, Streamed
from correctness.provenance import provenance
from correctness.results import (
    CaseResult,
    ControlResult,
    Judgement,
    LeverRecord,
    PathRun,
    lever_verdict,
)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize(device)


@dataclass
class _Runs:
    """One path's runs over a case's units: what ran, and for how long in all."""

    path: Path
    device: torch.device
    seconds: float = 0.0
    backends: dict[str, None] = field(default_factory=dict)  # insertion-ordered set
    details: dict[str, Any] = field(default_factory=dict)

    def run(self, inputs: Any) -> PathOutput:
        _synchronize(self.device)
        start = time.perf_counter()
        output = self.path.run(inputs)
        _synchronize(self.device)
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
    }


def _skipped(case: Case, reason: str, started: float) -> CaseResult:
    return CaseResult(
        **_identity(case),
        status="skip",
        skip_reason=reason,
        failures=(),
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


def run_case(lever: Lever, case: Case) -> CaseResult:
    """Run one case of a lever and decide it. Skips (status "skip") where the case or a path says so."""
    started = time.perf_counter()
    if case.skip_reason:
        return _skipped(case, case.skip_reason, started)
    device = torch.device(lever.device)

    def judged(path: Path) -> _Judged:
        return _Judged(runs=_Runs(path=path, device=device), comparisons=OutputsAccumulator(rule=lever.rule))

    reference, default = _Runs(path=lever.reference, device=device), _Runs(path=lever.default, device=device)
    candidate, repeat, default_repeat = judged(lever.candidate), judged(lever.candidate), judged(lever.default)
    secondary = [judged(path) for path in lever.secondary_references]
    applicable = {control.name: control.why_inapplicable(case) for control in lever.controls}
    controls = {control.name: judged(control.path) for control in lever.controls if applicable[control.name] is None}
    changed: dict[str, None] = {}
    try:
        inputs = case.make_inputs(device)
        for unit in inputs.units if isinstance(inputs, Streamed) else (inputs,):
            reference_out, default_out = reference.run(unit), default.run(unit)
            shared = outputs_baselines(default_out.tensors, reference_out.tensors, candidate.comparisons.offsets())
            first, second = candidate.runs.run(unit), repeat.runs.run(unit)
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
        return _skipped(case, str(unavailable), started)

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
    result = CaseResult(
        **_identity(case),
        status="fail" if failures else "pass",
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
        "rule": {"factor": lever.rule.factor, "slack": lever.rule.slack, "reason": lever.rule_reason},
    }


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def build_record(lever: Lever, cases: Iterable[CaseResult], started: str, seconds: float) -> LeverRecord:
    cases = tuple(cases)
    return LeverRecord(
        lever=lever_summary(lever),
        recipe=lever.recipe,
        verdict=lever_verdict(cases),
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
