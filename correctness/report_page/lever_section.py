"""One lever record's section of the report: what it is (verdict, evidence class, tier, the
backends each path ran, invariants, failures), its figures, and its cases in a compact table."""

import math
import re

from correctness.evidence import MEANINGS
from correctness.recipe_verdict import for_the_recipe
from correctness.registry import known_lever
from correctness.report_page.figures import err_bound_figure, systematic_figure
from correctness.report_page.header import RecipeJudgement
from correctness.report_page.heatmap import heatmap_figure, sliced_tensors
from correctness.report_page.markup import RecordLink, json_pointer, table, tag
from correctness.report_page.optimizer import is_optimizer_record, optimizer_figure
from correctness.report_page.records import LoadedRecord
from correctness.report_page.svg import escape, figure_value
from correctness.results import (FORMAT_LIMITED, INVARIANT, CaseResult, Judgement, LeverRecord, emulated_sentence,
                                 over_bound)

MAX_FAILURES = 12  # failure lines listed; the rest are counted


def section_id(record: LeverRecord) -> str:
    return "lever-" + re.sub(r"[^A-Za-z0-9_-]+", "-", record.lever["record_id"]).strip("-")


def evidence_class(name: str) -> str:
    spec = known_lever(name)
    return spec.evidence.klass if spec is not None else "not declared"


def _backends(record: LeverRecord) -> str:
    """Each path's name and the backends it ran over the record's cases."""
    runs = {"reference": [], "default": [], "candidate": []}
    for case in record.ran_cases():
        runs["reference"].append(case.reference.backend if case.reference else None)
        runs["default"].append(case.default.backend if case.default else None)
        runs["candidate"].append(case.candidate.run.backend)
    items = []
    for role, backends in runs.items():
        distinct = [str(backend) for backend in dict.fromkeys(backends) if backend]
        if len(distinct) > 1:  # one per case kind (the fp8 lever's scaling recipes)
            shown = tag("ul", "".join(tag("li", escape(backend)) for backend in distinct))
        else:
            shown = escape(distinct[0]) if distinct else "-"
        items.append(tag("li", f"<b>{role}</b> {escape(record.lever[role])}: {shown}"))
    return tag("ul", "".join(items), class_="plain")


def _for_recipe(record: LeverRecord, judgement: RecipeJudgement) -> str:
    if record.emulated_gpu is not None:
        return f"none: {emulated_sentence(record.emulated_gpu).removeprefix('it was ')}"
    if judgement.judged is None:
        return "not judged (see the header)"
    if record.lever["name"] in {lever.lever for lever in judgement.judged.levers}:
        return f"needed by a change of the recipe; for the recipe's own setting: {for_the_recipe(record)}"
    return "not needed by any change of the recipe: evidence about its flags, never the recipe's verdict"


def _invariants(record: LeverRecord) -> str:
    names = record.lever.get("invariants") or []
    if not names:
        return "none declared"
    broken = [failure for case in record.cases for failure in case.failures if failure.kind == INVARIANT]
    held = "broken: " + "; ".join(broken[:3]) if broken else f"held on every run of the {len(record.ran_cases())} cases"
    return f"{'; '.join(names)} ({held})"


def _facts(loaded: LoadedRecord, link: RecordLink, judgement: RecipeJudgement) -> str:
    record = loaded.record
    lever, completeness = record.lever, record.completeness
    klass = evidence_class(lever["name"])
    rule = lever["rule"]
    floor = lever.get("format_floor")
    rows = [
        ("verdict", escape(record.verdict) + (" (interrupted run)" if record.interrupted else "")),
        ("for the recipe", escape(_for_recipe(record, judgement))),
        ("evidence class", escape(klass + (f": {MEANINGS[klass]}" if klass in MEANINGS else ""))),
        ("tier, device", escape(f"{lever['tier']}, {lever['device']}"
                                + (f" (an emulated {record.emulated_gpu}, on the CPU)" if record.emulated_gpu else ""))),
        ("what it compares", escape(lever["description"])),
        ("backends each path ran", _backends(record)),
        ("rule", escape(f"err <= {rule['factor']:g} x default err + {rule['slack']:g}; {rule['runs']} runs each"
                        + (f"; reason: {rule['reason']}" if rule.get("reason") else ""))),
        ("slices", escape(lever.get("slicing") or "whole tensors only")),
        ("invariants", escape(_invariants(record))),
        ("format floor", escape(f"{floor['format']}: " + "; ".join(floor["roundings"]) if floor else "none")),
        ("cases", escape(f"{completeness.ran} of {completeness.declared} ran"
                         + (f"; missing: {', '.join(completeness.missing)}" if completeness.missing else ""))),
        ("record", link.anchor("", link.file, class_="record")),
    ]
    return table(["", ""], [[escape(name), value] for name, value in rows], class_="facts")


