"""How strong a lever's evidence is, and where it ran: the classes `correctness levers` counts the
numerics arguments by.

Each lever declares (its spec, `LeverSpec.evidence`) the strongest evidence the suite
has for it without a GPU record, and the tier that gives it; an argument that one of the lever's
tiers does not reach on the CPU has its own (`LeverSpec.argument_evidence`). A results folder
(`correctness levers --results DIR`) adds what only records can say:
- a GPU record of the lever (device `cuda`, a named device, a case that ran) upgrades its evidence to
  `gpu-run`, with the device and the date; a record made on an emulated GPU never does (it proves
  code paths, not numbers), wherever it lies;
- a CPU record at the declared tier checks the declaration: an `upstream` or `stand-in` lever whose
  candidate is bitwise the default on every tensor of every case, or a `bookkeeping` one whose
  candidate differs, contradicts it.
"""

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from correctness.errors import CorrectnessError
from correctness.results import SKIP, LeverRecord

GPU_RUN, UPSTREAM, STAND_IN, BOOKKEEPING, GPU_ONLY = "gpu-run", "upstream", "stand-in", "bookkeeping", "gpu-only"
CLASSES = (GPU_RUN, UPSTREAM, STAND_IN, BOOKKEEPING, GPU_ONLY)  # strongest first
DECLARED = CLASSES[1:]  # gpu-run only a record gives
MEANINGS = {
    GPU_RUN: "a GPU record names the device and the date",
    UPSTREAM: ("upstream code (megatron-core, torch kernels, TE Python) runs on the CPU, and candidate and default"
               " differ"),
    STAND_IN: "a reproduction written in this project stands in for the upstream code",
    BOOKKEEPING: ("on the CPU the candidate is bitwise the default: it proves the bookkeeping, not another kernel's"
                  " rounding"),
    GPU_ONLY: "only a GPU tier holds the evidence, and none has run",
}
DIFFERS = (UPSTREAM, STAND_IN)  # the declarations a CPU record must show a difference for


@dataclass(frozen=True)
class HeldEqual:
    """A test that runs the upstream code against this project's stand-in and holds them equal."""

    test: str  # its pytest node id from the checkout's root: tests/test_x.py::test_y
    upstream: str  # the upstream code it runs
    needs_gpu: bool  # it skips without a CUDA GPU, so it has not run where none was lent


@dataclass(frozen=True, kw_only=True)
class Evidence:
    klass: str  # one of DECLARED
    tier: str  # the lever's tier (LeverSpec.tiers) the evidence comes from
    what: str  # one line: what runs there, and why it is of this class
    held_equal_by: tuple[HeldEqual, ...] = ()  # where a stand-in takes one side: the tests that hold it to upstream
    # A regular expression searched in a GPU record's lever description: the records that upgrade
    # this evidence to gpu-run (None: every GPU record of the lever).
    gpu_description: str | None = None

    def __post_init__(self):
        if not isinstance(self.held_equal_by, tuple) or not all(isinstance(h, HeldEqual) for h in self.held_equal_by):
            raise TypeError(f"evidence held_equal_by: a tuple of HeldEqual, not {self.held_equal_by!r}")
        if self.klass not in DECLARED:
            raise ValueError(f"evidence class {self.klass!r}: a lever declares one of {', '.join(DECLARED)}")


def strength(klass: str) -> int:
    """Lower is stronger (CLASSES' order)."""
    return CLASSES.index(klass)


@dataclass(frozen=True, kw_only=True)
class GpuRun:
    """A GPU record of a lever: the evidence of `gpu-run`."""

    lever: str
    version: int
    tier: str
    description: str
    device: str
    finished: str  # ISO 8601
    recipe: str
    verdict: str
    path: str

    @property
    def date(self) -> str:
        """The day the run finished, YYYY-MM-DD."""
        return self.finished[:10]


@dataclass(frozen=True, kw_only=True)
class CpuRun:
    """A CPU record of a lever: whether its candidate differed from its default anywhere."""

    lever: str
    version: int
    tier: str
    differs: bool | None  # None where no case was judged
    path: str


@dataclass(frozen=True, kw_only=True)
class Results:
    """What a results folder's records say about the levers' evidence."""

    folder: str
    gpu: tuple[GpuRun, ...]
    cpu: tuple[CpuRun, ...]


