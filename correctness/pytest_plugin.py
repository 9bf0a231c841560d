"""pytest integration: lever parametrisation, hardware markers, result records, verdict tables.

Load it from a conftest.py with `pytest_plugins = ("correctness.pytest_plugin",)`. A test module
then declares, per test, which levers it runs:

    @pytest.mark.levers(factory=partial(attention.cpu_tier, RECIPE), lever=attention.NAME)
    def test_attention_backend_cpu(lever, case, lever_check):
        lever_check(lever, case)

`levers(factory=..., lever=NAME)` (keywords: pytest would take a lone positional function for the
decorated test) calls factory(LeverOptions) at collection and parametrises (lever, case) over
every case of every lever returned, each marked with its lever's tier markers (correctness.tiers),
so that `pytest -m h100` selects the H100 tier's cases. The optional `lever` names the lever(s) the
factory builds (a name or a tuple of names; a lever of another name is refused), so that `--levers`
selects the test, and `correctness run` names its lever, even where the lever does not apply to
the recipe and the test only skips (the suite's own component tests all declare it). Each lever's cases are gathered into one JSON
record per run, written under --results-dir, and a verdict table per lever is printed at the end.

Hardware markers, a tier's or a test's own, skip (never fail) where the machine lacks what they name:
gpu (any CUDA device), h100 / h200 (that GPU), te (a usable Transformer Engine), megatron (a
usable megatron-core).

Stopping: from configure to unconfigure SIGINT and SIGTERM raise a KeyboardInterrupt
(correctness.distributed.Stopped), so that a session a signal stops still ends in order: its ranks
stopped and their folders removed, its records written, and its exit status the shell's for the
signal (130, 143) in place of pytest's 2. A lever run the session did not finish (a case it
selected has no result) is marked `interrupted`, and correctness.record_store keeps such a record,
or one that decided fewer cases, beside the lever's record, never in its place. The rank server a
session started (or any, where a signal stopped it) is ended at unconfigure.

A session killed outright (SIGKILL, a time limit) keeps its finished cases too: each case's result
is appended to a case log as the case finishes, and the next session on the same results folder
starts by turning such logs into records marked interrupted (correctness.record_store).
"""

import contextlib
import datetime
import hashlib
import os
import shutil
import time
import uuid
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch

from correctness.catalogue import lever_catalogue
from correctness.declaration import tier_levers
from correctness.distributed import InterruptionWatch, catch_stop_signals, rank_server_pid, stop_rank_server
from correctness.emulated_gpu.gpus import OPTION as EMULATE_OPTION
from correctness.emulated_gpu.gpus import emulated_option
from correctness.emulated_gpu.kernels import described
from correctness.emulated_gpu.kernels import snapshot as kernel_calls
from correctness.emulated_gpu.session import active as emulation_active
from correctness.errors import CorrectnessError, OverMemory
from correctness.files import shown_path
from correctness.harness import build_record, device_fault, not_run, run_case
from correctness.lever import SCALES, Case, Lever, LeverOptions, NotApplicable
from correctness.models import load_facts
from correctness.provenance import gpu_type
from correctness.report import case_report, fit_lines, verdict_table
from correctness.recipe_arguments import check_recipe
from correctness.recipes import load_recipe
from correctness.record_store import (append_cases, case_log_path, recover_case_logs, remove_case_logs,
                                      start_case_log, store_record, why_beside)
from correctness.results import (CaseResult, LeverRecord, case_to_json, file_name, merge_records, read_record,
                                 record_to_json, write_record)
from correctness.tiers import (GPU_MARKERS, REQUIRE_TIERS_OPTION, STAND_IN_OPTION, StandIn, cuda_only_markers,
                               required_tiers, stand_in_between, stand_in_option)

CHECKPOINT_ENV = "CORRECTNESS_CHECKPOINT_CASES"
MODEL_CHECKPOINT_ENV = "CORRECTNESS_MODEL_CHECKPOINT"
MARKERS = {
    "levers(factory=..., lever=NAME)": "parametrise (lever, case) over the levers factory(LeverOptions) returns"
    " (lever, optional: the name or names of those levers)",
    "gpu": "needs a CUDA GPU; skips without one",
    **{marker: f"needs an NVIDIA {gpu} (the recipe's GPU); skips elsewhere" for marker, gpu in GPU_MARKERS.items()},
    "te": "needs a usable Transformer Engine; skips with the reason where it is missing",
    "megatron": "needs a usable megatron-core; skips with the reason where it is missing",
    "te_cpu": "needs Transformer Engine 2.17's Python installed for the CPU (make install); skips with the reason",
}


