"""A recipe's component-test verdict: what the recipe changed, the levers those changes need, each
judged on the lever records a run wrote, and apart from them, as a catalogue, the levers that ran
though the recipe did not change their flags.

A recipe is judged on what it changed against its reference (fixtures/references/<id>.yaml, or one
given), as `correctness classify` classes it; without a reference, on the numerics arguments it
sets to anything but Megatron's default (correctness.classify.classify_against_defaults). Its
verdict is that of its numerics changes, each covered as `classify` covers it (a format-limited
lever only together with a passing convergence block): `fail` where a needed lever failed,
`incomplete` where one did not run, did not finish, or is format-limited without a passing
convergence run, or where a changed numerics argument has no lever; else `pass`. A lever's verdict
about a flag the recipe did not change is evidence about that flag, never the recipe's verdict.
"""

import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from correctness.classify import (
    COVERED,
    FAILED,
    MEGATRON_DEFAULTS,
    Change,
    Classification,
    Rules,
    classify_against_defaults,
    classify_recipe,
    convergence_passes,
    reference_path,
)
from correctness.entries import format_limited_sentence
from correctness.files import shown_path
from correctness.recipes import Recipe
from correctness.report import TABLE_WIDTH, clip, format_table
from correctness.results import FAIL, FORMAT_LIMITED, INCOMPLETE, PASS, CaseResult, LeverRecord, assess, weakest

NOT_RUN = "not run"  # a needed lever of which no record was written


@dataclass(frozen=True)
class LeverEvidence:
    """One lever's records from a run, for one recipe."""

    lever: str
    flags: tuple[str, ...]  # the recipe's changes that need it ("--flag a -> b"); empty in the catalogue
    tiers: tuple[tuple[str, str], ...]  # (tier, verdict) of each record
    device: tuple[str, ...]  # the device types its records ran on ("cpu", "cuda")
    format: str | None  # the candidate's narrower format, where a record is format-limited
    reasons: tuple[str, ...]  # where no record was written: why its tests skipped
    runs_default: bool = False  # the recipe runs the lever's default side: judged by the rule turned round
    scales: tuple[str, ...] = ()  # the scales its records' cases were built at ("smoke", "recipe")

    @property
    def verdict(self) -> str:
        return weakest([verdict for _, verdict in self.tiers]) if self.tiers else NOT_RUN

    def label(self) -> str:
        """The verdict as a person reads it: `format-limited (BF16)`, `pass (runs the default)`."""
        if self.verdict == FORMAT_LIMITED and self.format:
            return f"{self.verdict} ({self.format})"
        return f"{self.verdict} (runs the default)" if self.runs_default and self.verdict != NOT_RUN else self.verdict

    def evidence(self) -> str:
        if not self.tiers:
            return "; ".join(self.reasons) or "no test of it ran"
        return ", ".join(f"{tier} {verdict}" for tier, verdict in self.tiers)

    def to_dict(self) -> dict[str, Any]:
        return {"lever": self.lever, "verdict": self.verdict, "format": self.format, "flags": list(self.flags),
                "tiers": [{"tier": tier, "verdict": verdict} for tier, verdict in self.tiers],
                "devices": list(self.device), "scales": list(self.scales), "reasons": list(self.reasons),
                "runs_default": self.runs_default}


@dataclass(frozen=True)
class RecipeVerdict:
    recipe: str
    basis: str  # the reference file the changes are against, or MEGATRON_DEFAULTS
    changes: tuple[Change, ...]  # the numerics changes, each lever's result from the run's records
    levers: tuple[LeverEvidence, ...]  # the levers those changes need
    catalogue: tuple[LeverEvidence, ...]  # levers that ran though no change of the recipe needs them
    other_changes: Mapping[str, int]  # changed arguments of the other classes, by class (`correctness classify`)
    convergence_passes: bool

    @property
    def verdict(self) -> str:
        outcomes = {change.outcome for change in self.changes}
        if FAILED in outcomes:
            return FAIL
        return PASS if outcomes <= {COVERED} else INCOMPLETE

    @property
    def on_cpu_only(self) -> bool:
        """Every record of a needed lever ran on a CPU: evidence on another device than the recipe GPU."""
        devices = {device for lever in self.levers for device in lever.device}
        return bool(devices) and devices == {"cpu"}

    @property
    def cpu_scale(self) -> str:
        """The scale of the needed levers' records, as the verdict says it: at the smoke scale, at
        the recipe's scale, or partly at each (--scale recipe where some levers refused it)."""
        scales = {scale for lever in self.levers for scale in lever.scales}
        if scales == {"recipe"}:
            return "at the recipe's scale"
        return "partly at the smoke scale, partly at the recipe's" if "recipe" in scales else "at the smoke scale"

    def to_dict(self) -> dict[str, Any]:
        return {
            "recipe": self.recipe, "verdict": self.verdict, "against": self.basis,
            "changes": [change.to_dict() for change in self.changes],
            "levers": [lever.to_dict() for lever in self.levers],
            "not_changed": [lever.to_dict() for lever in self.catalogue],
            "other_changes": dict(self.other_changes), "convergence_passes": self.convergence_passes,
        }


