"""The report (`correctness report`, `correctness run --report`; correctness/report_page/): its HTML
read with the standard library's parser (every lever section, every chart non-empty and linked to
a record field that exists, the verdict, nothing external, the heatmap's worst slice marked), bad
input, and its size on real records.

The real records come from a few component tests run once per session into a temporary folder by
`correctness run --report` (Gemma's attention backend on its seed-0 cases, Nemotron's optimizer
offload at the CPU tier, both tiers; tests/conftest.py: seed_reports), which writes each recipe's
report too."""

import json
import shutil
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote

import pytest

from correctness import cli
from correctness.fixtures import recipe_path
from correctness.recipes import load_recipe
from correctness.report_page.markup import json_pointer
from toy_records import toy_record

GEMMA = "gemma-4-31b/h100/attune-tp2-pp4-split13"
NEMOTRON = "nemotron-3-super-120b-a12b/h200/attune-tp4-pp2-ep8-mt16k"
CONVERGENCE = Path(__file__).parent / "data" / "convergence"
SIZE_LIMIT = 2 * 2**20  # bytes: the issue's limit for the Nemotron offload records' report
MARKS = {"rect", "circle", "path"}
EXTERNAL_TAGS = {"script", "link", "img", "iframe", "object", "embed", "image", "use", "audio", "video", "source"}


def call(capsys, *argv) -> tuple[int, str, str]:
    try:
        code = cli.main([str(arg) for arg in argv])
    except SystemExit as leaving:
        code = leaving.code
    out, err = capsys.readouterr()
    return code, out, err


def one_line(err: str) -> bool:
    return err.count("\n") == 1 and "Traceback" not in err


@pytest.fixture
def results(seed_reports) -> Path:
    """The session's records and reports of the seeds' few component tests (tests/conftest.py)."""
    return seed_reports


def report_of(results: Path, recipe: str) -> Path:
    (report,) = [path for path in results.rglob("report.html") if recipe in str(path.relative_to(results))]
    return report


class Page(HTMLParser):
    """What the tests check of a report: the main element, the verdict, the lever sections, each
    figure's marks, caption and record links, and every tag and address in it."""

    def __init__(self):
        super().__init__()
        self.main: dict[str, str] = {}
        self.verdict = ""
        self.sections: list[dict[str, str]] = []
        self.figures: list[dict] = []
        self.tags: set[str] = set()
        self.addresses: list[tuple[str, str]] = []  # (attribute, value) of every src and href
        self.style = ""
        self._in: list[str] = []

    def handle_starttag(self, tag, attrs):
        attributes = dict(attrs)
        self.tags.add(tag)
        self.addresses += [(name, value) for name, value in attrs if name in ("src", "href", "xlink:href")]
        if tag == "main":
            self.main = attributes
        elif tag == "section" and "lever" in attributes.get("class", "").split():
            self.sections.append(attributes)
        elif tag == "figure":
            self.figures.append({"kind": attributes.get("data-kind"), "class": attributes.get("class"), "svgs": 0,
                                 "marks": 0, "worst": 0, "caption": "", "pointers": []})
        elif self.figures and "figure" in self._in:
            figure = self.figures[-1]
            figure["svgs"] += tag == "svg"
            figure["marks"] += tag in MARKS
            figure["worst"] += tag in MARKS and "worst" in attributes.get("class", "").split()
            if tag == "a" and attributes.get("class") == "pointer":
                figure["pointers"].append(attributes["href"])
        if tag not in ("meta", "br"):
            self._in.append(tag if not (tag == "p" and attributes.get("class") == "verdict") else "verdict")

    def handle_endtag(self, tag):
        if self._in:
            self._in.pop()

    def handle_data(self, data):
        if "verdict" in self._in:
            self.verdict += data
        if "figcaption" in self._in and self.figures:
            self.figures[-1]["caption"] += data
        if self._in and self._in[-1] == "style":
            self.style += data


def parse(report: Path) -> Page:
    page = Page()
    page.feed(report.read_text(encoding="utf-8"))
    page.close()
    return page


def resolve(report: Path, href: str):
    """The record field a link names: its file, relative to the report, and its JSON pointer."""
    file, _, pointer = href.partition("#")
    value = json.loads((report.parent / unquote(file)).read_text())
    for token in unquote(pointer).split("/")[1:]:
        token = token.replace("~1", "/").replace("~0", "~")
        value = value[int(token)] if isinstance(value, list) else value[token]
    return value