def pytest_addoption(parser):
    group = parser.getgroup("correctness", "numerical-correctness component tests")
    group.addoption("--results-dir", default=None, help="where lever records go (default: <rootdir>/results)")
    group.addoption(
        "--checkpoint-cases",
        default=None,
        help=f"folder of captured attention inputs for the checkpoint cases (or set {CHECKPOINT_ENV})",
    )
    group.addoption(
        "--recipe",
        default=None,
        help="run every component test on this recipe file in place of the fixture recipes it names",
    )
    group.addoption(
        "--model-config",
        default=None,
        help="the recipe model's Hugging Face config.json (or its folder, or a model facts file from"
        " `correctness model-facts`), for a model the suite has no facts of",
    )
    group.addoption(
        "--strict-systematic",
        action="store_true",
        default=False,
        help="fail a case whose candidate the systematic-error diagnostic flags (by default it is reported only)",
    )
    group.addoption(
        "--scale", default="smoke", choices=SCALES,
        help="the CPU tiers' shapes: smoke (their own small shapes, the default) or recipe (the recipe's rank-local"
        " shapes; a lever whose case would need more memory than this machine has skips, naming it)",
    )
    group.addoption(
        "--wide",
        action="store_true",
        default=False,
        help="print the verdict tables with every figure, however wide (by default they fit in 120 columns)",
    )
    group.addoption(
        "--reference",
        default=None,
        help="the reference recipe (or its run script) --recipe is judged against (default: fixtures/references/<id>.yaml"
        " where it exists, else Megatron's defaults)",
    )
    group.addoption(
        "--levers",
        default=None,
        metavar="NAMES",
        help="run only these levers' component tests (comma-separated lever names, as `correctness levers` lists them)",
    )
    group.addoption(
        STAND_IN_OPTION, default=None, type=stand_in_option, metavar="PRESENT=RECIPE",
        help="let this GPU run a recipe GPU's tiers in its place, one of its architecture (h200=h100: an H200"
        " runs the H100 tiers); its records say so, and `correctness check` counts them as stand-in only",
    )
    group.addoption(
        "--model-checkpoint",
        default=None,
        help=f"the model's Hugging Face checkpoint folder, for checkpoint weights (or set {MODEL_CHECKPOINT_ENV})",
    )
    group.addoption(
        EMULATE_OPTION, default=None, type=emulated_option, metavar="GPU",
        help="run the GPU tiers on an emulated GPU on the CPU (H100 or H200, eight of them; H200x1 for one):"
        " proves their code paths, never a GPU's numbers; records say so, and attach refuses them",
    )
    group.addoption(
        REQUIRE_TIERS_OPTION, default=None, type=required_tiers, metavar="TIER,...",
        help="tiers that must run here (e.g. cpu,megatron-cpu): a test of one that would skip because the machine"
        " lacks what it needs (a missing megatron-core) fails instead, naming it",
    )


def pytest_configure(config):
    emulation = config.getoption("emulate_gpu", None)
    if emulation is not None:
        from correctness.emulated_gpu.session import emulated_gpu

        config.stash[_EMULATION] = contextlib.ExitStack()
        config.stash[_EMULATION].enter_context(emulated_gpu(emulation))
    config.pluginmanager.register(_SkipReasons(config.stash.setdefault(_SKIPS, {})), "correctness-skip-reasons")
    config.stash[_STOP] = _Stop(restore_signals=catch_stop_signals(), rank_server=rank_server_pid())
    config.pluginmanager.register(config.stash[_STOP], "correctness-stop")
    for marker, meaning in MARKERS.items():
        config.addinivalue_line("markers", f"{marker}: {meaning}")
    config.stash[_RUNS] = {}
    worker = getattr(config, "workerinput", None)  # set in pytest-xdist workers
    config.stash[_RUN_TOKEN] = worker["correctness_run"] if worker else uuid.uuid4().hex
    if worker:
        share_cpu_threads(int(worker.get("workercount", 1)))
    if worker and torch.cuda.is_available():
        torch.cuda.set_device(int(worker["workerid"].removeprefix("gw")) % torch.cuda.device_count())


