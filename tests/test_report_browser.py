"""The HTML report (`correctness report`, issue 28) in a real browser: both seed recipes' CPU reports
open in headless Chromium at 1280 px wide without a console error, with every chart drawn, the verdict
the page states equal to the one it carries, and a screenshot that is not blank.

The browser is the system's (Debian: `apt-get install chromium chromium-driver`; CI installs them);
where none can be found or started, the tests skip with the reason (they fail instead where
CORRECTNESS_REQUIRE_BROWSER is set, as `.ci/run` does). The checks themselves are first run on a page
written here, whole and broken, so that a check that sees nothing fails. The seeds' records come from a
few of their component tests, run once per session into a temporary folder (report_in_browser.SEED_RUNS;
tests/conftest.py: seed_reports)."""

import os
from pathlib import Path

import pytest

import report_in_browser as browsing
from report_in_browser import GEMMA, NEMOTRON

# The figures each seed's report must hold: (lever section, figure.chart[data-kind]); a heatmap is
# Gemma's (attention), the offload charts Nemotron's.
SEED_CHARTS = {
    GEMMA: [("attention-backend", "err-bound"), ("attention-backend", "heatmap")],
    NEMOTRON: [("optimizer-offload", "err-bound"), ("optimizer-offload", "offload")],
}
VERDICTS = {"pass", "fail", "incomplete", "no kernel change", "format-limited", "skip"}
MIN_GRAY_VARIANCE = 20.0  # a blank page is 0; the stand-in page below 830, the Nemotron report 1440

# What the page shows, read in the browser: rendered sizes and the marks an SVG draws (a mark with
# an empty bounding box draws nothing).
FACTS = """
const main = document.querySelector('main');
const verdict = document.querySelector('p.verdict');
const drawn = (mark) => { const box = mark.getBBox(); return box.width > 0 || box.height > 0; };
const charts = [...document.querySelectorAll('figure.chart')].map((figure) => {
  const svg = figure.querySelector('svg');
  const box = svg ? svg.getBoundingClientRect() : {width: 0, height: 0};
  const section = figure.closest('section.lever');
  return {kind: figure.dataset.kind || '', lever: section ? section.dataset.lever : '',
          width: box.width, height: box.height,
          marks: svg ? [...svg.querySelectorAll('rect, circle, path')].filter(drawn).length : 0};
});
return {recipe: main ? main.dataset.recipe : null, verdict: main ? main.dataset.verdict : null,
        stated: verdict ? verdict.textContent.replace(/\\s+/g, ' ').trim() : null,
        levers: [...document.querySelectorAll('section.lever')].map((section) => section.dataset.lever),
        charts: charts, pageWidth: document.documentElement.scrollWidth, viewWidth: window.innerWidth};
"""


def page_problems(driver, page: Path, recipe: str, charts=()) -> list[str]:
    """Each way the page at `page` fails the checks, in words; [] where it passes them all. `charts`: the
    (lever, kind) of figures it must hold."""
    browsing.console_errors(driver)  # drains the previous page's log
    driver.get(page.resolve().as_uri())
    problems = [f"console error: {message}" for message in browsing.console_errors(driver)]
    facts = driver.execute_script(FACTS)
    if facts["recipe"] != recipe:
        problems.append(f"main[data-recipe] is {facts['recipe']!r}, not {recipe!r}")
    if facts["verdict"] not in VERDICTS:
        problems.append(f"main[data-verdict] is {facts['verdict']!r}, not a verdict")
    elif (facts["stated"] or "").casefold() != facts["verdict"].casefold():
        problems.append(f"p.verdict says {facts['stated']!r}, main[data-verdict] is {facts['verdict']!r}")
    if not facts["levers"]:
        problems.append("no section.lever")
    if not facts["charts"]:
        problems.append("no figure.chart")
    held = {(chart["lever"], chart["kind"]) for chart in facts["charts"]}
    problems += [f"no {kind} chart in the {lever} section" for lever, kind in charts if (lever, kind) not in held]
    for number, chart in enumerate(facts["charts"]):
        where = f"chart {number} ({chart['lever']}, {chart['kind']})"
        if chart["width"] <= 0 or chart["height"] <= 0:
            problems.append(f"{where}: its svg is {chart['width']} x {chart['height']} px")
        if chart["marks"] == 0:
            problems.append(f"{where}: its svg draws no rect, circle or path")
    if facts["pageWidth"] > facts["viewWidth"]:
        problems.append(f"the page is {facts['pageWidth']} px wide in a {facts['viewWidth']} px window")
    variance = browsing.gray_variance(driver.get_screenshot_as_png())
    if variance <= MIN_GRAY_VARIANCE:
        problems.append(f"the screenshot is blank (gray variance {variance:.1f})")
    return problems