def check_structure(report: Path) -> Page:
    page = parse(report)
    records = [json.loads(path.read_text()) for path in sorted(report.parent.glob("*.json"))]
    assert page.main["data-recipe"] == records[0]["recipe"]["id"]
    assert page.main["data-verdict"] in ("pass", "fail", "incomplete")
    assert page.verdict == page.main["data-verdict"]  # the verdict's word alone
    assert f"recipe {page.main['data-recipe']}: {page.verdict.upper()}" in report.read_text()  # as `run` words it
    assert sorted((s["data-lever"], s["data-verdict"]) for s in page.sections) == sorted(
        (record["lever"]["name"], record["verdict"]) for record in records)
    assert page.figures and all(figure["class"] == "chart" for figure in page.figures)
    for figure in page.figures:
        assert figure["svgs"] == 1 and figure["marks"] > 0 and figure["caption"].strip(), figure
        assert figure["pointers"], figure
        for href in figure["pointers"]:
            assert resolve(report, href) is not None, href  # the pointer names a field of the record
    assert not page.tags & EXTERNAL_TAGS
    assert not [value for name, value in page.addresses if name != "href"]  # no src at all
    for _, href in page.addresses:
        assert href.startswith("#") or (".json#" in href and "://" not in href and (
            report.parent / unquote(href.partition("#")[0])).is_file()), href
    assert "url(" not in page.style and "@import" not in page.style
    return page


def test_the_attention_report_has_every_lever_every_chart_and_its_worst_slices(results):
    page = check_structure(report_of(results, "gemma"))
    kinds = [figure["kind"] for figure in page.figures]
    assert {"err-bound", "heatmap", "systematic"} <= set(kinds)
    heatmaps = [figure for figure in page.figures if figure["kind"] == "heatmap"]
    assert len(heatmaps) == 4  # out, dq, dk, dv
    assert all(figure["worst"] == 1 and "worst slice" in figure["caption"] for figure in heatmaps)
    assert all(href.endswith("/slices") for figure in heatmaps for href in figure["pointers"])


def test_the_offload_report_is_under_its_size_and_draws_each_parameter_by_layer_and_share(results):
    report = report_of(results, "nemotron")
    size = report.stat().st_size
    assert size < SIZE_LIMIT, f"{size:,} bytes"
    page = check_structure(report)
    assert {section["data-lever"] for section in page.sections} == {"optimizer-offload"}
    assert len(page.sections) == 2  # the cpu and megatron-cpu tiers
    offload = [figure for figure in page.figures if figure["kind"] == "offload"]
    assert len(offload) == 2
    text = report.read_text()
    assert "layer 1 (moe) · GPU" in text and "layer 1 (moe) · CPU" in text


def test_a_results_folder_gives_one_report_per_recipe(results, capsys):
    code, out, err = call(capsys, "report", results)
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 2 and all(line.startswith("report: ") and "report.html" in line for line in lines)
    assert [recipe for recipe in (GEMMA, NEMOTRON) if any(f"/{recipe}." in line for line in lines)] == [GEMMA, NEMOTRON]


def test_curves_add_the_convergence_figure(results, tmp_path, capsys):
    records = report_of(results, "gemma").parent
    target = tmp_path / "gemma.html"
    code, _, err = call(capsys, "report", records, "-o", target, "--curves", CONVERGENCE / "candidate.log",
                        CONVERGENCE / "reference.log")
    assert code == 0, err
    page = parse(target)
    (figure,) = [figure for figure in page.figures if figure["kind"] == "convergence"]
    assert figure["marks"] >= 3 and len(figure["pointers"]) == 2
    assert all((target.parent / unquote(href)).is_file() for href in figure["pointers"])


def test_bad_input_is_one_line_and_no_file(results, tmp_path, capsys):
    target = tmp_path / "report.html"
    code, _, err = call(capsys, "report", tmp_path / "missing.json", "-o", target)
    assert code == 2 and one_line(err) and "missing.json" in err
    stranger = tmp_path / "stranger.json"
    stranger.write_text('{"losses": [1, 2]}')
    code, _, err = call(capsys, "report", stranger, "-o", target)
    assert code == 2 and one_line(err) and "stranger.json" in err and "not a correctness.lever-record" in err
    code, _, err = call(capsys, "report", results, "-o", target)
    assert code == 2 and one_line(err) and GEMMA in err and NEMOTRON in err
    assert not target.exists()


def test_a_record_whose_recipe_is_gone_is_refused_naming_it(tmp_path, capsys):
    """A record is held to its recipe (correctness.trust): where the recipe's file is gone there is
    nothing to hold it to, and no page is written."""
    recipe = tmp_path / "gone.yaml"
    shutil.copy(recipe_path(GEMMA), recipe)
    record = toy_record(tmp_path / "results", recipe=load_recipe(recipe))
    recipe.unlink()
    code, _, err = call(capsys, "report", record)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"its recipe gemma-4-31b/h100/gone is not at {recipe.resolve()}" in err
    assert not (record.parent / "report.html").exists()


def test_json_pointers_escape_slash_and_tilde():
    assert json_pointer("cases", 3, "candidate", "tensors", 0, "slices") == "/cases/3/candidate/tensors/0/slices"
    assert json_pointer("against a/b", "x~y") == "/against a~1b/x~0y"