def pytest_unconfigure(config):
    emulation = config.stash.get(_EMULATION, None)
    if emulation is not None:
        emulation.close()
    stop = config.stash.get(_STOP, None)
    if stop is None:
        return
    if stop.exit_status is not None or rank_server_pid() != stop.rank_server:
        stop_rank_server()
    stop.restore_signals()


class _Stop(InterruptionWatch):
    """What stopped the session, where an interruption did (Ctrl-C, a signal, or pytest's own on
    collection errors), and what configure found: the signal handlers to put back, and the rank
    server that ran before the session (None: none), which the session leaves running."""

    def __init__(self, restore_signals: Callable[[], None], rank_server: int | None) -> None:
        super().__init__()
        self.restore_signals = restore_signals
        self.rank_server = rank_server


def share_cpu_threads(workers: int) -> None:
    """pytest-xdist workers on one machine share its cores: each runs torch on cores / workers
    threads (at least one), where OMP_NUM_THREADS does not say otherwise. Without this every worker
    would start a thread per core, and two workers on two cores would run four. OMP_NUM_THREADS is
    set to the same share, so that a process a test starts (`correctness run` in a subprocess) keeps
    to it too: two such processes of two threads each on two cores spend much of their time waiting
    for each other's threads (OpenMP's threads spin while they wait)."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // max(1, workers))
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """pytest-xdist: every worker writes its part of a lever's record under this run's token."""
    node.workerinput["correctness_run"] = node.config.stash[_RUN_TOKEN]


def lever_options(config) -> LeverOptions:
    """The run's options, read once; a recipe or model config that cannot be read is a usage
    error in one line."""
    if _OPTIONS not in config.stash:
        try:
            config.stash[_OPTIONS] = _read_options(config)
        except CorrectnessError as error:
            raise pytest.UsageError(str(error)) from None
    return config.stash[_OPTIONS]


def _read_options(config) -> LeverOptions:
    folder = config.getoption("checkpoint_cases") or os.environ.get(CHECKPOINT_ENV)
    model = config.getoption("model_checkpoint") or os.environ.get(MODEL_CHECKPOINT_ENV)
    recipe = config.getoption("recipe")
    facts = config.getoption("model_config")
    return LeverOptions(
        checkpoint_dir=Path(folder) if folder else None,
        model_checkpoint=Path(model) if model else None,
        recipe=check_recipe(load_recipe(recipe)) if recipe else None,  # its fields agree with its script
        model=load_facts(facts) if facts else None,
        scale=config.getoption("scale"),
        emulated=config.getoption("emulate_gpu", None),
    )


def _levers(factory, options: LeverOptions) -> tuple[list[Lever], tuple[str, str] | None]:
    """The factory's levers, or why its test skips: (id, reason) where its lever does not apply to
    the recipe, or at the recipe scale where a case would need more memory than this machine has.
    With --recipe every test's factory builds its levers from that one recipe, so a test that names
    several fixture recipes gets the same lever from each: it is kept once."""
    try:
        levers = tier_levers(factory, options)
    except NotApplicable as reason:
        return [], ("not-applicable", str(reason))
    except OverMemory as refusal:
        if options.scale != "recipe":
            raise
        return [], ("over-memory", f"at the recipe scale: {refusal}")
    return levers, None


def declared_levers(node) -> tuple[str, ...]:
    """The lever names a component test's `levers` marker declares (empty for another test)."""
    marker = node.get_closest_marker("levers")
    names = marker.kwargs.get("lever", ()) if marker is not None else ()
    return (names,) if isinstance(names, str) else tuple(names)


def item_levers(item) -> tuple[str, ...]:
    """The lever a collected component test runs, or, where its lever does not apply to the recipe
    (it only skips), the levers its marker declares."""
    lever = item.callspec.params.get("lever") if hasattr(item, "callspec") else None
    return (lever.name,) if lever is not None else declared_levers(item)


