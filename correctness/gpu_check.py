"""scripts/gpu-check's run: the component tests' GPU tiers in one command that fits a GPU machine
lent for ten minutes, whose output folder comes back only as at most eight files.

    scripts/gpu-check [OUT] [--budget SECONDS] [--module-limit MODULE=SECONDS ...] [--grace SECONDS]
                      [--records FOLDER] [--rehearsal] [--tests FOLDER] [--marker EXPRESSION]
                      [-- pytest arguments ...]

OUT is a new folder or an empty one; arguments after `--` go to every module's pytest. An OUT that
is a file or holds anything, an option gpu-check does not know, a --tests that is no folder are
refused in one line (exit 2) before anything runs.

Each test module runs in a pytest process of its own, under one budget for them all (--budget,
default GPU_CHECK_SECONDS or 420 s) and a time limit of its own (MODULE_LIMITS, --module-limit). The
evidence that matters most runs first (FIRST: the attention lever at Gemma's shapes, THD packing at
Nemotron's; then the Megatron offload tier where megatron-core is importable), then the rest by
name. A module whose limit does not fit in what is left of the budget is skipped, with that reason
in the summary. At its limit a module gets SIGINT (the plugin then writes its records, marked
interrupted) and, --grace seconds later, SIGKILL: the cases it finished are in its case logs, which
the packing turns into records (correctness.record_store). pytest's faulthandler dumps the
tracebacks of a test that hangs into the log before the limit. A module that runs deterministic
tiers starts with CUBLAS_WORKSPACE_CONFIG set (cuBLAS reads it once, as it starts). On an H200 the
recipes' H100 tiers run, as a stand-in (`--gpu-stand-in h200=h100`, unless the arguments name
another).

The records go to --records (default: a temporary folder, removed once packed); a killed
gpu-check leaves case logs there that the next run on that folder turns into records. OUT then
holds four files: gpu-check.log (everything printed), records.tar.gz (every record, the
interrupted ones in their `.interrupted/` folders), summary.json (each module's outcome; per lever:
its verdict, cases by status, worst error over bound, the backends that ran, device and versions)
and environment.txt (scripts/gpu_preflight.py's report). Where CUDA is not visible it refuses in
one line (exit 2) and writes nothing.

--rehearsal runs the same GPU modules on the CPU, on an emulated GPU (correctness.emulated_gpu;
--emulate-gpu, by default H200x1: the lent machine, one H200), with the same OUT, budget and limits
and without the CUDA refusal: the device's command rehearsed end to end before a GPU is lent. Its
records say they were emulated (kept in `.emulated/`), and no reader counts them as evidence; its
exit status counts every case that ran to a verdict. The suite's rehearsal tests
(tests/test_gpu_rehearsal.py) run it on a toy folder and on the component tests.

Exit status: 0 where a case of the selection ran to a verdict (a GPU case, outside a rehearsal) and
every module that ran finished without a failure; 1 where a case failed, a module stopped at its
limit or broke, or no case ran to a verdict; 2 where it refused.
"""

import argparse
import datetime
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from correctness.emulated_gpu.gpus import OPTION as EMULATE_OPTION
from correctness.emulated_gpu.gpus import emulated_option

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_BUDGET = 420.0  # seconds for every module together: a 10-minute command with room to start and pack
BUDGET_ENV = "GPU_CHECK_SECONDS"
DEFAULT_TESTS = ROOT / "component_tests"
# The evidence first: the attention lever at Gemma's shapes (torch's SDPA backends), THD packing at
# Nemotron's; the Megatron offload tier next where megatron-core is importable.
FIRST = ("test_attention_backend.py", "test_thd_packing.py")
MEGATRON_FIRST = "test_optimizer_offload.py"
# A module's time limit (seconds), where it is not the default: its recipe-scale GPU cases.
# test_precision_aware_adam.py: five state formats of two recipes, measured at 53 s in the rehearsal
# on an emulated H200 (at the smoke scale, on 2 CPU cores), past the 45 s it had.
MODULE_LIMITS = {"test_attention_backend.py": 150.0, "test_thd_packing.py": 60.0, "test_optimizer_offload.py": 90.0,
                 "test_cross_entropy_fusion.py": 120.0, "test_precision_aware_adam.py": 90.0}
