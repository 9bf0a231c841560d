"""Judge a recipe: run the component tests its numerics changes need (pytest underneath, the same
markers), write their records and give the recipe's verdict.

    correctness run RECIPE.yaml [--tier auto|cpu|gpu] [--reference REFERENCE.yaml] [--all-levers]
                    [--results-dir DIR] [--workers N] [--model-config CONFIG] [--scale smoke|recipe]
                    [--checkpoint-cases DIR] [--model-checkpoint DIR] [--gpu-stand-in PRESENT=RECIPE]
                    [--emulate-gpu GPU] [--report] [--json] [-- PYTEST ARGS...]

The recipe is judged on what it changed against its reference (fixtures/references/<id>.yaml, or
--reference), as `correctness classify` classes the changes; without a reference, on the numerics
arguments it sets to anything but Megatron's default, and it says so. The levers those changes
need run at the recipe's shapes (from the recipe and its model's facts: the suite's own, or those
of --model-config, the model's Hugging Face config.json), and their records give the recipe's
verdict (correctness.recipe_verdict): pass, fail, or incomplete (a needed lever that did not run
or finish, a format-limited lever without a passing convergence block, a numerics change without
a lever). --all-levers runs every lever that applies to the model as well, in a section of its
own: those verdicts are evidence about flags the recipe did not change, never the recipe's.

`auto` runs the GPU tiers where a CUDA device is present (the recipe's GPU marker, and `gpu`) and
the CPU tiers otherwise (those without a marker that only CUDA tiers carry, Megatron's optimizer on
the CPU included); both expressions are built from the tiers (correctness.tiers). `--tier gpu`
where torch sees no CUDA GPU is refused in one line. `--gpu-stand-in h200=h100` lets a GPU of the
recipe GPU's architecture run its tiers (an H200 for an H100 recipe); the records say so, and
`correctness check` counts such results as stand-in, never as the recipe GPU's own. With several
GPUs the cases are spread over them, one GPU per pytest-xdist worker (install the `parallel`
extra); the workers' records are merged into one per lever. pytest prints its progress and, at the
end, the recipe's verdict and a verdict table per lever.

--emulate-gpu H100 (or H200; H200x1 for one GPU) runs the GPU tiers on an emulated GPU on the CPU
(correctness.emulated_gpu), at the smoke scale: a rehearsal of their code paths before a GPU is
lent. Their records are kept in `.emulated/` beside the lever records, `attach` refuses them, and no
reader counts them, so the recipe stays incomplete (exit 1) however its levers' rehearsals went;
--json lists each record's verdict.

--scale recipe runs the CPU tiers at the recipe's rank-local shapes in place of their smoke shapes
(a GPU tier's shapes are its own either way). A lever whose case would need more memory than this
machine has available skips in one line naming the memory it needs, so the lever is incomplete
here (benchmarks/recipe_scale.py: each lever's time and peak memory at the recipe scale).

--report writes the report of the records the run wrote (`correctness report`: one self-contained
HTML page) as report.html in the recipe's records folder, and prints its path.

Before any test starts it checks what would otherwise fail late: the recipe against the schema, its
reference, the model's facts, that the results folder takes a file, and that the levers can be
built from the recipe (a quiet collection: a shape that does not split over the recipe's TP size
fails there). Each is refused in one line.

--json: stdout holds one JSON object and nothing else (pytest's report goes to stderr):
{"recipe", "recipe_file", "tier", "markers", "levers", "results_dir", "pytest": {"arguments",
"exit_code", "outcome"} (null where no test was needed), "records": [{"lever", "tier", "record_id",
"verdict", "for_recipe", "why", "cases": {status: count}, "interrupted", "path"}], "report" (with
--report: its path, null where no record was written), "verdict":
{"recipe", "verdict", "against", "changes", "levers", "not_changed", "other_changes",
"convergence_passes"}, "exit_status", "exit_reason"}. A record's `for_recipe` is its verdict over
the cases of the setting the recipe runs (null where no change of the recipe needs its lever), and
`why` says why it differs from the lever's own `verdict`; `exit_reason` says in one sentence why the
exit status is what it is (a failing record beside exit status 0 is one of those).

Ctrl-C (SIGINT) or SIGTERM at any point stops the run in order: no test starts after it (one in the
quiet collection included), the session writes the records of what ran (a lever it did not finish
kept beside its complete record: correctness.record_store), the ranks, the rank server and the
temporary folders go, and the command exits 130 (SIGINT) or 143 (SIGTERM), as a shell reports a
process the signal ended. With --json a run stopped during its session still prints its object (its
records' `interrupted` saying which lever runs it cut short), with that exit status.

Exit status: 0 the recipe passes; 1 it fails or is incomplete; 2 bad input, or pytest stopped;
130 / 143 stopped by SIGINT / SIGTERM.
"""

