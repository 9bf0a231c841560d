"""Words for a recipe's correctness.component_tests entry, made from a lever record's figures.

The entry's fields are those of the seed recipes: test, shape, gpu, date, result, detail, note.
Levers of this project may word `shape`, `detail` and `note` in their own module of
correctness.wording (named by their spec); any other lever gets the generic sentences here, built from the same figures of the typed record.
"""

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

from correctness.comparisons import TensorComparison
from correctness.results import FAIL, FORMAT_LIMITED, SKIP, CaseResult, LeverRecord, over_bound
from correctness.tiers import StandIn

NUMBER_WORDS = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight", 9: "nine"}


def count(n: int) -> str:
    """Small counts in words, as the recipes write them."""
    return NUMBER_WORDS.get(n, f"{n:,}")


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """A count of a noun, singular for one: "one case", "two cases", "1,024 steps"."""
    return f"{count(n)} {noun if n == 1 else plural or noun + 's'}"


def sci(x: float) -> str:
    """1.62e-2 (three significant figures, no padded exponent)."""
    if x == 0:
        return "0"
    mantissa, exponent = f"{x:.2e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def compact(x: float) -> str:
    """1e-3 for 0.001, else as sci()."""
    mantissa, exponent = f"{x:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}" if float(f"{mantissa}e{exponent}") == x else sci(x)


def and_list(items: Iterable[str]) -> str:
    """a, b and c."""
    items = list(items)
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def format_limited_sentence(format_name: str) -> str:
    """How a format-limited result is worded everywhere (entries, verdict tables, recipe verdicts)."""
    return (f"as accurate as {format_name} allows; no {format_name} implementation meets the rule;"
            " evidence: a convergence run")


def ratio_range(ratios: Iterable[float]) -> str:
    """0.08-0.18: the smallest and largest of some ratios, to two places (one figure where they agree)."""
    values = sorted(ratios)
    if not values:
        return "-"
    low, high = f"{values[0]:.2f}", f"{values[-1]:.2f}"
    return low if low == high else f"{low}-{high}"


def errors_sentence(record: LeverRecord) -> str:
    """The cases that failed with an error before they could be judged, with the error."""
    errored = [case for case in record.cases if case.status == FAIL and case.candidate is None]
    return "; ".join(f"case {case.case_id} failed: {case.failures[0]}" for case in errored)


def candidate_tensors(record: LeverRecord, cases=None) -> list[tuple[CaseResult, TensorComparison]]:
    return [(case, t) for case in (cases or record.ran_cases()) for t in case.candidate.tensors]


def worst_tensor(record: LeverRecord, cases=None) -> tuple[CaseResult, TensorComparison]:
    """(case, tensor) nearest to its bound; a tensor with no figure (NaN) counts as the worst."""
    return max(candidate_tensors(record, cases), key=lambda ct: over_bound(ct[1]))


def bound_sentence(tensor: TensorComparison, rule: Mapping[str, Any]) -> str:
    same = ", the same error as the default's" if tensor.error == tensor.default_error else ""
    return (
        f"{sci(tensor.error)} against a bound of {sci(tensor.bound)},"
        f" {rule['factor']:g} x the default's error + {compact(rule['slack'])}{same}"
    )


def controls_sentence(record: LeverRecord) -> str:
    """The controls that ran on some case, whether they fail, and those that applied to no case
    (a window control on a model without windows): never counted as failing."""
    applied = [control for case in record.ran_cases() for control in case.controls if control.judgement is not None]
    names = [name for name in record.lever["controls"] if any(control.name == name for control in applied)]
    unused = [name for name in record.lever["controls"] if name not in names]
    failing = all(control.fails for control in applied)
    powers = [control.power for control in applied if control.fails_bound]
    least = f", by {min(powers):.1f} x the bound at the least" if powers and failing else ""
    unrepeatable = [name for name in names if all(control.fails_repeatability and not control.fails_bound
                                                  for control in applied if control.name == name)]
    if unrepeatable and failing:
        runs = max(case.runs for case in record.ran_cases())
        least += f" ({and_list(unrepeatable)}: inside the bound, not bitwise repeatable over {runs} runs)"
    if len(names) == 1:
        what, verb = "negative control", "fails" if failing else "does not fail"
    else:
        what, verb = "negative controls", "fail" if failing else "do not all fail"
    sentence = f"a repeat of the default passes and the {count(len(names))} {what} ({and_list(names)}) {verb}{least}"
    if unused:
        sentence += f" ({and_list(unused)}: no case here they apply to)"
    return sentence


def evidence_sentence(record: LeverRecord) -> str:
    """What was judged beyond the whole tensors: slices, invariants, systematic error."""
    lever, cases = record.lever, record.ran_cases()
    parts = []
    sliced = [(case, t) for case, t in candidate_tensors(record) if t.slices is not None]
    if lever.get("slicing") and sliced:
        case, worst = max(sliced, key=lambda ct: over_bound(ct[1].slices))
        parts.append(
            f"judged {lever['slicing']} as well, worst slice {worst.slices.error_over_bound:.2f} x its bound"
            f" ({worst.tensor}, {worst.slices.worst}, {case.case_id})"
        )
    if lever.get("invariants"):
        names = lever["invariants"]
        parts.append(f"the invariant{'s' if len(names) > 1 else ''} ({and_list(names)}) held on every run")
    flagged = sorted({t for case in cases for t in case.systematic})
    if flagged:
        shown = ", ".join(flagged[:3]) + (f" and {len(flagged) - 3} more" if len(flagged) > 3 else "")
        parts.append(f"systematic error (scale slope or offset) flagged on {shown}")
    else:
        parts.append("no systematic error (scale slope or offset) flagged")
    return "; ".join(parts)


