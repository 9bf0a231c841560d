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

ROOT = Path(__file__).resolve().parent.parent
GEMMA = "gemma-4-31b/h100/attune-tp2-pp4-split13"
NEMOTRON = "nemotron-3-super-120b-a12b/h200/attune-tp4-pp2-ep8-mt16k"
# A few component tests of each seed, enough for a report with each kind of chart: (modules, -k), one
# pytest process per seed (Gemma about 20 s on 2 cores, Nemotron about 15 s).
SEED_RUNS = {
    GEMMA: (["component_tests/test_attention_backend.py"], "sdpa_flash_cpu_against_eager_unfused and seed0"),
    NEMOTRON: (["component_tests/test_optimizer_offload.py", "component_tests/test_thd_packing.py"],
               "offload_fraction_cpu and nemotron or thd_packing_cpu and seed0"),
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
    """Runs `recipe`'s few component tests (SEED_RUNS) with their records in `results`; None where they
    passed, else the end of pytest's output."""
    modules, expression = SEED_RUNS[recipe]
    finished = subprocess.run([sys.executable, "-m", "pytest", *modules, "-k", expression, "-q", "-p",
                               "no:cacheprovider", "--results-dir", str(results)],
                              cwd=ROOT, capture_output=True, text=True, timeout=600)
    if finished.returncode == 0:
        return None
    return f"pytest {' '.join(modules)} -k {expression!r}: exit {finished.returncode}\n{finished.stdout[-4000:]}"


def records_folder(recipe: str, results: Path) -> Path | None:
    """`recipe`'s records folder under `results` (<recipe id>.<hash>; the newest where there are several)."""
    parent = results / Path(recipe).parent
    folders = [path for path in parent.glob(f"{Path(recipe).name}.*") if path.is_dir()]
    return max(folders, key=lambda path: path.stat().st_mtime, default=None)


def write_report(records: Path, out: Path | None = None) -> subprocess.CompletedProcess:
    """`correctness report RECORDS [-o OUT]` (without OUT: report.html in each recipe's records folder)."""
    return subprocess.run([sys.executable, "-m", "correctness.cli", "report", str(records),
                           *(["-o", str(out)] if out else [])], cwd=ROOT, capture_output=True, text=True, timeout=300)