import contextlib
import importlib.util
import io
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from correctness.commands import EXIT_BAD_INPUT, EXIT_FAIL, EXIT_OK, emit, non_negative_int
from correctness.distributed import InterruptionWatch, catch_stop_signals, stop_exit_status
from correctness.emulated_gpu.gpus import OPTION as EMULATE_OPTION
from correctness.emulated_gpu.gpus import emulated_option
from correctness.errors import CorrectnessError, RecipeError
from correctness.lever import SCALES
from correctness.files import output_target, shown_path
from correctness.fixtures import COMPONENT_TESTS_DIR, checkout_root
from correctness.model_arguments import ModelArgumentError
from correctness.models import facts_for, load_facts
from correctness.recipe_verdict import RecipeVerdict, judge_recipe, needed_levers, recipe_changes, tier_label, verdict_lines
from correctness.recipes import Recipe, load_recipe, validate_recipe
from correctness.report import fit_lines
from correctness.results import PASS, records_folder
from correctness.tiers import (  # not via the plugin: see tiers.py
    CPU_TIER, GPU, GPU_MARKERS, REQUIRE_TIERS_OPTION, STAND_IN_OPTION, recipe_gpu_tier, require_visible_gpu,
    required_tiers, stand_in_option,
)

COMPONENT_TESTS = COMPONENT_TESTS_DIR  # the checkout's component_tests/, or the installed package's
PLUGIN = "correctness.pytest_plugin"  # the checkout's conftest.py loads it too; pytest loads it once
COLLECT_ONLY = {"--collect-only", "--co"}  # pytest arguments after -- that only list the tests


def add_arguments(parser) -> None:
    parser.add_argument("recipe", metavar="RECIPE.yaml")
    parser.add_argument("--tier", choices=("auto", "cpu", "gpu"), default="auto")
    parser.add_argument("--reference", metavar="REFERENCE.yaml",
                        help="the reference recipe (or its run script) the recipe's changes are against (default:"
                        " fixtures/references/<recipe id>.yaml where it exists, else Megatron's defaults)")
    parser.add_argument("--all-levers", action="store_true",
                        help="run every lever that applies to the model too, as a catalogue apart from the verdict")
    parser.add_argument("--results-dir", help="where the records go (default: results/ in the checkout, or in the current folder when installed)")
    parser.add_argument("--workers", type=non_negative_int, default=None, metavar="N",
                        help="pytest-xdist workers, 0 or more (default: one per GPU where there are several)")
    parser.add_argument("--checkpoint-cases", help="folder of captured attention inputs")
    parser.add_argument("--model-checkpoint", help="the model's Hugging Face checkpoint folder")
    parser.add_argument("--model-config", metavar="CONFIG",
                        help="the model's Hugging Face config.json (or its folder, or a facts file from"
                        " `correctness model-facts`), for a model the suite has no facts of")
    parser.add_argument("--strict-systematic", action="store_true",
                        help="fail a case whose candidate shows a systematic error (scale slope or offset)")
    parser.add_argument("--scale", choices=SCALES, default="smoke",
                        help="the CPU tiers' shapes: smoke (default) or recipe (the recipe's rank-local shapes; a lever"
                        " whose case would need more memory than this machine has skips, naming it, and so is incomplete)")
    parser.add_argument(REQUIRE_TIERS_OPTION, type=required_tiers, default=None, metavar="TIER,...",
                        help="tiers that must run (cpu,megatron-cpu): a test of one that would skip for a missing"
                        " dependency fails instead")
    parser.add_argument("--report", action="store_true",
                        help="write the report of the records the run wrote (`correctness report`) beside them,"
                        " as report.html, and print its path")
    parser.add_argument(STAND_IN_OPTION, type=stand_in_option, default=None, metavar="PRESENT=RECIPE",
                        help="let this GPU run the recipe GPU's tiers in its place, one of its architecture (h200=h100);"
                        " the records say so, and `correctness check` counts them as stand-in only")
    parser.add_argument(EMULATE_OPTION, type=emulated_option, default=None, metavar="GPU",
                        help="run the GPU tiers on an emulated GPU on the CPU (H100, H200; H200x1 for one): a rehearsal"
                        " of their code paths at the smoke scale, never evidence (the recipe stays incomplete)")