DEFAULT_MODULE_LIMIT = 45.0
GRACE = 20.0  # seconds from a module's SIGINT to its SIGKILL
FAULTHANDLER_LEAD = 10.0  # a hung test's tracebacks are dumped this long before its module's limit
DETERMINISTIC_MODULES = ("test_deterministic_mode.py",)  # they run --deterministic-mode's switches
# The lent machine is an H200; the recipes' GPU is the H100, of its architecture. The stand-in
# changes nothing on another GPU (correctness.tiers.StandIn).
DEFAULT_STAND_IN = "h200=h100"
REHEARSAL_GPU = "H200x1"  # a rehearsal's emulated GPU: the lent machine's
OUTPUT_DRAIN = 5.0  # seconds to wait for a finished module's last output (a child it left may hold the pipe)

LOG, RECORDS, SUMMARY, ENVIRONMENT = "gpu-check.log", "records.tar.gz", "summary.json", "environment.txt"
SUMMARY_FORMAT = "correctness.gpu-check-summary"
EXIT_OK, EXIT_NO_EVIDENCE, EXIT_REFUSED = 0, 1, 2


@dataclass(frozen=True)
class Module:
    """A test module and its time limit."""

    path: Path
    limit: float

    @property
    def name(self) -> str:
        return self.path.name


@dataclass
class ModuleRun:
    """What became of a module: `passed`, `failed`, `no tests`, `stopped at its limit`, `broke`
    (pytest's exit code names how) or `skipped` (the reason says why)."""

    module: str
    limit: float
    status: str
    seconds: float = 0.0
    exit_code: int | None = None
    reason: str | None = None
    environment: dict[str, str] = field(default_factory=dict)


def plan(tests: Path, limits: Mapping[str, float], megatron: bool) -> list[Module]:
    """The test modules of `tests` in the order they run (FIRST, then MEGATRON_FIRST where
    `megatron`, then the rest by name), each with its limit (`limits`, else MODULE_LIMITS, else
    DEFAULT_MODULE_LIMIT)."""
    paths = {path.name: path for path in sorted(Path(tests).glob("test_*.py"))}
    first = [*FIRST, MEGATRON_FIRST] if megatron else list(FIRST)
    order = [name for name in first if name in paths] + [name for name in paths if name not in first]
    return [Module(paths[name], limits.get(name, MODULE_LIMITS.get(name, DEFAULT_MODULE_LIMIT))) for name in order]


def fits(module: Module, left: float, budget: float) -> str | None:
    """Why a module is skipped with `left` seconds of the budget left (None: it runs)."""
    if module.limit <= left:
        return None
    return f"its limit is {module.limit:g} s and {max(left, 0.0):.0f} s of the {budget:g} s budget are left"


def module_environment(module: Module) -> dict[str, str]:
    """What a module's process gets set before Python starts, beyond gpu-check's own environment."""
    from correctness.composites.determinism.mode import CUBLAS_WORKSPACE, CUBLAS_WORKSPACE_VALUE

    if module.name in DETERMINISTIC_MODULES and CUBLAS_WORKSPACE not in os.environ:
        return {CUBLAS_WORKSPACE: CUBLAS_WORKSPACE_VALUE}
    return {}


def with_stand_in(extra: list[str]) -> list[str]:
    """The pytest arguments, with DEFAULT_STAND_IN where they name no stand-in of their own."""
    from correctness.tiers import STAND_IN_OPTION

    named = any(argument == STAND_IN_OPTION or argument.startswith(f"{STAND_IN_OPTION}=") for argument in extra)
    return list(extra) if named else [STAND_IN_OPTION, DEFAULT_STAND_IN, *extra]