def recipe_changes(recipe: Recipe, reference: str | Path | None = None, rules: Rules | None = None) -> Classification:
    """The recipe's changes: against the given reference, else its default reference where it has
    one, else its numerics arguments against Megatron's defaults."""
    if reference is None and not reference_path(recipe).is_file():
        return classify_against_defaults(recipe, rules)
    return classify_recipe(recipe, reference, rules)


def needed_levers(classification: Classification) -> dict[str, tuple[str, ...]]:
    """Lever -> the numerics changes that need it, in the order the changes come."""
    needed: dict[str, list[str]] = {}
    for change in classification.of_class("numerics"):
        for lever in change.levers:
            needed.setdefault(lever, []).append(change.text)
    return {lever: tuple(flags) for lever, flags in needed.items()}


def _reversed_passes(case: CaseResult, rule: Mapping[str, Any]) -> bool:
    """The rule the other way round, from the case's own figures: the default's error within
    factor x the candidate's + slack on every tensor (a recipe that runs the lever's default)."""
    return all(math.isfinite(t.default_error) and t.default_error <= rule["factor"] * t.error + rule["slack"]
               for t in case.candidate.tensors)


def for_the_recipe(record: LeverRecord) -> str:
    """The record's verdict as evidence about its recipe's own setting (Case.recipe_runs): a case
    whose candidate the recipe runs counts as it is; one whose default the recipe runs (it reduces
    in FP32 where the lever judges BF16) counts by the rule turned round, the default judged
    against the candidate; one about another setting of the flag does not count. No case of the
    recipe's setting: `not run`."""
    if all(case.recipe_runs == "candidate" for case in record.cases):
        return record.verdict
    statuses = {}
    for case in record.cases:
        if case.recipe_runs == "neither":
            continue
        if case.recipe_runs == "candidate" or case.candidate is None:
            statuses[case.case_id] = case.status
        else:
            statuses[case.case_id] = PASS if _reversed_passes(case, record.lever["rule"]) else FAIL
    if not statuses:
        return NOT_RUN
    # A declared case missing from the record (interrupted, deselected) keeps it incomplete: its side
    # is unknown, so only the cases known to be of another setting are left out of the declaration.
    other = {case.case_id for case in record.cases if case.recipe_runs == "neither"}
    declared = [case_id for case_id in record.lever["cases"] if case_id not in other]
    return assess(statuses, declared, set(record.lever["optional_cases"]))[0]


def tier_label(lever: Mapping[str, Any], provenance: Mapping[str, Any]) -> str:
    """A record's tier (from its `lever` and `provenance`) as the verdict shows it: `h100 (H200
    standing in)` for a stand-in's run, evidence from the same architecture, never the recipe GPU's own."""
    stand_in = provenance.get("stand_in")
    return lever["tier"] if not isinstance(stand_in, Mapping) else f"{lever['tier']} ({stand_in['present']} standing in)"


def _evidence(lever: str, flags: tuple[str, ...], records: list[LeverRecord], reasons: Collection[str]) -> LeverEvidence:
    """A needed lever's records (`flags`: the changes that need it), each judged for the recipe
    (for_the_recipe); a catalogue lever's (no flags), each as its own verdict: evidence about its flag."""
    verdicts = [for_the_recipe(record) if flags else record.verdict for record in records]
    formats = [record.lever["format_floor"]["format"] for record, verdict in zip(records, verdicts)
               if verdict == FORMAT_LIMITED and record.lever.get("format_floor")]
    return LeverEvidence(
        lever=lever, flags=flags,
        tiers=tuple((tier_label(record.lever, record.provenance), verdict) for record, verdict in zip(records, verdicts)),
        runs_default=bool(flags) and any(case.recipe_runs == "default" for record in records for case in record.cases),
        device=tuple(dict.fromkeys(record.provenance["device"]["type"] for record in records)),
        scales=tuple(dict.fromkeys(record.lever.get("scale") or "smoke" for record in records
                                   if record.provenance["device"]["type"] == "cpu")),
        format=formats[0] if formats else None,
        reasons=tuple(dict.fromkeys(reasons)) if not records else (),
    )


