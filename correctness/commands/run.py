"""Run a recipe's component tests (pytest underneath, the same markers) and write their records.

    correctness run RECIPE.yaml [--tier auto|cpu|gpu] [--results-dir DIR] [--workers N]
                    [--model-config CONFIG] [--checkpoint-cases DIR] [--model-checkpoint DIR]
                    [--json] [-- PYTEST ARGS...]

Runs every component test on RECIPE.yaml, with shapes taken from it and from its model's facts: the
suite's own (fixtures/models, fixtures/configs), or those of --model-config (the model's Hugging Face
config.json). A lever that does not apply to the recipe (offload where it does not offload) skips. `auto` runs
the GPU tiers where a CUDA device is present (the recipe's GPU marker, and `gpu`) and the CPU tiers
otherwise (those without a marker that only CUDA tiers carry, Megatron's optimizer on the CPU
included); both expressions are built from the tiers (correctness.tiers). With several GPUs the
cases are spread over them, one GPU per pytest-xdist worker (install the `parallel` extra); the
workers' records are merged into one per lever. pytest prints its progress and, at the end, a
verdict table per lever.

Before any test starts it checks what would otherwise fail late: the recipe against the schema, the
model's facts, that the results folder takes a file, and that the levers can be built from the
recipe (a quiet collection: a shape that does not split over the recipe's TP size fails there).
Each is refused in one line.

--json: stdout holds one JSON object and nothing else (pytest's report goes to stderr):
{"recipe", "recipe_file", "tier", "markers", "results_dir", "pytest": {"arguments", "exit_code",
"outcome"}, "records": [{"lever", "tier", "record_id", "verdict", "cases": {status: count}, "path"}],
"exit_status"}.

Exit status: 0 every test passed or skipped; 1 a component test failed; 2 bad input or nothing ran.
"""

import contextlib
import importlib.util
import io
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from correctness.commands import EXIT_BAD_INPUT, EXIT_FAIL, EXIT_OK, emit, non_negative_int
from correctness.errors import CorrectnessError, RecipeError
from correctness.fixtures import COMPONENT_TESTS_DIR, checkout_root
from correctness.models import facts_for, load_facts
from correctness.recipes import load_recipe, validate_recipe
from correctness.tiers import GPU, GPU_MARKERS, cuda_only_markers, recipe_gpu_tier  # not via the plugin: see tiers.py

COMPONENT_TESTS = COMPONENT_TESTS_DIR  # the checkout's component_tests/, or the installed package's
PLUGIN = "correctness.pytest_plugin"  # the checkout's conftest.py loads it too; pytest loads it once
# Everything that runs without a GPU: the tests without a marker that only CUDA tiers carry (the CPU
# tiers, and Megatron's own optimizer on the CPU, marked `megatron` alone; it skips with the reason
# where megatron-core is not installed).
CPU_TIER = " and ".join(f"not {marker}" for marker in cuda_only_markers())


def add_arguments(parser) -> None:
    parser.add_argument("recipe", metavar="RECIPE.yaml")
    parser.add_argument("--tier", choices=("auto", "cpu", "gpu"), default="auto")
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


def markers(recipe, tier: str) -> str:
    if tier == "auto":
        tier = "gpu" if torch.cuda.is_available() else "cpu"
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


class _Collection:
    """pytest plugin for the quiet collection before the run. The plugin builds each test's levers
    from the recipe at collection (pytest_generate_tests), so a recipe they cannot use fails there,
    as a collection error with a traceback among pytest's report: this keeps the CorrectnessError
    of each such collector, for one line before any test starts."""

    def __init__(self) -> None:
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


class _Summary:
    """pytest plugin for --json: the records the session wrote."""

    def __init__(self) -> None:
        self.records: list[tuple[dict, Path]] = []

    def pytest_unconfigure(self, config) -> None:
        # Imported here, once pytest has imported (and assertion-rewritten) the plugin itself.
        from correctness.pytest_plugin import written_records

        self.records = written_records(config)


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


