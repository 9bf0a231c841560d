"""The seed recipes' HTML reports (`correctness report`) in headless Chromium, for
tests/test_report_browser.py and `scripts/report-screenshots`: the few component tests that make each
seed's records, and the system's own browser and driver (Debian's `chromium` and `chromium-driver`)
driven by selenium, never a downloaded one. `start()` returns a driver or the one-line reason none could
be found or started."""

import io
import shutil
import subprocess
import sys
from pathlib import Path

from correctness.fixtures import recipe_path

ROOT = Path(__file__).resolve().parent.parent
GEMMA = "gemma-4-31b/h100/attune-tp2-pp4-split13"
NEMOTRON = "nemotron-3-super-120b-a12b/h200/attune-tp4-pp2-ep8-mt16k"
# A few component tests of each seed, enough for a report with each kind of chart: the `-k` of one
# `correctness run RECIPE --tier cpu --report` per seed (Gemma's attention backend on its seed-0 cases,
# Nemotron's optimizer offload at both CPU tiers). The unit tests share one run of each per session
# (tests/conftest.py: seed_reports).
SEED_RUNS = {
    GEMMA: "sdpa_flash_cpu_against_eager_unfused and seed0",
    NEMOTRON: "offload_fraction_cpu or megatron_hybrid_optimizer_on_cpu",
}

WIDTH, HEIGHT = 1280, 1000
BROWSERS = ("chromium", "chromium-browser")  # Debian's name, then Ubuntu's
DRIVERS = ("chromedriver",)
INSTALL = "apt-get install chromium chromium-driver"


def executables():
    """(browser, driver) paths on PATH, or a one-line reason which is missing."""
    browser = next(filter(None, map(shutil.which, BROWSERS)), None)
    driver = next(filter(None, map(shutil.which, DRIVERS)), None)
    missing = [name for name, path in (("chromium", browser), ("chromedriver", driver)) if path is None]
    if missing:
        return None, f"no {' and no '.join(missing)} on PATH ({INSTALL})"
    return (browser, driver), None


def start(width=WIDTH, height=HEIGHT):
    """(driver, None) with a headless Chromium of `width` CSS pixels, or (None, reason)."""
    try:
        from selenium import webdriver
        from selenium.common.exceptions import WebDriverException
        from selenium.webdriver.chrome.service import Service
    except ImportError as error:
        return None, f"selenium is not installed ({error}; it is in the test extra)"
    paths, reason = executables()
    if paths is None:
        return None, reason
    browser, driver = paths
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                     "--hide-scrollbars", "--force-device-scale-factor=1", f"--window-size={width},{height}"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    try:
        return webdriver.Chrome(options=options, service=Service(executable_path=driver)), None
    except (WebDriverException, OSError) as error:
        first = (getattr(error, "msg", None) or str(error)).strip().splitlines() or [type(error).__name__]
        return None, f"headless Chromium did not start ({browser}, {driver}): {first[0]}"


def console_errors(driver):
    """The browser console's SEVERE entries since the last call (the driver's log is drained)."""
    return [entry["message"] for entry in driver.get_log("browser") if entry.get("level") == "SEVERE"]


def gray_variance(png):
    """The variance of a PNG's gray levels (0-255): 0 for a blank page. Pillow comes with matplotlib."""
    from PIL import Image, ImageStat

    with Image.open(io.BytesIO(png)) as image:
        return ImageStat.Stat(image.convert("L")).var[0]


def run_component_tests(recipe: str, results: Path) -> str | None:
    """Runs `recipe`'s few component tests (SEED_RUNS) by `correctness run --report`, with their records
    and the recipe's report.html in `results`; None where the run passed or was incomplete (its other
    levers deselected), else the end of its output."""
    finished = subprocess.run(
        [sys.executable, "-m", "correctness.cli", "run", str(recipe_path(recipe)), "--tier", "cpu", "--report",
         "--results-dir", str(results), "--", "-k", SEED_RUNS[recipe], "-p", "no:cacheprovider"],
        cwd=results.parent, capture_output=True, text=True, timeout=900)
    if finished.returncode in (0, 1) and "report: " in finished.stdout:
        return None
    return (f"correctness run {recipe} -k {SEED_RUNS[recipe]!r}: exit {finished.returncode}\n"
            f"{finished.stdout[-3000:]}{finished.stderr[-3000:]}")


def records_folder(recipe: str, results: Path) -> Path | None:
    """`recipe`'s records folder under `results` (<recipe id>.<hash>; the newest where there are several)."""
    parent = results / Path(recipe).parent
    folders = [path for path in parent.glob(f"{Path(recipe).name}.*") if path.is_dir()]
    return max(folders, key=lambda path: path.stat().st_mtime, default=None)


def write_report(records: Path, out: Path | None = None) -> subprocess.CompletedProcess:
    """`correctness report RECORDS [-o OUT]` (without OUT: report.html in each recipe's records folder)."""
    return subprocess.run([sys.executable, "-m", "correctness.cli", "report", str(records),
                           *(["-o", str(out)] if out else [])], cwd=ROOT, capture_output=True, text=True, timeout=300)