def markers(recipe, tier: str, emulated: bool = False) -> str:
    if tier == "auto":
        tier = "gpu" if torch.cuda.is_available() or emulated else "cpu"
    if tier == "cpu":
        return CPU_TIER
    return gpu_selection(recipe.gpu)


def gpu_selection(gpu: str) -> str:
    """The GPU tiers on a recipe's GPU: those that run on any CUDA GPU (marked `gpu`, Megatron's
    optimizer on a GPU included) and the recipe GPU's own tier, by the marker naming its GPU."""
    own = recipe_gpu_tier(gpu).markers if gpu.lower() in GPU_MARKERS else ()
    return " or ".join([*GPU.markers, *(marker for marker in own if marker in GPU_MARKERS)])


def default_results() -> Path:
    """results/ in the checkout (the plugin's default, <rootdir>/results), and results/ in the
    current folder where the component tests were installed from a wheel."""
    root = checkout_root()
    return root / "results" if root is not None else Path.cwd() / "results"


def writable_folder(path: Path) -> Path:
    """The results folder, made if missing, once a probe file was written in it and removed: a
    folder the records cannot go to (read-only, a file in its place, a full disk) is refused before
    the tests run, where the plugin would find it only after the last one."""
    label = f"results folder {path}"
    if path.exists() and not path.is_dir():
        raise CorrectnessError(f"{label}: not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
        descriptor, probe = tempfile.mkstemp(prefix=".correctness-probe-", dir=path)
        try:
            os.write(descriptor, b"\n")
        finally:
            os.close(descriptor)
            os.unlink(probe)
    except OSError as error:
        raise CorrectnessError(f"{label}: cannot be written ({error.strerror or error})") from None
    return path


class _Collection(InterruptionWatch):
    """pytest plugin for the quiet collection before the run. The plugin builds each test's levers
    from the recipe at collection (pytest_generate_tests), so a recipe they cannot use fails there,
    as a collection error with a traceback among pytest's report: this keeps the CorrectnessError
    of each such collector, for one line before any test starts."""

    def __init__(self) -> None:
        super().__init__()
        self.errors: list[str] = []
        self.selected = 0

    @pytest.hookimpl(wrapper=True)
    def pytest_make_collect_report(self, collector):
        report = yield
        call = getattr(report, "call", None)  # pytest's own report carries it (see collect_one_node)
        error = call.excinfo.value if call is not None and call.excinfo is not None else None
        if isinstance(error, CorrectnessError):
            self.errors.append(str(error))
        return report

    def pytest_collection_finish(self, session) -> None:
        self.selected = len(session.items)


class _Summary(InterruptionWatch):
    """pytest plugin: the records the session wrote, and the recipe's verdict the plugin gave
    (None where the session stopped before it could judge)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[dict, Path]] = []
        self.verdict: RecipeVerdict | None = None
        self.error: CorrectnessError | None = None

    def pytest_unconfigure(self, config) -> None:
        # Imported here, once pytest has imported (and assertion-rewritten) the plugin itself.
        from correctness.pytest_plugin import recipe_verdict, written_records

        self.records = written_records(config)
        try:
            self.verdict = recipe_verdict(config)
        except CorrectnessError as error:  # raised once pytest is done: hooks do not take exceptions well
            self.error = error


@contextlib.contextmanager
def _report_to_stderr(active: bool):
    """With --json, stdout carries the JSON alone: meanwhile pytest's report, and whatever a test
    writes, even to the file descriptor, go to stderr."""
    if not active:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _record_summary(record: dict[str, Any], path: Path, verdict: RecipeVerdict) -> dict[str, Any]:
    """A record as --json lists it: its lever's verdict, and whether and how it counts for the
    recipe's (`for_recipe`: the verdict of its cases the recipe runs; null where no change of the
    recipe needs its lever), with the reason where the two differ."""
    cases: dict[str, int] = {}
    for case in record.get("cases", []):
        cases[case.get("status")] = cases.get(case.get("status"), 0) + 1
    lever = record.get("lever", {})
    needed = next((evidence for evidence in verdict.levers if evidence.lever == lever.get("name")), None)
    for_recipe = None if needed is None else dict(needed.tiers).get(tier_label(lever, record.get("provenance", {})))
    if needed is None:
        why = "no change of the recipe needs this lever: evidence about flags it did not change, not its verdict"
    elif for_recipe != record.get("verdict"):
        why = (f"the lever's verdict is {record.get('verdict')} over all its cases; the cases of the setting the"
               f" recipe runs give {for_recipe}, which the recipe's verdict takes")
    else:
        why = None
    return {"lever": lever.get("name"), "tier": lever.get("tier"), "record_id": lever.get("record_id"),
            "verdict": record.get("verdict"), "for_recipe": for_recipe, "why": why, "cases": cases,
            "interrupted": record.get("interrupted"), "path": str(path)}


def exit_reason(code: int, verdict: RecipeVerdict, records: list[dict[str, Any]]) -> str:
    """Why `correctness run` exits with `code`, in one sentence (--json's `exit_reason`)."""
    if code in (EXIT_OK, EXIT_FAIL):
        reason = f"the recipe's verdict is {verdict.verdict}"
        apart = [record for record in records if record["why"] and record["verdict"] != PASS]
        if apart:
            reason += (f"; {len(apart)} record{'s' if len(apart) > 1 else ''} whose lever verdict is not pass"
                       " count for it only as their `for_recipe` says (see `why`)")
        return reason
    if code == EXIT_BAD_INPUT:
        return "bad input, or pytest stopped before the recipe could be judged (see stderr)"
    return f"stopped by a signal (exit status {code}) before the recipe could be judged"


def run(args) -> int:
    """Judge the recipe (the module's docstring); a signal stops it in order, with its exit status."""
    restore_signals = catch_stop_signals()
    try:
        return _judge(args)
    except KeyboardInterrupt as interruption:
        status = stop_exit_status(interruption)
        if status is None:
            raise
        return _stopped(status)
    finally:
        restore_signals()


def _stopped(status: int) -> int:
    print(f"correctness run: stopped by {signal.Signals(status - 128).name}", file=sys.stderr)
    return status


def _judge(args) -> int:
    emulated = getattr(args, "emulate_gpu", None)
    if emulated is not None and args.tier == "cpu":
        raise CorrectnessError(f"{EMULATE_OPTION} runs the GPU tiers on an emulated GPU; --tier cpu runs none of them")
    if args.tier == "gpu" and emulated is None:  # every GPU case would skip without one: a green no-op
        require_visible_gpu("correctness run --tier gpu")
    recipe = load_recipe(args.recipe)
    validate_recipe(recipe.data, recipe.id)
    try:
        facts_for(recipe, load_facts(args.model_config) if args.model_config else None)
    except ModelArgumentError:  # names the recipe already
        raise
    except RecipeError as error:
        raise RecipeError(f"recipe {recipe.id}: {error}") from None
    classification = recipe_changes(recipe, args.reference)
    needed = list(needed_levers(classification))
    results = writable_folder(Path(args.results_dir) if args.results_dir else default_results())
    if args.report:  # a report.html it may not replace is refused before the tests, not after them
        from correctness.report_page import REPORT_NAME

        report_path = records_folder({"id": recipe.ref.id, "path": recipe.ref.path}, results) / REPORT_NAME
        output_target(report_path, f"report {report_path}", [args.recipe])
    selection = markers(recipe, args.tier, emulated is not None)
    report = {"recipe": recipe.id, "recipe_file": str(args.recipe), "tier": args.tier, "markers": selection,
              "levers": "all" if args.all_levers else needed, "results_dir": str(results), "pytest": None,
              "records": []}
    if not needed and not args.all_levers:
        if args.report:
            report["report"] = _write_report(args, recipe, results, [])
        verdict = judge_recipe(recipe, classification, [])
        with _report_to_stderr(args.json):
            lines = verdict_lines(verdict, recipe.gpu)
            print("\n".join(lines if args.wide else fit_lines(lines)), flush=True)
        return _finish(args, report, verdict, EXIT_OK if verdict.verdict == PASS else EXIT_FAIL)

    selected = _pytest_selection(args, selection, results, needed)
    # The verdicts say what skipped and why: pytest's own summary lists failures only, and not the
    # libraries' import warnings (megatron-core's, torch's), whose lines run to 350 characters.
    command = [*selected, "-rfE", "--disable-warnings"]
    # One worker per GPU; an emulated GPU's are all this CPU's, so one process.
    workers = args.workers if args.workers is not None else (
        torch.cuda.device_count() if args.tier != "cpu" and emulated is None else 0)
    if workers > 1:
        if importlib.util.find_spec("xdist") is None:
            raise CorrectnessError(f"{workers} workers need pytest-xdist: pip install -e '.[parallel]'")
        command += ["-n", str(workers)]
    stopped = _collect(args, recipe, selected, selection)
    if stopped is not None:
        return stopped

    summary = _Summary()
    with _report_to_stderr(args.json):
        shown = f"correctness run {recipe.id}: pytest {' '.join(command)}"
        print("\n".join([shown] if args.wide else fit_lines([shown])), flush=True)
        status = pytest.main(command + list(args.passthrough), plugins=[summary])
    try:
        status = pytest.ExitCode(status)
    except ValueError:  # a plugin's own exit code
        pass
    if summary.error is not None:
        raise summary.error
    verdict = summary.verdict or judge_recipe(recipe, classification, [])  # stopped early: nothing judged
    code = _exit_code(args, recipe, summary, status, verdict)
    outcome = "interrupted" if summary.exit_status is not None else status.name.lower() if isinstance(
        status, pytest.ExitCode) else None
    report["pytest"] = {"arguments": command + list(args.passthrough), "exit_code": int(status), "outcome": outcome}
    report["records"] = [_record_summary(record, path, verdict) for record, path in summary.records]
    if args.report:
        report["report"] = _write_report(args, recipe, results, summary.records)
    return _finish(args, report, verdict, code)


def _write_report(args, recipe: Recipe, results: Path, written: list[tuple[dict, Path]]) -> str | None:
    """The report of the records the run wrote, in the recipe's records folder; its path, printed
    (in --json's object instead). None where the run wrote no record."""
    from correctness.report_page import REPORT_NAME, load_records, render_reports, report_inputs, write_reports

    if not written:
        print(f"correctness run: no record was written, so no report for {recipe.id}", file=sys.stderr)
        return None
    target = records_folder(written[0][0]["recipe"], results) / REPORT_NAME
    records = load_records([path for _, path in written])
    (rendered,) = render_reports(records, target)
    write_reports([rendered], report_inputs(records, [args.recipe]))
    if not args.json:
        print(f"report: {shown_path(rendered.path)}", flush=True)
    return str(rendered.path)


def _pytest_selection(args, selection: str, results: Path, needed: list[str]) -> list[str]:
    """pytest's arguments that select and configure the recipe's component tests."""
    selected = [str(COMPONENT_TESTS), "-p", PLUGIN, "--recipe", str(args.recipe), "-m", selection, "--results-dir", str(results)]
    if not args.all_levers:
        selected += ["--levers", ",".join(needed)]
    for option in ("checkpoint_cases", "model_checkpoint", "model_config", "reference"):
        value = getattr(args, option)
        if value:
            selected += [f"--{option.replace('_', '-')}", value]
    selected += [flag for flag, wanted in (("--strict-systematic", args.strict_systematic), ("--wide", args.wide)) if wanted]
    if args.scale != "smoke":
        selected += ["--scale", args.scale]
    if getattr(args, "require_tiers", None):
        selected += [REQUIRE_TIERS_OPTION, ",".join(sorted(args.require_tiers))]
    stand_in = getattr(args, "gpu_stand_in", None)
    if stand_in is not None:
        selected += [STAND_IN_OPTION, f"{stand_in.present.lower()}={stand_in.recipe.lower()}"]
    emulated = getattr(args, "emulate_gpu", None)
    if emulated is not None:
        selected += [EMULATE_OPTION, emulated.spec]
    return selected


def _collect(args, recipe: Recipe, selected: list[str], selection: str) -> int | None:
    """Collects the tests quietly first: a test that cannot be built, or no test at all, is refused
    in one line before anything runs. The exit code where a signal stopped it; None to go on."""
    collection = _Collection()
    with contextlib.redirect_stdout(io.StringIO()):  # quiet: its report is the run's to print
        collected = pytest.main([*selected, "--collect-only", "-q", "-p", "no:cacheprovider"], plugins=[collection])
    if collection.exit_status is not None:
        return _stopped(collection.exit_status)
    if collection.errors:
        more = f" (and {len(collection.errors) - 1} more)" if len(collection.errors) > 1 else ""
        raise CorrectnessError(
            f"recipe {args.recipe}: the component tests cannot be built: {collection.errors[0]}{more}"
        )
    if collected == pytest.ExitCode.INTERRUPTED:
        raise CorrectnessError(f"recipe {args.recipe}: collecting the component tests was interrupted")
    if collected == pytest.ExitCode.NO_TESTS_COLLECTED:
        raise CorrectnessError(f"no component test selected for {recipe.model} on {recipe.gpu} ({selection})")
    return None


def _exit_code(args, recipe: Recipe, summary: _Summary, status: Any, verdict: RecipeVerdict) -> int:
    """The run's exit code from the verdict, a stop, or pytest's own status where nothing was judged."""
    code = EXIT_OK if summary.verdict is not None and verdict.verdict == PASS else EXIT_FAIL
    if summary.exit_status is not None:
        code = _stopped(summary.exit_status)
    elif COLLECT_ONLY & set(args.passthrough):  # nothing ran, nothing is judged: pytest's own status
        code = EXIT_OK if status == pytest.ExitCode.OK else EXIT_BAD_INPUT
    elif status == pytest.ExitCode.NO_TESTS_COLLECTED:
        code = EXIT_BAD_INPUT
        print(f"correctness run: no component test selected for {recipe.model} on {recipe.gpu}"
              f" by the arguments after --: {' '.join(args.passthrough)}", file=sys.stderr)
    elif status not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
        code = EXIT_BAD_INPUT
        outcome = status.name.lower().replace("_", " ") if isinstance(status, pytest.ExitCode) else "a plugin's code"
        print(f"correctness run: pytest stopped ({outcome}, exit status {int(status)}); see its report above",
              file=sys.stderr)
    return code


def _finish(args, report: dict[str, Any], verdict: RecipeVerdict, code: int) -> int:
    if args.json:
        emit(args, [], {**report, "verdict": verdict.to_dict(), "exit_status": code,
                        "exit_reason": exit_reason(code, verdict, report.get("records") or [])})
    return code