def gpu_markers() -> str:
    """The marker expression of every tier that needs a GPU or megatron-core (correctness.tiers)."""
    from correctness.tiers import cuda_only_markers

    return " or ".join(dict.fromkeys((*cuda_only_markers(), "megatron")))


class Log:
    """gpu-check's log: every line goes to the log file and to stdout."""

    def __init__(self, file: TextIO) -> None:
        self.file = file
        self.lock = threading.Lock()

    def write(self, text: str) -> None:
        with self.lock:
            self.file.write(text)
            self.file.flush()
            sys.stdout.write(text)
            sys.stdout.flush()

    def line(self, text: str) -> None:
        self.write(f"gpu-check: {text}\n")


def _pump(stream, log: Log) -> None:
    for line in iter(stream.readline, ""):
        log.write(line)


def pytest_command(module: Module, marker: str, results: Path, extra: Iterable[str]) -> list[str]:
    hang_dump = max(1.0, module.limit - FAULTHANDLER_LEAD)
    # --results-dir=PATH in one argument: pytest would take a separate PATH for a test path, and
    # place its rootdir above both.
    return [sys.executable, "-m", "pytest", str(module.path), "-m", marker, f"--results-dir={results}",
            "-p", "no:cacheprovider", "-rs", "-o", f"faulthandler_timeout={hang_dump:g}", *extra]


