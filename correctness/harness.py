"""Runs a declared lever: every path on a case's inputs, comparisons, verdict, record.

For each case: the FP64 reference, the default, the candidate twice (both judged; bitwise
equality of the two is reported as determinism), the default again as a positive control (it must
pass), and every applicable negative control (each must fail). A case with no applicable control
fails: it would have no power.
"""

import datetime
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from correctness.compare import bitwise_equal, compare_outputs
from correctness.errors import PathUnavailable
from correctness.lever import Case, Lever, Path, PathOutput
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
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run_path(path: Path, inputs: Any, device: torch.device) -> tuple[PathOutput, PathRun]:
    _synchronize(device)
    start = time.perf_counter()
    output = path.run(inputs)
    _synchronize(device)
    seconds = time.perf_counter() - start
    return output, PathRun(path=path.name, backend=output.backend, details=dict(output.details), seconds=seconds)


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
    try:
        inputs = case.make_inputs(device)
        reference, reference_run = _run_path(lever.reference, inputs, device)
        default, default_run = _run_path(lever.default, inputs, device)

        def judge(path: Path) -> tuple[PathOutput, Judgement]:
            output, run = _run_path(path, inputs, device)
            comparisons = compare_outputs(output.tensors, default.tensors, reference.tensors, lever.rule)
            return output, Judgement(run=run, tensors=comparisons)

        candidate_output, candidate = judge(lever.candidate)
        repeat_output, candidate_repeat = judge(lever.candidate)
        changed = tuple(
            name
            for name in candidate_output.tensors
            if not bitwise_equal(candidate_output.tensors[name], repeat_output.tensors[name])
        )
        del candidate_output, repeat_output
        _, default_repeat = judge(lever.default)
        controls = []
        for control in lever.controls:
            reason = control.why_inapplicable(case)
            judgement = None if reason else judge(control.path)[1]
            controls.append(ControlResult(name=control.name, inapplicable_reason=reason, judgement=judgement))
    except PathUnavailable as unavailable:
        return _skipped(case, str(unavailable), started)

    failures = _judgement_failures("candidate", candidate)
    failures += _judgement_failures("candidate (repeat)", candidate_repeat)
    failures += _judgement_failures("positive control (default repeated)", default_repeat)
    for control in controls:
        if control.judgement is not None and control.judgement.passes:
            worst = control.judgement.worst
            failures.append(
                f"negative control '{control.name}' passes the bound on every tensor"
                f" (largest error/bound {worst.error_over_bound:.2f}, {worst.tensor}): no power on this case"
            )
    if all(control.judgement is None for control in controls):
        failures.append("no negative control applies to this case, so it could not fail")
    return CaseResult(
        **_identity(case),
        status="fail" if failures else "pass",
        skip_reason=None,
        failures=tuple(failures),
        reference=reference_run,
        default=default_run,
        candidate=candidate,
        candidate_repeat=candidate_repeat,
        deterministic=not changed,
        nondeterministic_tensors=changed,
        default_repeat=default_repeat,
        controls=tuple(controls),
        seconds=time.perf_counter() - started,
    )


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
