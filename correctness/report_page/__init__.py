"""The report: one self-contained HTML page per recipe run (`correctness report`, `correctness run
--report`), its figures inline SVG. docs/report.md says what each figure shows.

- records.py: the record files or results folders given, read and grouped by recipe;
- header.py: the recipe, its verdict from these records, device, versions and dates;
- lever_section.py: one record's section (facts, failures, figures, cases);
- figures.py (err/bound and systematic), heatmap.py (slices), optimizer.py (per parameter tensor),
  convergence.py (loss curves): the figures; roles.py: who each figure draws;
- bars.py, svg.py, markup.py: the chart, SVG and HTML pieces; page.py: the document.
"""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from correctness.files import output_target, write_output
from correctness.report_page.page import report_html
from correctness.report_page.records import LoadedRecord, by_recipe, load_records, one_recipe

REPORT_NAME = "report.html"  # a recipe's report, in its records' folder


@dataclass(frozen=True)
class Report:
    recipe: str
    path: Path
    html: str
    records: int


def render_reports(records: Sequence[LoadedRecord], output: str | Path | None = None,
                   curves: tuple[str, str] | None = None, thresholds: str = "pipeline") -> list[Report]:
    """The reports, not yet written: one at `output` for one recipe's records (refused for several
    recipes), else one per recipe, REPORT_NAME in the folder of its first record."""
    groups = [one_recipe(records)] if output is not None else list(by_recipe(records).values())
    reports = []
    for group in groups:
        path = Path(output) if output is not None else group[0].path.parent / REPORT_NAME
        html = report_html(group, path, curves, thresholds=thresholds)
        reports.append(Report(group[0].record.recipe.id, path, html, len(group)))
    return reports


def report_inputs(records: Sequence[LoadedRecord], given: Iterable[str | Path] = ()) -> list[Path]:
    """What a report is made from and must never be written over: its records' files and the
    paths given (folders, curves)."""
    return [*(loaded.path for loaded in records), *map(Path, given)]


def write_reports(reports: Sequence[Report], inputs: Iterable[str | Path]) -> list[Path]:
    """Write the reports atomically (a reader sees the old file or the new one, whole), once every
    target was found one a report may replace (correctness.files.output_target: never one of
    `inputs`, a read-only file, a device, ...): a refusal leaves every file as it was."""
    inputs = list(inputs)
    for report in reports:
        output_target(report.path, _label(report), inputs)
    return [write_output(report.path, report.html.encode("utf-8"), _label(report), inputs) for report in reports]


def _label(report: Report) -> str:
    return f"report {report.path}"


__all__ = ["REPORT_NAME", "Report", "load_records", "render_reports", "report_inputs", "write_reports"]
