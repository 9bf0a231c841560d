"""A record's figures recomputed from its measurements: what a reader holds a record to.

A record states figures that follow from others: a tensor's bound, ratio, margin, error over bound
and whether it passes (from its error, the default's, its slices and the rule:
correctness.compare.judged_figures), a slice summary's worst error over bound and whether any slice
fails, a systematic figure's flag, and the sha256 of the recipe arguments its lever read.
`recomputed(record)` gives the record with each such figure as its measurements give it, so that
results.stated_fields_disagree can name the first one a hand edit changed (an error of 3.94e-2
beside a bound of 7.89e-3 and `passes: true`). The lever's rule is read from the record, so it is
held to the suite's: never looser than the default rule (`rule_problem`).

Figures made in floating point are compared to a relative 1e-9 (a slice's bound is computed on
tensors, a record's in Python); flags and counts exactly.
"""

import dataclasses
import hashlib
import json
import math
from collections.abc import Mapping
from typing import Any

from correctness.compare import (
    SliceComparison, Systematic, TensorComparison, judged_figures, over_bound_ratio, systematic_flagged,
)
from correctness.lever import runs_backend
from correctness.results import (
    FORMAT_LIMITED, NO_KERNEL_CHANGE, RAN, SKIP, CaseResult, FormatControl, FormatResult, Judgement, LeverRecord,
)
from correctness.rule import DEFAULT_FACTOR, DEFAULT_SLACK, Rule

RELATIVE = 1e-9