def pytest_generate_tests(metafunc):
    marker = metafunc.definition.get_closest_marker("levers")
    if marker is None:
        return
    if marker.args or "factory" not in marker.kwargs or set(marker.kwargs) - {"factory", "lever"}:
        raise pytest.UsageError(f"{metafunc.definition.nodeid}: write the marker as levers(factory=...)"
                                " or levers(factory=..., lever=NAME)")
    options = lever_options(metafunc.config)
    levers, skipped = _levers(marker.kwargs["factory"], options)
    declared = declared_levers(metafunc.definition)
    stray = sorted({lever.name for lever in levers} - set(declared)) if declared else []
    if stray:
        raise pytest.UsageError(f"{metafunc.definition.nodeid}: its factory builds {', '.join(stray)}, which its marker"
                                f" does not declare ({', '.join(declared_levers(metafunc.definition))})")
    if skipped is not None:
        skip_id, reason = skipped
        metafunc.parametrize(("lever", "case"), [pytest.param(None, None, marks=pytest.mark.skip(reason=reason))],
                             ids=[skip_id])
        return
    metafunc.parametrize(("lever", "case"), [
        pytest.param(
            lever, case, id=f"{lever.candidate.name}-{case.id}" if len(levers) > 1 else case.id,
            marks=[getattr(pytest.mark, marker) for marker in lever.tier.markers],
        )
        for lever in levers for case in lever.cases
    ])


def selected_levers(config) -> set[str] | None:
    """The lever names --levers gives (None: every lever), each one a lever of this suite."""
    given = config.getoption("levers")
    if given is None:
        return None
    levers = lever_catalogue()
    names = {name.strip() for name in given.split(",") if name.strip()}
    unknown = sorted(names - set(levers))
    if unknown or not names:
        raise pytest.UsageError(f"--levers {given}: {'no lever named' if not unknown else 'unknown lever ' + ', '.join(unknown)};"
                                f" the levers are {', '.join(levers)}")
    return names