def determinism_sentence(record: LeverRecord) -> str:
    changed = sorted({t for case in record.ran_cases() for t in case.nondeterministic_tensors})
    runs = max((case.runs for case in record.ran_cases()), default=2)
    if not changed:
        return "the candidate gives the same bits on a second run" if runs <= 2 else \
            f"the candidate gives the same bits on each of {runs} runs"
    return f"the candidate's {', '.join(changed)} changed between {'two' if runs <= 2 else runs} identical runs"


def skipped_sentence(record: LeverRecord) -> str:
    reasons: dict[str, int] = {}
    for case in record.cases:
        if case.status == SKIP:
            reasons[case.skip_reason] = reasons.get(case.skip_reason, 0) + 1
    return "; ".join(f"{counted(n, 'case')} skipped: {reason}" for reason, n in reasons.items())


def format_sentence(record: LeverRecord) -> str:
    """For a record with format-limited cases: what its format allows, the candidate against that
    floor, and the controls against the same bound; empty otherwise."""
    limited = [case for case in record.ran_cases() if case.status == FORMAT_LIMITED and case.format is not None]
    if not limited:
        return ""
    name = limited[0].format.format
    floors = [t.error for case in limited for t in case.format.floor.tensors]
    worst = max((t for case in limited for t in case.format.candidate.tensors), key=over_bound)
    powers = [control.power for case in limited for control in case.format.controls]
    controls = f"; every negative control outside that bound, by {min(powers):.1f} x at the least" if powers else ""
    return (
        f"{format_limited_sentence(name)}: on {count(len(limited))} of {counted(len(record.ran_cases()), 'case')} the"
        f" candidate fails the rule, as the {name} format floor (the FP64 result through {and_list(limited[0].format.roundings)})"
        f" does, its error {sci(min(floors))}-{sci(max(floors))}; the candidate stays within"
        f" {record.lever['rule']['factor']:g} x the floor + {compact(record.lever['rule']['slack'])}, worst"
        f" {worst.error_over_bound:.2f} of it ({worst.tensor}), with no bias beyond the floor's rounding{controls}"
    )


CPU_LABEL = "CPU"  # an entry's gpu for a CPU tier's record (correctness.classify reads it as CPU evidence)


def stand_in_of(record: LeverRecord) -> StandIn | None:
    """The GPU that stood in for the recipe's GPU in the record's run (its provenance's
    `stand_in`), where one did."""
    found = record.provenance.get("stand_in")
    return StandIn(present=found["present"], recipe=found["recipe"]) if isinstance(found, dict) else None


def stand_in_label(gpu: object) -> StandIn | None:
    """The stand-in an entry's gpu names ("H200 (standing in for H100)", as gpu_label writes it)."""
    found = re.fullmatch(r"(\S+) \(standing in for (\S+)\)", gpu) if isinstance(gpu, str) else None
    return StandIn(present=found.group(1), recipe=found.group(2)) if found else None


def gpu_label(record: LeverRecord) -> str:
    """The entry's gpu: the recipe GPU's model, or `CPU`, or `CPU (<tier>)` for a CPU tier other than
    the plain one, so that two CPU tiers of one lever are two entries; for a stand-in's run, `H200
    (standing in for H100)`, never the recipe GPU's name alone (correctness.check shows it as stand-in)."""
    device = record.provenance["device"]
    if device["type"] != "cuda":
        tier = record.lever["tier"]
        return CPU_LABEL if tier == "cpu" else f"{CPU_LABEL} ({tier})"
    stand_in = stand_in_of(record)
    if stand_in is not None:
        return stand_in.label()
    from correctness.provenance import gpu_type  # imports torch: only where a record's GPU is worded

    return gpu_type(device.get("name")) or device.get("name") or "unknown GPU"


def where_sentence(record: LeverRecord) -> str:
    provenance = record.provenance
    device = provenance["device"]
    packages = ", ".join(f"{name} {version}" for name, version in provenance["packages"].items() if version)
    tier = record.lever["tier"]
    scales = sorted({case.shape.get("scale") for case in record.cases} - {None})
    scale = f" at the {' and '.join(scales)} scale" if scales else ""
    tier_text = "the CPU tier" if tier == "cpu" else f"the {tier} tier"
    stand_in = stand_in_of(record)
    return (
        f"run on {tier_text}{scale} ({device.get('name')}, torch {provenance['torch']}"
        + (f", {packages}" if packages else "")
        + f"), record {record.lever['record_id']}"
        + (f"; {stand_in.sentence()}" if stand_in is not None else "")
    )


def generic_text(record: LeverRecord) -> dict[str, str]:
    cases = record.ran_cases()
    shapes = sorted({c.shape.get("id", c.case_id) for c in record.cases})
    shape = f"{record.recipe.model}: {counted(len(cases), 'case')} run, at " + "; ".join(shapes)
    skipped = skipped_sentence(record)
    note = where_sentence(record) + (f"; {skipped}" if skipped else "")
    if not cases:  # every case failed before its judgement: the entry's detail is the errors
        return {"shape": shape, "detail": "", "note": note}
    case, worst = worst_tensor(record)
    ratios = [t.ratio for _, t in candidate_tensors(record) if t.ratio is not None and not math.isnan(t.ratio)]
    backends = sorted({c.candidate.run.backend for c in cases})
    detail = (
        f"{record.lever['candidate']} ran as {', '.join(backends)}; its relative L2 error against FP64 is"
        f" {ratio_range(ratios)} x the default's ({record.lever['default']}) (worst tensor, {worst.tensor}"
        f" in {case.case_id}, {bound_sentence(worst, record.lever['rule'])}); {evidence_sentence(record)};"
        f" {determinism_sentence(record)}; {controls_sentence(record)}"
    )
    return {"shape": shape, "detail": detail, "note": note}