def run_module(module: Module, command: list[str], environment: dict[str, str], log: Log, grace: float) -> ModuleRun:
    """Run one module's pytest process (a process group of its own) within its limit: SIGINT at the
    limit, SIGKILL to its group `grace` seconds later."""
    started = time.monotonic()
    process = subprocess.Popen(command, cwd=ROOT, env={**os.environ, **environment}, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
    pump = threading.Thread(target=_pump, args=(process.stdout, log), daemon=True)
    pump.start()
    stopped = False
    try:
        process.wait(timeout=module.limit)
    except subprocess.TimeoutExpired:
        stopped = True
        log.line(f"{module.name} stopped at its {module.limit:g} s limit (SIGINT)")
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            log.line(f"{module.name} still running {grace:g} s after SIGINT: killed (SIGKILL)")
    finally:
        _kill_group(process)
    pump.join(OUTPUT_DRAIN)
    seconds = time.monotonic() - started
    return ModuleRun(module=module.name, limit=module.limit, status=_status(process.returncode, stopped),
                     seconds=round(seconds, 1), exit_code=process.returncode, environment=environment)


def _kill_group(process: subprocess.Popen) -> None:
    """End what is left of a module's process group (its own ranks, a hung pytest)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


def _status(exit_code: int, stopped: bool) -> str:
    if stopped:
        return "stopped at its limit"
    return {0: "passed", 1: "failed", 5: "no tests"}.get(exit_code, "broke")


def run_modules(modules: list[Module], budget: float, run, runs: list[ModuleRun]) -> None:
    """Each module run by `run(module)` (a ModuleRun) while its limit fits in what is left of the
    budget, the others skipped with the reason; appended to `runs` as each ends (a gpu-check
    stopped part way keeps those)."""
    started = time.monotonic()
    for module in modules:
        reason = fits(module, budget - (time.monotonic() - started), budget)
        runs.append(ModuleRun(module=module.name, limit=module.limit, status="skipped", reason=reason)
                    if reason else run(module))


# Packing


def pack_records(results: Path, archive: Path) -> list[str]:
    """Turn the case logs of killed modules into records (correctness.record_store), and pack every
    record under `results` into one tar.gz (its members under records/); return their names."""
    from correctness.record_store import recover_case_logs

    recover_case_logs(results)
    names = []
    with tarfile.open(archive, "w:gz") as tar:
        for path in record_files(results):
            name = f"records/{path.relative_to(results).as_posix()}"
            tar.add(path, arcname=name, recursive=False)
            names.append(name)
    return names


def record_files(results: Path) -> list[Path]:
    """The records under `results`, those kept beside in `.interrupted/` and `.partial/` included;
    not the workers' parts, temporary files or locks."""
    if not results.is_dir():
        return []
    return [path for path in sorted(results.rglob("*.json"))
            if not path.name.startswith(".") and ".parts" not in path.relative_to(results).parts]


# The summary


def record_summary(name: str, record: Mapping[str, Any]) -> dict[str, Any]:
    """One record, as the summary gives it."""
    ran = [case for case in record["cases"] if case.get("candidate")]
    figures = [tensor.get("error_over_bound") for case in ran for tensor in case["candidate"]["tensors"]]
    finite = [figure for figure in figures if figure is not None]
    return {
        "file": name,
        "record_id": record["lever"]["record_id"],
        "tier": record["lever"]["tier"],
        "device_type": record["lever"]["device"],
        "candidate": record["lever"]["candidate"],
        "verdict": record["verdict"],
        "interrupted": record["interrupted"],
        "cases": dict(Counter(case["status"] for case in record["cases"])),
        "worst_error_over_bound": max(finite) if finite and len(finite) == len(figures) else None,
        "non_finite_figures": len(figures) - len(finite),
        "backends": sorted({case["candidate"]["run"]["backend"] for case in ran}),
        "device": record["provenance"]["device"],
        "versions": {key: value for key, value in record["provenance"].items() if key not in ("device", "workers")},
    }


def lever_summaries(results: Path) -> dict[str, Any]:
    """Per lever: its records as record_summary gives them, and its verdict (the weakest of its
    records that were not interrupted; `interrupted` where it has only such)."""
    from correctness.results import weakest

    levers: dict[str, Any] = {}
    for path in record_files(results):
        record = json.loads(path.read_text(encoding="utf-8"))
        name = f"records/{path.relative_to(results).as_posix()}"
        levers.setdefault(record["lever"]["name"], {"records": []})["records"].append(record_summary(name, record))
    for lever in levers.values():
        whole = [record["verdict"] for record in lever["records"] if not record["interrupted"]]
        lever["verdict"] = weakest(whole) if whole else "interrupted"
    return levers


def decided_cases(levers: Mapping[str, Any], any_device: bool) -> int:
    """The cases that ran to a verdict, on a GPU (or anywhere, `any_device`)."""
    from correctness.results import FAIL, RAN

    decided = (*RAN, FAIL)
    return sum(count for lever in levers.values() for record in lever["records"]
               if any_device or record["device_type"] == "cuda"
               for status, count in record["cases"].items() if status in decided)


def outcome(runs: list[ModuleRun], levers: Mapping[str, Any], rehearsal: bool) -> tuple[int, str]:
    """gpu-check's exit status, and why in one line."""
    decided = decided_cases(levers, any_device=rehearsal)
    failed = [run.module for run in runs if run.status == "failed"]
    stopped = [run.module for run in runs if run.status in ("stopped at its limit", "broke")]
    kind = "rehearsal case" if rehearsal else "GPU case"
    if not decided:
        return EXIT_NO_EVIDENCE, f"no {kind} passed or failed: this run is no evidence (the log says why)"
    counted = f"{decided} {kind}{'s' if decided != 1 else ''} ran to a verdict"
    problems = [f"failures in {', '.join(failed)}"] * bool(failed) + [f"{', '.join(stopped)} did not finish"] * bool(stopped)
    if problems:
        return EXIT_NO_EVIDENCE, f"{counted}; {'; '.join(problems)}"
    return EXIT_OK, f"{counted}, none failed"


def write_summary(path: Path, summary: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(summary, indent=1, allow_nan=False) + "\n", encoding="utf-8")


# The command


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line refusal (exit 2): its usage block is for --help."""

    def error(self, message: str):
        where = "; pytest's arguments go after --" if message.startswith("unrecognized arguments") else ""
        self.exit(EXIT_REFUSED, f"gpu-check: {message}{where} (see scripts/gpu-check --help)\n")


def parse_arguments(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """gpu-check's options, and the pytest arguments (those after `--`). Refused in one line, before
    anything runs or is written: an option it does not know, an OUT that is a file or a folder
    holding anything (its files would come back beside the run's, past the eight the machine
    returns), a --tests or --records that is not a folder."""
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = _Parser(prog="scripts/gpu-check", description="Run the GPU tiers and pack their evidence.",
                     epilog="Arguments after -- go to every module's pytest (-- -k sdpa, -- --levers NAME).")
    parser.add_argument("out", nargs="?", default="results-gpu",
                        help="the output folder, new or empty (default results-gpu)")
    parser.add_argument("--budget", type=_seconds, default=None,
                        help=f"seconds for every module together (default ${BUDGET_ENV} or {DEFAULT_BUDGET:g})")
    parser.add_argument("--module-limit", action="append", default=[], type=_module_limit, metavar="MODULE=SECONDS",
                        help="a module's own time limit")
    parser.add_argument("--grace", type=_seconds, default=GRACE, help="seconds from SIGINT to SIGKILL at a module's limit")
    parser.add_argument("--records", type=Path, default=None,
                        help="where the records go before they are packed (default: a temporary folder, removed)")
    parser.add_argument("--rehearsal", action="store_true",
                        help=f"run on the CPU, on an emulated GPU ({EMULATE_OPTION}, default {REHEARSAL_GPU})")
    parser.add_argument(EMULATE_OPTION, type=emulated_option, default=None, metavar="GPU",
                        help=f"the emulated GPU of a rehearsal (H100, H200; H200x1 for one; default {REHEARSAL_GPU})")
    parser.add_argument("--tests", type=Path, default=DEFAULT_TESTS, help="the folder of test modules")
    parser.add_argument("--marker", default=None, help="the tests' marker expression (default: the GPU tiers')")
    args = parser.parse_args(own)
    for problem in (_output_problem(Path(args.out)), _folder_problem(args.tests, "--tests", must_exist=True),
                    _folder_problem(args.records, "--records", must_exist=False)):
        if problem:
            parser.error(problem)
    if args.budget is None:
        args.budget = _budget_from_environment(parser)
    if args.emulate_gpu is not None and not args.rehearsal:
        parser.error(f"{EMULATE_OPTION} is for a rehearsal on the CPU (--rehearsal)")
    if args.rehearsal and args.emulate_gpu is None:
        args.emulate_gpu = emulated_option(REHEARSAL_GPU)
    return args, extra


def _output_problem(out: Path) -> str | None:
    """Why OUT cannot take the run's files (None: it can): it must be an empty folder, or a new one
    whose nearest existing parent is a folder."""
    if out.is_dir():
        try:
            held = sorted(os.listdir(out))
        except OSError as error:
            return f"OUT {out}: cannot be read ({error.strerror or error})"
        if held:
            shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
            return f"OUT {out}: not empty ({shown}); give a new or empty folder: only this run's files come back"
        return None
    if out.exists() or out.is_symlink():
        return f"OUT {out}: not a folder; give a new or empty folder"
    existing = next(path for path in out.absolute().parents if path.exists())
    return None if existing.is_dir() else f"OUT {out}: {existing} is not a folder"


def _folder_problem(folder: Path | None, option: str, must_exist: bool) -> str | None:
    """Why `folder` (an option's) is no folder it can use (None: it is one, or may be made)."""
    if folder is None or folder.is_dir() or (not must_exist and not folder.exists()):
        return None
    return f"{option} {folder}: {'not a folder' if folder.exists() else 'no such folder'}"


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def _module_limit(text: str) -> tuple[str, float]:
    name, equals, seconds = text.partition("=")
    if not equals or not name:
        raise argparse.ArgumentTypeError(f"{text!r} is not MODULE=SECONDS")
    return name, _seconds(seconds)


def _budget_from_environment(parser: argparse.ArgumentParser) -> float:
    given = os.environ.get(BUDGET_ENV)
    if given is None:
        return DEFAULT_BUDGET
    try:
        return _seconds(given)
    except argparse.ArgumentTypeError as error:
        parser.error(f"${BUDGET_ENV}: {error}")


def preflight(report: Path, rehearsal: bool) -> int:
    """scripts/gpu_preflight.py: refuses in one line where CUDA is not visible (outside a
    rehearsal), and writes nothing then; else writes the environment report."""
    command = [sys.executable, str(ROOT / "scripts/gpu_preflight.py"), "--report", str(report)]
    # Its lines on optional modules are in the report: only a refusal (stderr) is shown.
    return subprocess.run(command + ([] if rehearsal else ["--require-cuda"]), cwd=ROOT, stdout=subprocess.DEVNULL,
                          check=False).returncode


def _stop_on_sigterm(number, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_arguments(sys.argv[1:] if argv is None else argv)
    out = Path(args.out)
    started = datetime.datetime.now(datetime.timezone.utc)
    if preflight(out / ENVIRONMENT, args.rehearsal) != 0:
        return EXIT_REFUSED
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    results = args.records or Path(tempfile.mkdtemp(prefix="gpu-check-records-"))
    try:
        with open(out / LOG, "w", encoding="utf-8") as file:
            return check(args, extra, out, results, Log(file), started)
    finally:
        if args.records is None:
            shutil.rmtree(results, ignore_errors=True)


def check(args, extra: list[str], out: Path, results: Path, log: Log, started: datetime.datetime) -> int:
    """Run the modules, pack their records and write the summary; the exit status."""
    marker = args.marker or gpu_markers()
    megatron = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None
    modules = plan(args.tests, dict(args.module_limit), megatron)
    extra = with_stand_in(extra)
    if args.rehearsal:
        extra = [EMULATE_OPTION, args.emulate_gpu.spec, *extra]
    rehearsed = f", a rehearsal on the CPU on an emulated {args.emulate_gpu.spec}" if args.rehearsal else ""
    log.line(f"{started.isoformat(timespec='seconds')}, budget {args.budget:g} s, {len(modules)} modules of"
             f" {args.tests}, marker {marker!r}{rehearsed}")

    def run(module: Module) -> ModuleRun:
        environment = module_environment(module)
        log.line(f"{module.name}: up to {module.limit:g} s" + "".join(f", {k}={v}" for k, v in environment.items()))
        done = run_module(module, pytest_command(module, marker, results, extra), environment, log, args.grace)
        log.line(f"{module.name}: {done.status} in {done.seconds:g} s (exit code {done.exit_code})")
        return done

    runs: list[ModuleRun] = []
    try:
        run_modules(modules, args.budget, run, runs)
    except KeyboardInterrupt:
        log.line("stopped (SIGINT or SIGTERM): packing what the modules that ran wrote")
    for skipped in (run for run in runs if run.status == "skipped"):
        log.line(f"{skipped.module}: skipped: {skipped.reason}")
    packed = pack_records(results, out / RECORDS)
    levers = lever_summaries(results)
    code, why = outcome(runs, levers, args.rehearsal)
    write_summary(out / SUMMARY, {
        "format": SUMMARY_FORMAT, "version": 1, "started": started.isoformat(timespec="seconds"),
        "seconds": round((datetime.datetime.now(datetime.timezone.utc) - started).total_seconds(), 1),
        "budget_seconds": args.budget, "rehearsal": args.rehearsal,
        "emulated_gpu": args.emulate_gpu.spec if args.rehearsal else None, "tests": str(args.tests), "marker": marker,
        "exit_code": code, "outcome": why, "modules": [asdict(run) for run in runs], "records": packed,
        "levers": levers,
    })
    log.line(f"{why}; {len(packed)} records in {RECORDS}, with {SUMMARY}, {ENVIRONMENT} and {LOG} in {out}")
    return code


if __name__ == "__main__":
    sys.exit(main())