def pytest_collection_modifyitems(config, items):
    wanted = selected_levers(config)
    if wanted is None:
        return
    kept, dropped = [], []
    for item in items:
        (kept if set(item_levers(item)) & wanted or not declared_levers(item) else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def _stand_in(item) -> StandIn | None:
    """The stand-in --gpu-stand-in names (parsed by its option's type), where given."""
    config = getattr(item, "config", None)
    return config.getoption("gpu_stand_in", None) if config is not None else None


def _emulated(item) -> bool:
    config = getattr(item, "config", None)
    return config is not None and config.getoption("emulate_gpu", None) is not None


def _missing_hardware(item) -> str | None:
    """Why the machine lacks what the item's markers name; None where it has it. A recipe GPU's
    marker is met by that GPU, or by the stand-in --gpu-stand-in names (h200=h100: an H200 runs the
    H100 tiers; its records say so)."""
    names = {marker.name for marker in item.iter_markers()}
    needs_gpu = names & set(cuda_only_markers())
    if needs_gpu and not torch.cuda.is_available():
        for_te = " for Transformer Engine" if "te" in needs_gpu else ""
        return f"needs a CUDA GPU ({', '.join(sorted(needs_gpu))}){for_te}; this machine has none"
    stand_in = _stand_in(item)
    for marker, model in GPU_MARKERS.items():
        if marker in names:
            found = torch.cuda.get_device_name()
            present = gpu_type(found)
            if present == model or (stand_in is not None and (stand_in.present, stand_in.recipe) == (present, model)):
                continue
            could = stand_in_between(present, model)
            if could is not None and stand_in is None and _emulated(item):
                continue  # the emulated GPU stands in for the other of its architecture; its records say so
            hint = f" ({STAND_IN_OPTION} {present.lower()}={model.lower()} runs it here: both {could.architecture})" \
                if could is not None and stand_in is None else ""
            return f"needs an NVIDIA {model} (the recipe's GPU); found {found}{hint}"
    if "te" in names:
        try:
            import transformer_engine.pytorch  # noqa: F401
        except Exception as error:
            return f"Transformer Engine is not usable here: {type(error).__name__}: {error}"
    if "megatron" in names:
        try:
            import megatron.core  # noqa: F401
        except Exception as error:
            return f"megatron-core is not usable here: {type(error).__name__}: {error}"
    if "te_cpu" in names:
        from correctness.te_on_cpu import unusable_reason

        return unusable_reason()
    return None


LEVERS_PROPERTY = "correctness_levers"  # a report's user property: the levers of its test (it crosses xdist)


def pytest_runtest_setup(item):
    if item_levers(item):
        item.user_properties.append((LEVERS_PROPERTY, item_levers(item)))
    reason = _missing_hardware(item)
    if reason:
        lever = item.callspec.params.get("lever") if hasattr(item, "callspec") else None
        required = item.config.getoption("require_tiers") or frozenset()
        if lever is not None and lever.tier.name in required:
            pytest.fail(f"the {lever.tier.name} tier is required here (--require-tiers) but cannot run: {reason}",
                        pytrace=False)
        pytest.skip(reason)


class _SkipReasons:
    """Keeps why each lever's tests skipped (lever -> reasons): a needed lever of which no record is
    written is judged `not run`, with these reasons (correctness.recipe_verdict)."""

    def __init__(self, skips: dict[str, list[str]]) -> None:
        self.skips = skips

    def pytest_runtest_logreport(self, report) -> None:
        if not report.skipped or report.when not in ("setup", "call"):
            return
        levers = dict(report.user_properties).get(LEVERS_PROPERTY, ())
        reason = report.longrepr[2].removeprefix("Skipped: ") if isinstance(report.longrepr, tuple) else str(report.longrepr)
        for lever in levers:
            self.skips.setdefault(lever, []).append(reason)


@dataclass
class _LeverRun:
    lever: Lever
    started: str
    seconds: float = 0.0
    cases: list[CaseResult] = field(default_factory=list)
    stand_in_calls: Counter = field(default_factory=Counter)  # an emulated GPU's kernel stand-ins its cases called

    def record(self) -> "LeverRecord":
        stand_ins = described(self.stand_in_calls) if emulation_active() is not None else None
        return build_record(self.lever, self.cases, self.started, self.seconds, stand_ins)


_EMULATION = pytest.StashKey[contextlib.ExitStack]()  # the emulated GPU, where --emulate-gpu asks for one
_RUNS = pytest.StashKey[dict]()  # one _LeverRun per recipe and lever record (_run_key)
_OPTIONS = pytest.StashKey[LeverOptions]()
_WRITTEN = pytest.StashKey[list]()
_RUN_TOKEN = pytest.StashKey[str]()
_SKIPS = pytest.StashKey[dict]()  # lever -> why its tests skipped
_STOP = pytest.StashKey[_Stop]()
_DEVICE_FAULTS = pytest.StashKey[dict]()  # test module -> the case that left the CUDA device in an error state, and how
NOT_RUN_AFTER_FAULT = "not run: an earlier case left the CUDA device in an error state"
_VERDICTS = pytest.StashKey[tuple]()  # (recipe verdicts, example recipe ids without one, or the error)
_CASE_LOGS = pytest.StashKey[dict]()  # run key -> (its case log, or None where it cannot be written; cases in it)
_RECOVERED = pytest.StashKey[list]()  # records this session made from earlier sessions' case logs
PARTS = ".parts"  # below the results folder: records in pieces, one per xdist worker


@pytest.fixture
def lever_check(request):
    """lever_check(lever, case): run the case, keep its result for the lever's record, and fail
    with the full report (or skip with the reason) as the case decides. A format-limited case (its
    candidate fails the rule only as its narrower format must) passes; its record says so."""
    runs = request.config.stash[_RUNS]
    faults = request.config.stash.setdefault(_DEVICE_FAULTS, {})
    module = str(request.node.path)

    def check(lever: Lever, case: Case) -> CaseResult:
        run = runs.setdefault(
            _run_key(lever.recipe.id, lever.record_id),
            _LeverRun(lever=lever, started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")),
        )
        if lever.tier.device == "cuda" and module in faults:  # the device can run nothing more: not a failure
            result = not_run(case, f"{NOT_RUN_AFTER_FAULT}: {faults[module]}")
            run.cases.append(result)
            pytest.skip(result.skip_reason)
        clock, calls = time.perf_counter(), kernel_calls()
        result = run_case(lever, case, strict_systematic=request.config.getoption("strict_systematic"))
        run.seconds += time.perf_counter() - clock
        run.stand_in_calls += kernel_calls() - calls
        run.cases.append(result)
        if result.status == "skip":
            pytest.skip(result.skip_reason)
        known = lever.known_failure(case, result) if result.status == "fail" and lever.known_failure else None
        if known is not None:  # recorded as failed; reported as the upstream limitation it is
            first = str(result.failures[0]) if result.failures else "failed"
            pytest.xfail(f"{known}; {first}")
        if result.status == "fail":
            fault = device_fault(lever, result)
            if fault is not None:
                faults[module] = f"case {case.id}: {fault}"
            after = f"\nthe CUDA device is now in an error state ({fault}): the rest of this module is not run" \
                if fault is not None else ""
            pytest.fail(case_report(lever.name, result) + after, pytrace=False)
        return result

    return check


def _run_key(recipe_id: str, record_id: str) -> str:
    """A lever run's key: a record id names a lever, tier and candidate, and two recipes can share one."""
    return f"{recipe_id}::{record_id}"


def _results_dir(config) -> Path:
    given = config.getoption("results_dir")
    return Path(given) if given else Path(config.rootpath) / "results"


def pytest_sessionstart(session):
    """Records of earlier sessions on this results folder that were killed before their end, made
    from their case logs (an xdist worker leaves that to the controller)."""
    config = session.config
    if getattr(config, "workerinput", None) is not None:
        return
    try:
        config.stash[_RECOVERED] = recover_case_logs(_results_dir(config))
    except CorrectnessError as error:
        raise pytest.UsageError(str(error)) from None


def pytest_runtest_teardown(item):
    """Each lever run's cases finished since the last test, appended to its case log."""
    config = item.config
    logs = config.stash.setdefault(_CASE_LOGS, {})
    for key, run in config.stash.get(_RUNS, {}).items():
        path, logged = logs.get(key, (_NOT_STARTED, 0))
        if len(run.cases) > logged and path is not None:
            logs[key] = (_log_cases(config, run, path, run.cases[logged:]), len(run.cases))


_NOT_STARTED = Path()  # a run whose case log is not begun yet


def _log_cases(config, run: _LeverRun, path: Path, cases: list[CaseResult]) -> Path | None:
    """Append cases to the run's case log, beginning it where needed; its path, or None where it
    cannot be written (said once, as a warning: the record at the session's end still holds them)."""
    try:
        if path == _NOT_STARTED:
            header = record_to_json(build_record(run.lever, [], run.started, 0.0))
            worker = getattr(config, "workerinput", None)
            path = case_log_path(header, _results_dir(config), config.stash[_RUN_TOKEN],
                                 worker["workerid"] if worker else "main")
            start_case_log(path, header)
        append_cases(path, [case_to_json(case) for case in cases])
    except CorrectnessError as error:
        warnings.warn(pytest.PytestWarning(f"{error}: a session killed before its end loses these cases"))
        return None
    return path


def pytest_sessionfinish(session):
    """Write each lever's record: an xdist worker writes its part, the controller merges the parts,
    and correctness.record_store says where each record goes. In an interrupted session a lever run
    that did not get to every case the session selected of it is marked interrupted; where a signal
    stopped the session, its exit status becomes the shell's for it."""
    config = session.config
    results = _results_dir(config)
    parts = results / PARTS / config.stash[_RUN_TOKEN]
    worker = getattr(config, "workerinput", None)
    stop = config.stash[_STOP]
    interrupted = session.exitstatus == pytest.ExitCode.INTERRUPTED or stop.interruption is not None
    selected = _selected_cases(session)
    pieces: dict[str, list[dict]] = {}
    for key, run in config.stash.get(_RUNS, {}).items():
        cut_short = interrupted and _cut_short(selected.get(key), (case.case_id for case in run.cases))
        data = record_to_json(replace(run.record(), interrupted=cut_short))
        if worker:
            digest = hashlib.sha256(run.lever.recipe.id.encode()).hexdigest()[:12]
            write_record(data, results, parts / f"{file_name(run.lever.record_id)}.{digest}.{worker['workerid']}.json")
        else:
            pieces.setdefault(key, []).append(data)
    if worker:
        return  # the controller gives the session's exit status
    if parts.is_dir():
        for path in sorted(parts.glob("*.json")):
            data = read_record(path)
            pieces.setdefault(_run_key(data["recipe"]["id"], data["lever"]["record_id"]), []).append(data)
        shutil.rmtree(parts)
    written = []
    for key, part_list in pieces.items():
        record = merge_records(part_list)
        record["interrupted"] = record["interrupted"] or (
            interrupted and _cut_short(selected.get(key), (case["case_id"] for case in record["cases"])))
        written.append((record, store_record(record, results)))
    config.stash[_WRITTEN] = written
    remove_case_logs(results, config.stash[_RUN_TOKEN])
    if stop.exit_status is not None:
        session.exitstatus = stop.exit_status
    try:
        config.stash[_VERDICTS] = _recipe_verdicts(config) + (None,)
    except CorrectnessError as error:
        config.stash[_VERDICTS] = ([], [], str(error))


def _selected_cases(session) -> dict[str, set[str]]:
    """The cases the session selected of each lever run (run key -> case ids). An xdist controller
    collects nothing: it knows none."""
    selected: dict[str, set[str]] = {}
    for item in session.items:
        params = item.callspec.params if hasattr(item, "callspec") else {}
        lever, case = params.get("lever"), params.get("case")
        if lever is not None and case is not None:
            selected.setdefault(_run_key(lever.recipe.id, lever.record_id), set()).add(case.id)
    return selected


def _cut_short(selected: set[str] | None, ran: Iterable[str]) -> bool:
    """Whether an interrupted session's lever run lacks a result of a case it selected (where the
    selection is not known, it may)."""
    return selected is None or not selected <= set(ran)


def written_records(config) -> list[tuple[dict, Path]]:
    """The records this session wrote, each with its path (merged from the workers' parts under
    pytest-xdist): for `correctness run --json`, read once the session has finished."""
    return list(config.stash.get(_WRITTEN, []))


def _recipe_verdicts(config) -> tuple[list, list[str]]:
    """Each recipe's verdict (correctness.recipe_verdict) from this session's records of it: the
    user's recipe under --recipe (against --reference where given; judged even where no record was
    written), else each fixture recipe run that has a reference recipe; and the ids of the fixture
    recipes run without one (example recipes, run for their levers' sake)."""
    from correctness.classify import reference_path
    from correctness.fixtures import recipe_path
    from correctness.recipe_verdict import judge_recipe, recipe_changes

    records = [LeverRecord.from_json(record) for record, _ in config.stash.get(_WRITTEN, [])]
    skips = config.stash.get(_SKIPS, {})
    options = lever_options(config)
    recipes = [(options.recipe, config.getoption("reference"))] if options.recipe is not None else []
    examples = []
    for recipe_id in dict.fromkeys(record.recipe.id for record in records):
        if options.recipe is not None or not recipe_path(recipe_id).is_file():
            continue  # the user's recipe is judged above; another project's recipe gets no verdict here
        recipe = load_recipe(recipe_path(recipe_id))
        if reference_path(recipe).is_file():
            recipes.append((recipe, None))
        else:
            examples.append(recipe_id)
    verdicts = [(recipe, judge_recipe(recipe, recipe_changes(recipe, reference), records, skips))
                for recipe, reference in recipes]
    return verdicts, examples


def recipe_verdict(config):
    """The verdict of the recipe --recipe named (correctness.recipe_verdict.RecipeVerdict), as this
    session judged it; CorrectnessError where it could not be judged; None without --recipe."""
    verdicts, _, error = config.stash.get(_VERDICTS, ([], [], None))
    if error is not None:
        raise CorrectnessError(error)
    return verdicts[0][1] if verdicts and lever_options(config).recipe is not None else None


def pytest_terminal_summary(terminalreporter, config):
    from correctness.recipe_verdict import verdict_lines

    wide = config.getoption("wide")
    fit = (lambda lines: lines) if wide else fit_lines
    verdicts, examples, error = config.stash.get(_VERDICTS, ([], [], None))
    if verdicts:
        terminalreporter.section("recipe verdicts")
    for recipe, verdict in verdicts:
        for line in fit(verdict_lines(verdict, recipe.gpu)):
            terminalreporter.write_line(line)
        terminalreporter.write_line("")
    if examples:
        for line in fit([f"example recipes without a reference recipe, run for their levers only (their own verdict:"
                         f" `correctness run RECIPE`): {', '.join(examples)}", ""]):
            terminalreporter.write_line(line)
    if error is not None:
        terminalreporter.write_line(f"no recipe verdict: {error}")
    recovered = config.stash.get(_RECOVERED, [])
    if recovered:
        terminalreporter.section("records of killed sessions")
        for path in recovered:
            terminalreporter.write_line(f"  made from the case logs of a session killed before its end: {Path(path).name}")
            terminalreporter.write_line(f"    in {shown_path(Path(path).parent)}")
    written = config.stash.get(_WRITTEN, [])
    if not written:
        return
    terminalreporter.section("lever verdicts")
    for record, path in written:
        for line in verdict_table(LeverRecord.from_json(record), wide=wide):
            terminalreporter.write_line(line)
        # Its name and its folder on lines of their own: each whole, to be copied, within LINE_WIDTH.
        terminalreporter.write_line(f"  record: {Path(path).name}")
        terminalreporter.write_line(f"    in {shown_path(Path(path).parent)}")
        if why_beside(path):
            terminalreporter.write_line(f"    {why_beside(path)}")
        terminalreporter.write_line("")
