"""The report's document: one self-contained HTML page for one recipe's records (no script, no
external stylesheet, font or image; the figures inline SVG), readable at 1280 px and printable."""

import datetime
from collections.abc import Sequence
from pathlib import Path

from correctness.report_page.convergence import convergence_figure
from correctness.report_page.header import RecipeJudgement, header_html, judge
from correctness.report_page.lever_section import evidence_class, lever_section, section_id
from correctness.report_page.markup import RecordLink, table, tag
from correctness.report_page.records import LoadedRecord
from correctness.report_page.svg import escape, figure_value
from correctness.results import over_bound

STYLE = """
:root { color-scheme: light; }
body { margin: 0; color: #1a1a1a; background: #fff;
  font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif; }
main { max-width: 1220px; margin: 0 auto; padding: 16px 24px 48px; }
h1 { font-size: 22px; margin: 8px 0 12px; }
h2 { font-size: 19px; border-top: 3px solid #d9d9d9; padding-top: 14px; margin-top: 36px; }
h2 .sub { font-weight: normal; color: #555; font-size: 14px; }
h3 { font-size: 15px; margin: 18px 0 6px; }
table { border-collapse: collapse; margin: 8px 0; }
th, td { border: 1px solid #d9d9d9; padding: 3px 7px; text-align: left; vertical-align: top; }
th { background: #f3f3f3; font-weight: 600; }
table.facts td:first-child { font-weight: 600; white-space: nowrap; }
table.cases td, table.data td { font-size: 12.5px; }
table.cases td { overflow-wrap: anywhere; }
table.cases td:first-child { min-width: 22em; }
ul.plain { margin: 0; padding-left: 18px; }
.recipe-verdict { display: flex; align-items: center; gap: 14px; margin: 14px 0 4px; }
.recipe-verdict .label { font-size: 15px; font-weight: 600; }
.verdict { margin: 0; font-size: 20px; font-weight: 700; padding: 4px 16px; border-left: 8px solid #767676;
  background: #f3f3f3; }
.verdict[data-verdict="pass"] { border-color: #009E73; }
.verdict[data-verdict="fail"] { border-color: #D55E00; }
.verdict[data-verdict="incomplete"] { border-color: #E69F00; }
.note { color: #444; font-size: 13px; }
pre { background: #f7f7f7; padding: 8px 10px; overflow-x: auto; font-size: 12px; line-height: 1.35; }
figure.chart { margin: 18px 0 26px; overflow-x: auto; }
figure.chart svg { display: block; height: auto; }
figcaption { max-width: 1000px; font-size: 13px; color: #333; margin-top: 6px; }
a.pointer { font-family: ui-monospace, "DejaVu Sans Mono", monospace; font-size: 12px; word-break: break-all; }
.why { color: #555; }
.wide { overflow-x: auto; }
.verdict-word { font-weight: 700; }
@media print {
  body { font-size: 10pt; }
  main { max-width: none; padding: 0; }
  section.lever { break-before: page; }
  figure.chart { break-inside: avoid; overflow: visible; }
  figure.chart svg { max-width: 100%; }
  .wide { overflow: visible; }
  a { color: #000; }
  pre { white-space: pre-wrap; }
}
"""


def _ordered(records: Sequence[LoadedRecord], judgement: RecipeJudgement) -> list[LoadedRecord]:
    """The levers the recipe's changes need first (in the verdict's order), then the others by name."""
    needed = [lever.lever for lever in judgement.judged.levers] if judgement.judged else []
    rank = {name: index for index, name in enumerate(needed)}
    return sorted(records, key=lambda loaded: (rank.get(loaded.record.lever["name"], len(rank)),
                                               loaded.record.lever["name"], loaded.record.lever["tier"]))


def _summary_row(loaded: LoadedRecord) -> list[str]:
    record = loaded.record
    ran = record.ran_cases()
    worst = max((over_bound(case.candidate.worst) for case in ran), default=None)
    powers = [control.power for case in ran for control in case.controls if control.judgement is not None]
    weakest = min((p for p in powers if p == p), default=None)
    tier = record.lever["tier"] + (f" (emulated {record.emulated_gpu}: not evidence)" if record.emulated_gpu else "")
    return [tag("a", escape(record.lever["name"]), href="#" + section_id(record)), escape(tier),
            tag("span", escape(record.verdict), class_="verdict-word"), escape(evidence_class(record.lever["name"])),
            escape(f"{len(ran)} of {len(record.cases)}"), escape(figure_value(worst) if worst is not None else "-"),
            escape(figure_value(weakest) if weakest is not None else "-")]


def _summary(records: Sequence[LoadedRecord]) -> str:
    header = ["lever", "tier", "verdict", "evidence class", "cases ran", "candidate's worst err/bound",
              "weakest control's err/bound"]
    return tag("nav", tag("h2", "Levers") + table(header, [_summary_row(loaded) for loaded in records]))


def report_html(records: Sequence[LoadedRecord], report: Path, curves: tuple[str, str] | None = None,
                generated: datetime.datetime | None = None, thresholds: str = "pipeline") -> str:
    """The page for one recipe's records, to be written at `report` (its links are relative to it);
    `curves`: a candidate and a reference loss curve, for the convergence figure."""
    generated = generated or datetime.datetime.now(datetime.timezone.utc)
    judgement = judge(records)
    ordered = _ordered(records, judgement)
    sections = "".join(lever_section(loaded, RecordLink(loaded.path, report), judgement) for loaded in ordered)
    convergence = ""
    if curves is not None:
        convergence = tag("section", tag("h2", "Convergence") + convergence_figure(*curves, report, thresholds),
                          class_="convergence")
    recipe = records[0].record.recipe
    main = tag("main", header_html(ordered, judgement, generated) + _summary(ordered) + sections + convergence,
               data_recipe=recipe.id, data_verdict=judgement.verdict)
    head = ('<meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">'
            + tag("title", escape(f"Correctness report: {recipe.id}")) + tag("style", STYLE))
    return "<!DOCTYPE html>\n" + tag("html", tag("head", head) + tag("body", main), lang="en") + "\n"