def candidate_differs(record: LeverRecord) -> bool | None:
    """Whether any tensor of any judged case differs from the default's bit for bit (None: no case judged)."""
    judged = [case.candidate for case in record.cases if case.candidate is not None]
    if not judged:
        return None
    return any(not tensor.bitwise_identical for judgement in judged for tensor in judgement.tensors)


def _run(record: LeverRecord, path: Path) -> GpuRun | CpuRun | None:
    """The run a record gives evidence of; None for one that gives none (no case ran, no device
    named, or an emulated GPU's: code paths, never numbers)."""
    lever = record.lever
    if record.emulated_gpu is not None:
        return None
    if lever["device"] == "cpu":
        return CpuRun(lever=lever["name"], version=lever["version"], tier=lever["tier"],
                      differs=candidate_differs(record), path=str(path))
    device = record.provenance["device"].get("name")
    if device is None or all(case.status == SKIP for case in record.cases):
        return None  # a record whose cases all failed ran: it is shown, failing
    return GpuRun(lever=lever["name"], version=lever["version"], tier=lever["tier"], description=lever["description"],
                  device=device, finished=record.finished, recipe=record.recipe.id, verdict=record.verdict,
                  path=str(path))


def read_results(folder: Path) -> Results:
    """Every record under `folder` (not under a hidden folder, such as the workers' `.parts`); a file
    that is not a record of this format, or no evidence for its recipe (correctness.trust: its
    figures contradict it, it is not what the suite runs for the recipe, its tier did not run on its
    device), is refused, and so is a folder that is not there; a record of an interrupted run is no
    evidence, and is left out."""
    from correctness.trust import trusted_record

    folder = Path(folder)
    if not folder.is_dir():
        raise CorrectnessError(f"results folder {folder}: not a folder")
    paths = sorted(path for path in folder.rglob("*.json")
                   if not any(part.startswith(".") for part in path.relative_to(folder).parent.parts))
    records = [trusted_record(path, emulated=True) for path in paths]
    runs = [run for trusted in records
            if not trusted.record.interrupted and (run := _run(trusted.record, trusted.path)) is not None]
    return Results(folder=str(folder), gpu=tuple(run for run in runs if isinstance(run, GpuRun)),
                   cpu=tuple(run for run in runs if isinstance(run, CpuRun)))


def gpu_run_for(evidence: Evidence, lever: str, version: int, runs: Iterable[GpuRun]) -> GpuRun | None:
    """The latest GPU run of the lever at its version that this evidence counts."""
    matching = [run for run in runs if run.lever == lever and run.version == version and (
        evidence.gpu_description is None or re.search(evidence.gpu_description, run.description))]
    return max(matching, key=lambda run: run.finished, default=None)


def contradiction(evidence: Evidence, lever: str, version: int, runs: Iterable[CpuRun]) -> str | None:
    """Where the lever's CPU records at its evidence's tier contradict the declared class, why."""
    key = (lever, version, evidence.tier)
    states = {run.path: run.differs for run in runs
              if (run.lever, run.version, run.tier) == key and run.differs is not None}
    if not states:
        return None
    if evidence.klass in DIFFERS and not any(states.values()):
        return (f"{lever} declares {evidence.klass}, but its candidate is bitwise the default in every"
                f" {evidence.tier} record ({', '.join(states)})")
    if evidence.klass == BOOKKEEPING and any(states.values()):
        differing = [path for path, differs in states.items() if differs]
        return f"{lever} declares {BOOKKEEPING}, but its candidate differs from the default in {', '.join(differing)}"
    return None


@dataclass(frozen=True, kw_only=True)
class Standing:
    """A lever's evidence for one argument: the declaration, and the GPU run that upgrades it."""

    lever: str
    declared: Evidence
    gpu_run: GpuRun | None

    @property
    def klass(self) -> str:
        return GPU_RUN if self.gpu_run is not None else self.declared.klass

    @property
    def where(self) -> str:
        if self.gpu_run is not None:
            return f"{self.gpu_run.device}, {self.gpu_run.date} ({self.gpu_run.tier}: {self.gpu_run.verdict})"
        return f"{self.declared.tier} (never run)" if self.declared.klass == GPU_ONLY else self.declared.tier


def strongest(standings: Iterable[Standing]) -> list[Standing]:
    """The standings strongest first (the first is the argument's evidence); ties keep their order."""
    return sorted(standings, key=lambda standing: strength(standing.klass))


def class_counts(classes: Iterable[str]) -> Mapping[str, int]:
    """How many of each class, every class named (0 included), strongest first."""
    classes = list(classes)
    return {klass: classes.count(klass) for klass in CLASSES}