def _record_summary(record: dict[str, Any], path: Path) -> dict[str, Any]:
    cases: dict[str, int] = {}
    for case in record.get("cases", []):
        cases[case.get("status")] = cases.get(case.get("status"), 0) + 1
    lever = record.get("lever", {})
    return {"lever": lever.get("name"), "tier": lever.get("tier"), "record_id": lever.get("record_id"),
            "verdict": record.get("verdict"), "cases": cases, "path": str(path)}


def run(args) -> int:
    recipe = load_recipe(args.recipe)
    validate_recipe(recipe.data, recipe.id)
    try:
        facts_for(recipe.model, load_facts(args.model_config) if args.model_config else None)
    except RecipeError as error:
        raise RecipeError(f"recipe {recipe.id}: {error}") from None
    results = writable_folder(Path(args.results_dir) if args.results_dir else default_results())
    selection = markers(recipe, args.tier)
    selected = [str(COMPONENT_TESTS), "-p", PLUGIN, "--recipe", str(args.recipe), "-m", selection, "--results-dir", str(results)]
    for option in ("checkpoint_cases", "model_checkpoint", "model_config"):
        value = getattr(args, option)
        if value:
            selected += [f"--{option.replace('_', '-')}", value]
    if args.strict_systematic:
        selected.append("--strict-systematic")
    command = [*selected, "-rs"]
    workers = args.workers if args.workers is not None else (torch.cuda.device_count() if args.tier != "cpu" else 0)
    if workers > 1:
        if importlib.util.find_spec("xdist") is None:
            raise CorrectnessError(f"{workers} workers need pytest-xdist: pip install -e '.[parallel]'")
        command += ["-n", str(workers)]

    collection = _Collection()
    with contextlib.redirect_stdout(io.StringIO()):  # quiet: its report is the run's to print
        collected = pytest.main([*selected, "--collect-only", "-q", "-p", "no:cacheprovider"], plugins=[collection])
    if collection.errors:
        more = f" (and {len(collection.errors) - 1} more)" if len(collection.errors) > 1 else ""
        raise CorrectnessError(
            f"recipe {args.recipe}: the component tests cannot be built: {collection.errors[0]}{more}"
        )
    if collected == pytest.ExitCode.NO_TESTS_COLLECTED:
        raise CorrectnessError(f"no component test selected for {recipe.model} on {recipe.gpu} ({selection})")

    summary = _Summary()
    with _report_to_stderr(args.json):
        print(f"correctness run {recipe.id}: pytest {' '.join(command)}", flush=True)
        status = pytest.main(command + list(args.passthrough), plugins=[summary])
    try:
        status = pytest.ExitCode(status)
    except ValueError:  # a plugin's own exit code
        pass
    code = {pytest.ExitCode.OK: EXIT_OK, pytest.ExitCode.TESTS_FAILED: EXIT_FAIL}.get(status, EXIT_BAD_INPUT)
    if status == pytest.ExitCode.NO_TESTS_COLLECTED:
        print(f"correctness run: no component test selected for {recipe.model} on {recipe.gpu}"
              f" by the arguments after --: {' '.join(args.passthrough)}", file=sys.stderr)
    elif code == EXIT_BAD_INPUT:
        outcome = status.name.lower().replace("_", " ") if isinstance(status, pytest.ExitCode) else "a plugin's code"
        print(f"correctness run: pytest stopped ({outcome}, exit status {int(status)}); see its report above",
              file=sys.stderr)
    if args.json:
        emit(args, [], {
            "recipe": recipe.id, "recipe_file": str(args.recipe), "tier": args.tier, "markers": selection,
            "results_dir": str(results),
            "pytest": {"arguments": command + list(args.passthrough), "exit_code": int(status),
                       "outcome": status.name.lower() if isinstance(status, pytest.ExitCode) else None},
            "records": [_record_summary(record, path) for record, path in summary.records],
            "exit_status": code,
        })
    return code