def _worst_cell(judgement: Judgement | None) -> str:
    if judgement is None:
        return "-"
    worst = judgement.worst
    return f"{figure_value(over_bound(worst))} ({worst.tensor})"


def _controls_cell(case: CaseResult) -> str:
    """How the applicable controls did: against the format bound for a format-limited case (the
    bound that case is held to), else against the rule."""
    limited = case.status == FORMAT_LIMITED and case.format is not None
    applied = list(case.format.controls) if limited else [c for c in case.controls if c.judgement is not None]
    if not applied:
        return "none applies"
    weakest = min(applied, key=lambda control: control.power if not math.isnan(control.power) else math.inf)
    passing = [control.name for control in applied if not control.fails]
    against = " against the format bound" if limited else ""
    if passing:
        return f"WITHIN the bound{against}: " + ", ".join(passing)
    return f"{len(applied)} fail{against}; weakest {weakest.name} {figure_value(weakest.power)}"


def _case_row(index: int, case: CaseResult, link: RecordLink) -> list[str]:
    anchor = link.anchor(json_pointer("cases", index), case.case_id, class_="case")
    status = case.status if case.required else f"{case.status} (optional)"
    if case.candidate is None:
        why = case.skip_reason or "; ".join(case.failures) or "-"
        return [anchor, escape(status), tag("span", escape(why), class_="why"), "", "", "", "", ""]
    floor = _worst_cell(case.format.floor) if case.format else "-"
    return [anchor, escape(status), escape(_worst_cell(case.candidate)), escape(_worst_cell(case.candidate_repeat)),
            escape(_worst_cell(case.default_repeat)), escape(_controls_cell(case)), escape(floor),
            escape(", ".join(case.systematic) or "-")]


def _cases_table(loaded: LoadedRecord, link: RecordLink) -> str:
    header = ["case", "status", "candidate (worst err/bound)", "repeat", "default repeated", "negative controls",
              "format floor", "systematic flagged"]
    rows = [_case_row(index, case, link) for index, case in enumerate(loaded.record.cases)]
    return tag("div", table(header, rows, class_="cases"), class_="wide")


def _failures(record: LeverRecord) -> str:
    failures = [(case.case_id, failure) for case in record.cases for failure in case.failures]
    if not failures:
        return ""
    items = [tag("li", escape(f"{case_id}: {failure}")) for case_id, failure in failures[:MAX_FAILURES]]
    if len(failures) > MAX_FAILURES:
        items.append(tag("li", escape(f"and {len(failures) - MAX_FAILURES} more (in the record)")))
    return tag("h3", "Failures") + tag("ul", "".join(items), class_="failures")


def _figures(loaded: LoadedRecord, link: RecordLink) -> str:
    if not loaded.record.ran_cases():
        return tag("p", "No case ran: nothing to draw.", class_="note")
    parts = [err_bound_figure(loaded, link)]
    if is_optimizer_record(loaded):
        parts.append(optimizer_figure(loaded, link))
    parts += [heatmap_figure(loaded, link, name) for name in sliced_tensors(loaded)]
    parts.append(systematic_figure(loaded, link))
    return "".join(parts)


def lever_section(loaded: LoadedRecord, link: RecordLink, judgement: RecipeJudgement) -> str:
    record = loaded.record
    lever = record.lever
    title = tag("h2", escape(f"{lever['name']}") + tag("span", escape(f" {lever['tier']} · {lever['record_id']}"),
                                                       class_="sub"))
    body = (title + _facts(loaded, link, judgement) + _failures(record) + _figures(loaded, link)
            + tag("h3", "Cases") + _cases_table(loaded, link))
    if record.emulated_gpu is not None:
        body = title + tag("p", escape(f"Emulated GPU: {emulated_sentence(record.emulated_gpu)}."), class_="note") \
            + body.removeprefix(title)
    return tag("section", body, class_="lever", id=section_id(record), data_lever=lever["name"],
               data_verdict=record.verdict, data_tier=lever["tier"], data_emulated=record.emulated_gpu)
