"""The report's header: the recipe, its verdict from these records as `correctness run` and the
component tests' summary word it (correctness.recipe_verdict), the device and versions the records
ran with, and their dates."""

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from correctness.errors import CorrectnessError
from correctness.files import shown_path
from correctness.recipe_verdict import RecipeVerdict, judge_recipe, recipe_changes, verdict_lines
from correctness.recipes import load_recipe
from correctness.report_page.markup import table, tag
from correctness.report_page.records import LoadedRecord
from correctness.report_page.svg import escape

NOT_JUDGED = "not judged"


@dataclass(frozen=True)
class RecipeJudgement:
    verdict: str  # pass, fail, incomplete, or NOT_JUDGED
    lines: tuple[str, ...]  # the verdict as `correctness run` prints it, or why there is none
    judged: RecipeVerdict | None
    note: str | None = None  # the recipe changed since the records were written


def judge(records: Sequence[LoadedRecord]) -> RecipeJudgement:
    """The recipe's verdict from these records, against its default reference (as `correctness run`
    judges it); where its file is gone or cannot be read, why it is not judged."""
    recipe_ref = records[0].record.recipe
    path = next((loaded.record.recipe.path for loaded in records if loaded.record.recipe.path), None)
    if path is None or not Path(path).is_file():
        where = f"its file {path} is gone" if path else "the records do not say where its file is"
        return RecipeJudgement(NOT_JUDGED, (f"recipe {recipe_ref.id}: not judged: {where}, so what it changed"
                                            " cannot be read; each lever's own verdict is below",), None)
    try:
        recipe = load_recipe(path)
        verdict = judge_recipe(recipe, recipe_changes(recipe), [loaded.record for loaded in records])
    except CorrectnessError as error:
        return RecipeJudgement(NOT_JUDGED, (f"recipe {recipe_ref.id}: not judged: {error}",), None)
    note = None
    if recipe.sha256 != recipe_ref.sha256:
        note = (f"the recipe file {shown_path(path)} has changed since these records were written (its sha256"
                " differs): the verdict judges the file as it is now")
    return RecipeJudgement(verdict.verdict, tuple(verdict_lines(verdict, recipe.gpu)), verdict, note)


def _distinct(values: Sequence[object]) -> str:
    shown = [str(value) for value in dict.fromkeys(values) if value not in (None, "")]
    return ", ".join(shown) if shown else "-"


def _provenance_rows(records: Sequence[LoadedRecord]) -> list[list[str]]:
    provenances = [loaded.record.provenance for loaded in records]
    devices = [f"{p['device'].get('type')}: {p['device'].get('name')}"
               + (f" (emulated on the CPU {p['device'].get('host_cpu')}: not evidence)" if p.get("emulated_gpu") else "")
               for p in provenances]
    packages = [f"{name} {version}" for p in provenances for name, version in p.get("packages", {}).items()
                if version]
    te_cpu = [f"transformer-engine {p['transformer_engine_for_cpu']} (its Python on the CPU)"
              for p in provenances if p.get("transformer_engine_for_cpu")]
    rows = [("device", _distinct(devices)), ("host", _distinct([p.get("host") for p in provenances])),
            ("python, torch", _distinct([f"python {p.get('python')}, torch {p.get('torch')}" for p in provenances])),
            ("CUDA, cuDNN, driver", _distinct([", ".join(str(p.get(k)) for k in ("cuda", "cudnn", "driver"))
                                                for p in provenances if p.get("cuda")])),
            ("packages", _distinct(sorted(set(packages)) + te_cpu)),
            ("suite commit", _distinct([p.get("correctness_commit") for p in provenances]))]
    return [[escape(name), escape(value)] for name, value in rows]


def header_html(records: Sequence[LoadedRecord], judgement: RecipeJudgement, generated: datetime.datetime) -> str:
    recipe = records[0].record.recipe
    started = min(loaded.record.started for loaded in records)
    finished = max(loaded.record.finished for loaded in records)
    facts = table(["recipe", "model", "GPU", "records", "ran", "report written"], [[
        escape(recipe.id), escape(recipe.model), escape(recipe.gpu), escape(len(records)),
        escape(f"{started[:19].replace('T', ' ')} to {finished[:19].replace('T', ' ')}"),
        escape(generated.strftime("%Y-%m-%d %H:%M:%S %Z")),
    ]], class_="facts")
    # p.verdict holds the verdict's word alone (what main's data-verdict says); the lines in full below it
    verdict = tag("div", tag("span", "The recipe's verdict from these records:", class_="label")
                  + tag("p", escape(judgement.verdict), class_="verdict", data_verdict=judgement.verdict),
                  class_="recipe-verdict")
    details = tag("pre", escape("\n".join(judgement.lines)), class_="verdict-lines")
    note = tag("p", escape(judgement.note), class_="note") if judgement.note else ""
    provenance = tag("details", tag("summary", "Device and versions the records ran with")
                     + table(["", ""], _provenance_rows(records), class_="facts"), open="open")
    return tag("header", tag("h1", escape(f"Correctness report: {recipe.id}")) + facts + verdict + note + details
               + provenance)