def arguments_sha256(arguments: Mapping[str, Any]) -> str:
    """The sha256 of a record's recipe arguments (name -> value), as canonical JSON."""
    return hashlib.sha256(json.dumps(dict(arguments), sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def record_rule(lever: Mapping[str, Any]) -> Rule:
    """The rule a record's lever states (ValueError where it is not a rule)."""
    stated = lever["rule"]
    return Rule(**{name: stated[name] for name in ("factor", "slack", "systematic_factor", "systematic_floor_eps",
                                                    "systematic_noise_sigmas", "runs", "bitwise_repeatable")})


def rule_problem(lever: Mapping[str, Any]) -> str | None:
    """Why a record's rule is not one the suite judges by: not a rule, or a bound looser than the
    default rule's (DEFAULT_FACTOR x default + DEFAULT_SLACK); None where it is."""
    try:
        rule = record_rule(lever)
    except (ValueError, TypeError, KeyError) as error:
        return f"its rule is not a rule ({error})"
    if rule.factor > DEFAULT_FACTOR or rule.slack > DEFAULT_SLACK:
        return (f"its rule ({rule.factor:g} x default + {rule.slack:g}) is looser than the suite's"
                f" ({DEFAULT_FACTOR:g} x default + {DEFAULT_SLACK:g})")
    return None


def _agree(stated: Any, derived: Any) -> bool:
    """Whether two figures are the same: floats to RELATIVE (NaN agreeing with NaN), others exactly."""
    if isinstance(stated, float) and isinstance(derived, float):
        if stated == derived or (math.isnan(stated) and math.isnan(derived)):
            return True
        return (math.isfinite(stated) and math.isfinite(derived)
                and abs(stated - derived) <= RELATIVE * max(abs(stated), abs(derived)))
    return stated == derived


def _same(stated: Any, derived: Any) -> Any:
    """The stated figure where the derived one agrees with it (to RELATIVE for floats), else the derived."""
    return stated if _agree(stated, derived) else derived


def _agreeing(value: Any, **derived: Any) -> Any:
    return dataclasses.replace(value, **{name: _same(getattr(value, name), figure) for name, figure in derived.items()})


def _systematic(figures: Systematic) -> Systematic:
    return _agreeing(figures, flagged=systematic_flagged(figures.slope, figures.slope_threshold, figures.offset,
                                                         figures.offset_threshold))


def _slices(slices: SliceComparison | None, rule: Rule) -> SliceComparison | None:
    """A slice summary's worst slice held to the rule: its bound and error over bound, whether any
    slice fails (the worst one does), and whether any is flagged systematic (the worst by it is)."""
    if slices is None:
        return None
    bound = _same(slices.bound, rule.bound(slices.default_error))
    over = over_bound_ratio(slices.error, bound)
    over = _same(slices.error_over_bound, math.inf if math.isnan(over) else over)
    systematic = _systematic(slices.systematic)
    failing = slices.failing if (slices.failing > 0) == (over > 1.0) else (1 if over > 1.0 else 0)
    flagged = (slices.systematic_flagged if (slices.systematic_flagged > 0) == systematic.flagged
               else int(systematic.flagged))
    return dataclasses.replace(slices, bound=bound, error_over_bound=over, failing=failing,
                               systematic_flagged=flagged, systematic=systematic)


def _tensor(t: TensorComparison, rule: Rule) -> TensorComparison:
    slices = _slices(t.slices, rule)
    figures = judged_figures(rule, t.error, t.default_error, slices, t.nonfinite)
    return _agreeing(dataclasses.replace(t, slices=slices, systematic=_systematic(t.systematic)), **figures)


def _judgement(judgement: Judgement | None, rule: Rule) -> Judgement | None:
    if judgement is None:
        return None
    return dataclasses.replace(judgement, tensors=tuple(_tensor(t, rule) for t in judgement.tensors))


def _against(judgement: Judgement | None, floor: Judgement) -> Judgement | None:
    """A judgement against the format floor with the floor's own figures in the default's place: its
    error per tensor, and the slope and offset of its error."""
    if judgement is None:
        return None
    figures = {t.tensor: t for t in floor.tensors}

    def held(t: TensorComparison) -> TensorComparison:
        own = figures.get(t.tensor)
        if own is None:
            return t
        systematic = _agreeing(t.systematic, default_slope=own.systematic.slope, default_offset=own.systematic.offset)
        return _agreeing(dataclasses.replace(t, systematic=systematic), default_error=own.error)

    return dataclasses.replace(judgement, tensors=tuple(held(t) for t in judgement.tensors))


def _format(result: FormatResult | None, rule: Rule) -> FormatResult | None:
    """The format figures recomputed whole: the floor judged under the rule; the candidate's runs and
    the controls against the floor's own error and slopes; the tensors biased beyond the floor from
    the candidate's recomputed systematic flags."""
    if result is None:
        return None
    floor = _judgement(result.floor, rule)
    candidate = _judgement(_against(result.candidate, floor), rule)
    biased = tuple(t.tensor for t in candidate.tensors if t.systematic_flagged)
    return dataclasses.replace(
        result, floor=floor, candidate=candidate,
        candidate_repeat=_judgement(_against(result.candidate_repeat, floor), rule),
        controls=tuple(FormatControl(name=c.name, judgement=_judgement(_against(c.judgement, floor), rule))
                       for c in result.controls),
        systematic=biased if set(biased) != set(result.systematic) else result.systematic,
    )


def _case(case: CaseResult, rule: Rule) -> CaseResult:
    return dataclasses.replace(
        case,
        candidate=_judgement(case.candidate, rule),
        candidate_repeat=_judgement(case.candidate_repeat, rule),
        default_repeat=_judgement(case.default_repeat, rule),
        controls=tuple(dataclasses.replace(c, judgement=_judgement(c.judgement, rule)) for c in case.controls),
        secondary=tuple(_judgement(j, rule) for j in case.secondary),
        format=_format(case.format, rule),
    )


def recomputed(record: LeverRecord) -> LeverRecord:
    """The record with every figure that follows from its measurements recomputed (see the module's
    docstring). ValueError where its rule is not a rule."""
    rule = record_rule(record.lever)
    recipe = record.recipe
    if recipe.arguments_sha256 is not None or recipe.arguments:
        recipe = dataclasses.replace(recipe, arguments_sha256=arguments_sha256(recipe.arguments))
    verdict, completeness = record.assessment()
    return dataclasses.replace(record, recipe=recipe, cases=tuple(_case(case, rule) for case in record.cases),
                               verdict=verdict, completeness=completeness)


def case_problems(case: CaseResult, lever: Mapping[str, Any]) -> list[str]:
    """Where a case's status says other than its figures: a case that held (pass, no kernel change,
    format-limited) must have a candidate within the rule (or, format-limited, within its format's
    bound with the floor failing the rule too), a repeat and a positive control within it, every
    applicable control failing and at least one applying, the backend the recipe claims, no
    failure stated, and bitwise repeatable runs where the rule asks; "no kernel change" only where
    the lever compares kernels and both sides ran one; a failed case must say why; a skipped one
    must not have been judged."""
    where = f"case {case.case_id}"
    if case.status == SKIP:
        return [f"{where} is skipped while it has a judgement"] if case.candidate is not None else []
    if case.status not in RAN:
        return [] if case.failures else [f"{where} fails without saying why"]
    if case.candidate is None or case.default is None:
        return [f"{where} is {case.status} without a judgement"]
    problems = [f"{where} is {case.status} while it states failures: {case.failures[0]}"] if case.failures else []
    problems += [f"{where} passes while its control '{control.name}' passed"
                 for control in case.controls if control.judgement is not None and not control.fails]
    if all(control.judgement is None for control in case.controls):
        problems.append(f"{where} is {case.status} while no negative control applies to it")
    if case.default_repeat is not None and not case.default_repeat.passes:
        problems.append(f"{where} is {case.status} while its positive control (the default repeated) fails the rule")
    rule = lever["rule"]
    if rule.get("bitwise_repeatable") and case.candidate_spread:
        problems.append(f"{where} is {case.status} while its candidate is not bitwise repeatable where its rule asks")
    ran = case.candidate.run.backend
    if case.expected_backend is not None and not runs_backend(ran, case.expected_backend):
        problems.append(f"{where} is {case.status} while its candidate ran {ran}, not the recipe's {case.expected_backend}")
    same_kernel = bool(lever.get("compares_kernels")) and ran == case.default.backend
    if (case.status == NO_KERNEL_CHANGE) != same_kernel and case.status != FORMAT_LIMITED:
        problems.append(f"{where} is {case.status} while its candidate ran {ran} and its default {case.default.backend}"
                        + (" (the lever compares no kernels)" if not lever.get("compares_kernels") else ""))
    return problems + _default_problems(case) + _format_control_problems(case) + _candidate_problems(case)


def _default_problems(case: CaseResult) -> list[str]:
    """Where a case states more than one figure of its default for a tensor: every judgement of the
    case (the candidate's runs, the default's repeat, the controls) holds its tensors to the one run
    of the default, so each tensor has one default error, slope and offset."""
    judgements = [("the candidate", case.candidate), ("the candidate's repeat", case.candidate_repeat),
                  ("the default's repeat", case.default_repeat),
                  *((f"control '{c.name}'", c.judgement) for c in case.controls)]
    first: dict[str, tuple[str, tuple[float, float, float]]] = {}
    for role, judgement in judgements:
        for t in judgement.tensors if judgement is not None else ():
            figures = (t.default_error, t.systematic.default_slope, t.systematic.default_offset)
            seen_role, seen = first.setdefault(t.tensor, (role, figures))
            differs = next((i for i, (a, b) in enumerate(zip(seen, figures)) if not _agree(a, b)), None)
            if differs is not None:
                name = ("error", "slope", "offset")[differs]
                return [f"case {case.case_id} states two default {name}s for {t.tensor}: {seen[differs]:.6g} in"
                        f" {seen_role}, {figures[differs]:.6g} in {role} (the default ran once)"]
    return []


def _format_control_problems(case: CaseResult) -> list[str]:
    """Where a case's format figures lack a control that applies to it: each is judged against the
    format bound too, so that a format-limited case keeps the power the rule's controls give it."""
    if case.format is None:
        return []
    judged = [control.name for control in case.controls if control.judgement is not None]
    stated = [control.name for control in case.format.controls]
    lacking = [name for name in judged if name not in stated]
    if lacking:
        return [f"case {case.case_id} has no format figures for its control '{lacking[0]}', which applies to it"]
    extra = [name for name in stated if name not in judged]
    if extra or len(stated) != len(judged):
        return [f"case {case.case_id} states format figures for controls {stated}, not for those that applied {judged}"]
    return []


def _candidate_problems(case: CaseResult) -> list[str]:
    """Where a case that held says otherwise of its candidate: a passing case whose candidate (or its
    repeat) fails the rule, or a format-limited one whose candidate or controls are not as its
    format allows."""
    judged = [case.candidate] + ([case.candidate_repeat] if case.candidate_repeat is not None else [])
    failing = list(dict.fromkeys(t.tensor for judgement in judged for t in judgement.tensors if not t.passes))
    if case.status != FORMAT_LIMITED:
        return [f"case {case.case_id} passes while its candidate fails on {failing}"] if failing else []
    limited = case.format
    if limited is None or not failing:
        return [f"case {case.case_id} is format-limited while its candidate "
                + ("has no format figures" if limited is None else "passes the rule")]
    problems = []
    against_floor = [limited.candidate] + ([limited.candidate_repeat] if limited.candidate_repeat is not None else [])
    beyond = list(dict.fromkeys(t.tensor for judgement in against_floor for t in judgement.tensors if not t.passes))
    if beyond:
        problems.append(f"case {case.case_id} is format-limited while its candidate is outside the format bound on {beyond}")
    floor_passes = sorted(set(failing) - set(limited.floor_fails_rule))
    if floor_passes:
        problems.append(f"case {case.case_id} is format-limited while its {limited.format} floor passes the rule on {floor_passes}")
    problems += [f"case {case.case_id} is format-limited while its control '{control.name}' is within the format bound"
                 for control in limited.controls if not control.fails]
    if limited.systematic:
        problems.append(f"case {case.case_id} is format-limited while its candidate is biased beyond the floor on"
                        f" {list(limited.systematic)}")
    return problems