def judge_recipe(recipe: Recipe, classification: Classification, records: Iterable[LeverRecord],
                 skip_reasons: Mapping[str, Collection[str]] | None = None) -> RecipeVerdict:
    """The recipe's verdict from a run's records of it (records of other recipes are left out, and
    records made on an emulated GPU count as none: each is named as the reason where its lever has no
    other); `skip_reasons`: lever -> why its tests skipped, for a needed lever of which no record was written."""
    skip_reasons = {lever: list(reasons) for lever, reasons in (skip_reasons or {}).items()}
    by_lever: dict[str, list[LeverRecord]] = {}
    for record in records:
        if record.recipe.id != recipe.id:
            continue
        if record.emulated_gpu is not None:  # code paths, never evidence: said where the lever has no other record
            skip_reasons.setdefault(record.lever["name"], []).append(
                f"{record.lever['tier']}: emulated {record.emulated_gpu} only, not evidence")
            continue
        by_lever.setdefault(record.lever["name"], []).append(record)
    needed = needed_levers(classification)
    levers = tuple(_evidence(lever, flags, by_lever.get(lever, []), skip_reasons.get(lever, ()))
                   for lever, flags in needed.items())
    results = {evidence.lever: evidence.verdict for evidence in levers}
    converged = convergence_passes(recipe)
    changes = tuple(
        replace(change, lever_results={lever: results[lever] for lever in change.levers}, convergence_passes=converged)
        for change in classification.of_class("numerics")
    )
    catalogue = tuple(_evidence(lever, (), found, ()) for lever, found in by_lever.items() if lever not in needed)
    other = {klass: n for klass, n in classification.counts.items() if n and klass != "numerics"}
    return RecipeVerdict(recipe=recipe.id, basis=classification.reference, changes=changes, levers=levers,
                         catalogue=catalogue, other_changes=other, convergence_passes=converged)


def verdict_lines(verdict: RecipeVerdict, gpu: str) -> list[str]:
    """The recipe's verdict, one row per change and the lever it needs, and apart, the catalogue, as
    `correctness run` and the component tests' summary print them (tables within TABLE_WIDTH)."""
    against = "Megatron's defaults (no reference recipe: the numerics arguments it sets otherwise)" \
        if verdict.basis == MEGATRON_DEFAULTS else shown_path(verdict.basis)
    counts = ", ".join([f"{len(verdict.changes)} numerics"]
                       + [f"{n} {klass} (no test needed)" for klass, n in verdict.other_changes.items()])
    lines = [f"recipe {verdict.recipe}: {verdict.verdict.upper()}",
             f"  judged on what it changed against {against}",
             f"  changed: {counts}"]
    evidence = {lever.lever: lever for lever in verdict.levers}
    rows = []
    for change in verdict.changes:
        for lever in change.levers or ("-",):
            found = evidence.get(lever)
            rows.append([clip(change.text, 52), lever, found.label() if found else "no lever",
                         clip(found.evidence(), 40) if found else "needs review"])
    if rows:
        lines += ["  " + line for line in format_table(["change", "lever", "verdict", "evidence"], rows, TABLE_WIDTH - 2)]
    else:
        lines.append("  no numerics argument changed: no component test is needed")
    for lever in verdict.levers:
        if lever.verdict == FORMAT_LIMITED:
            has = "the recipe's passes" if verdict.convergence_passes else "the recipe has none that passes"
            lines.append(f"  {lever.lever}: {format_limited_sentence(lever.format or 'its format')} ({has})")
    for change in verdict.changes:
        if not change.levers:
            lines.append(f"  {change.flag}: no component test covers it; its evidence is a convergence run")
    if verdict.levers and verdict.on_cpu_only:
        lines.append(f"  CPU evidence {verdict.cpu_scale}: the recipe's own verdict (`correctness check`) asks for its {gpu}"
                     " results")
    if verdict.catalogue:
        lines.append("  not changed by this recipe (evidence about each lever's flags, never this recipe's verdict):")
        rows = [[lever.lever, lever.label(), clip(lever.evidence(), 60)] for lever in verdict.catalogue]
        lines += ["    " + line for line in format_table(["lever", "verdict", "tiers"], rows, TABLE_WIDTH - 4)]
    return lines