@pytest.fixture(scope="module")
def browser():
    driver, reason = browsing.start()
    if driver is None and os.environ.get("CORRECTNESS_REQUIRE_BROWSER"):  # .ci/run: CI must not skip it
        pytest.fail(f"CORRECTNESS_REQUIRE_BROWSER is set but {reason}", pytrace=False)
    if driver is None:
        pytest.skip(reason)
    yield driver
    driver.quit()


# --- the checks on a page written here, with the report's contract ------------------------------------

CHART = """<figure class="chart" data-kind="{kind}"><svg width="400" height="120" viewBox="0 0 400 120">{marks}</svg>
<figcaption>{kind}</figcaption><a class="pointer" href="#/cases/0">/cases/0</a></figure>"""
MARKS = ('<rect x="10" y="20" width="300" height="30" fill="#0072b2"/><circle cx="340" cy="35" r="8" fill="#d55e00"/>'
         '<path d="M10 100 H390" stroke="#000"/><text x="10" y="80">err/bound 0.31</text>')


def stand_in(*, verdict="pass", stated="pass", marks=MARKS, script="", style="") -> str:
    charts = CHART.format(kind="err-bound", marks=marks) + CHART.format(kind="heatmap", marks=MARKS)
    return (f'<!doctype html><html><head><meta charset="utf-8"><title>report</title><style>{style}</style></head>'
            f'<body><main data-recipe="{GEMMA}" data-verdict="{verdict}"><h1>{GEMMA}</h1>'
            f'<p class="verdict">{stated}</p><section class="lever" data-lever="attention-backend">'
            f'<h2>attention-backend</h2>{charts}</section></main>{script}</body></html>')


BROKEN = {
    "console error": stand_in(script="<script>console.error('broken')</script>"),
    "p.verdict says": stand_in(stated="fail"),
    "not a verdict": stand_in(verdict="fine"),
    "no offload chart in the attention-backend section": stand_in(),
    "draws no rect, circle or path": stand_in(marks='<text x="10" y="20">no marks</text>'),
    "its svg is 0 x 0 px": stand_in(style="svg { display: none }"),
    "px wide in a": stand_in(style="main { width: 3000px }"),
    "the screenshot is blank": stand_in(style="body { visibility: hidden }"),
}


def test_the_checks_pass_a_whole_page(browser, tmp_path):
    page = tmp_path / "report.html"
    page.write_text(stand_in())
    assert page_problems(browser, page, GEMMA) == []


@pytest.mark.parametrize("problem", list(BROKEN))
def test_the_checks_fail_a_broken_page(browser, tmp_path, problem):
    page = tmp_path / "report.html"
    page.write_text(BROKEN[problem])
    found = page_problems(browser, page, GEMMA, [("attention-backend", "heatmap"), ("attention-backend", "offload")])
    assert any(problem in line for line in found), found


# --- the seed recipes' reports ------------------------------------------------------------------------

@pytest.fixture(params=[GEMMA, NEMOTRON], ids=["gemma", "nemotron"])
def seed_report(request, browser, seed_reports):
    """(recipe, its report.html) from the session's records of a few of its component tests
    (tests/conftest.py: seed_reports)."""
    recipe = request.param
    reports = [path for path in seed_reports.rglob("report.html")
               if recipe in path.relative_to(seed_reports).as_posix()]
    assert len(reports) == 1, sorted(seed_reports.rglob("*"))
    return recipe, reports[0]


def test_a_seed_recipes_report_opens_cleanly_in_chromium(browser, seed_report):
    recipe, page = seed_report
    assert page_problems(browser, page, recipe, SEED_CHARTS[recipe]) == []
