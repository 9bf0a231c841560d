"""A lever, declared as data: cases, the candidate and default implementations, the FP64
reference, the negative controls and the rule. The harness (`correctness.harness`) runs any lever;
it knows none by name.

An implementation (a "path": each kind keeps its own in `paths.py`) is any object with a `name` and
a `run(inputs) -> ImplementationOutput`. Inputs are whatever the lever's cases make; the harness
never looks inside them.
"""

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import torch

from correctness import memory
from correctness.compare import Slicing
from correctness.errors import OverMemory
from correctness.results import CaseResult, RecipeRef
from correctness.rule import DEFAULT_RULE, Rule
from correctness.tiers import NotApplicable, Tier  # noqa: F401 (declared there, without torch; used here)


@dataclass(frozen=True, kw_only=True)
class ImplementationOutput:
    """What one run of an implementation produced, and what actually ran: `backend` names it, optionally
    followed by a detail in parentheses ("te-fused (F16_arbitrary_seqlen)"), and `details` holds
    the rest."""

    tensors: Mapping[str, torch.Tensor]
    backend: str
    details: Mapping[str, Any] = field(default_factory=dict)


def runs_backend(backend: str, expected: str) -> bool:
    """Whether a path's reported backend is `expected`, with or without its parenthesised detail."""
    return backend == expected or backend.startswith(f"{expected} (")


class Implementation(Protocol):
    """Runs the computation under test on a case's inputs. Raises ImplementationUnavailable only where the
    backend refuses the case (a skip); any other exception fails the case with its message."""

    name: str

    def run(self, inputs: Any) -> ImplementationOutput: ...


def _unchanged(inputs: Any) -> Any:
    return inputs


@dataclass(frozen=True, kw_only=True)
class Mutated:
    """A path run on mutated inputs, or with its outputs changed: how a lever builds a deliberately
    wrong variant of a path. Its backend names the mutation, so that a mutant of the default's own
    kernel is never taken for that kernel."""

    base: Implementation
    mutation: str  # what is wrong, for names and reports: "window +1"
    mutate: Callable[[Any], Any] = _unchanged
    # (inputs, tensors) -> tensors: a wrong result computed from the right one (an output scaled)
    change_outputs: Callable[[Any, Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]] | None = None

    @property
    def name(self) -> str:
        return f"{self.base.name} ({self.mutation})"

    def run(self, inputs: Any) -> ImplementationOutput:
        output = self.base.run(self.mutate(inputs))
        tensors = output.tensors if self.change_outputs is None else self.change_outputs(inputs, output.tensors)
        return ImplementationOutput(
            tensors=tensors, backend=f"{output.backend} (mutated: {self.mutation})",
            details={**output.details, "mutation": self.mutation},
        )


@dataclass(frozen=True)
class Streamed:
    """Inputs that arrive in units (one parameter, or one block of rows of it, at a time), for
    levers too large to hold whole. Every path runs on each unit in turn; a unit's outputs are
    pieces of the lever's tensors, consecutive along their first dimension, compared as wholes."""

    units: Iterable[Any]


def always_applies(case: "Case") -> str | None:
    return None


@dataclass(frozen=True, kw_only=True)
class Control:
    """A negative control: a deliberately wrong implementation that must fail the rule on every case it
    applies to. `why_inapplicable(case)` returns None where the control changes the computation,
    else the reason it does not (a window control on a layer without a window)."""

    name: str
    implementation: Implementation
    why_inapplicable: Callable[["Case"], str | None] = always_applies


@dataclass(frozen=True, kw_only=True)
class Invariant:
    """An exact property of a correct path's outputs that needs no bound (the BF16 weights are the
    round to nearest of the FP32 masters). `check(inputs, tensors)` returns None where it holds,
    else one line saying where it does not. The harness checks the candidate's runs and the
    default's; a violation fails the case."""

    name: str
    check: Callable[[Any, Mapping[str, torch.Tensor]], str | None]


@dataclass(frozen=True, kw_only=True)
class FormatFloor:
    """Where a candidate stores, reduces or computes in a narrower format than its default, and so
    what the best implementation in that format can do. `implementation` is the FP64 reference passed
    through exactly the `roundings` (each rank's gradient to BF16 before the sum; the Adam moments
    at every step) and otherwise exact, its outputs in the candidate's dtypes. Its error is the
    format floor: where the floor alone fails the rule, no implementation in `format` can meet it,
    and the candidate is measured against the floor instead (correctness.rule.Rule.bound with the
    floor's error in the default's place; the harness decides `format-limited`)."""

    format: str  # the narrower format, as users name it: "BF16", "FP8 E4M3"
    roundings: tuple[str, ...]  # where the format rounds, one phrase each
    implementation: Implementation

    def __post_init__(self):
        if not self.roundings:
            raise ValueError(f"format floor {self.format}: declares no roundings, so it would be the reference itself")


RECIPE_SIDES = ("candidate", "default", "neither")


@dataclass(frozen=True, kw_only=True)
class Case:
    """One seeded set of inputs at one shape. `make_inputs(device)` builds them when the case runs
    (the inputs themselves, or `Streamed` units of them).

    `required`: the tier's evidence needs this case; where it does not run (skipped, refused, or
    not collected) the lever is `incomplete`. Optional cases (captured checkpoint inputs, given only
    where a user has them) are listed when they skip and change no verdict.
    `expected_backend`: the backend the recipe says the candidate runs on this case (as the path
    names it, e.g. "te-fused"); a candidate that runs another fails the case, naming both."""

    id: str
    shape: Any  # a frozen dataclass describing the shape; recorded with the result
    seed: int | None
    source: str  # "synthetic" or "checkpoint"
    variant: str  # how the inputs were made: "model-like", "window-edge", "captured", ...
    make_inputs: Callable[[torch.device], Any]
    skip_reason: str | None = None
    required: bool = True
    expected_backend: str | None = None
    # Which of the case's paths the recipe itself runs: "candidate" (what the lever judges is the
    # recipe's own change), "default" (the recipe runs the lever's reference side, e.g. it reduces
    # in FP32 where the lever judges BF16), or "neither" (the case is about another setting of the
    # flag than the recipe's). A recipe's verdict (correctness.recipe_verdict) reads it.
    recipe_runs: str = "candidate"
    # The case's peak memory, estimated from its shape before anything is allocated (its inputs,
    # the paths' outputs and the FP64 reference's intermediates; None: not estimated), and the
    # shape's field that makes it large ("seq_len 8192: the FP64 reference's S x S scores"). A CPU
    # lever with a case over the machine's available memory is refused when it is built.
    memory_bytes: int | None = None
    memory_driver: str | None = None

    def __post_init__(self):
        if self.recipe_runs not in RECIPE_SIDES:
            raise ValueError(f"case {self.id}: recipe_runs must be one of {', '.join(RECIPE_SIDES)}, not {self.recipe_runs!r}")


@dataclass(frozen=True, kw_only=True)
class LeverOptions:
    """What a user chooses at run time, handed to lever factories: the folder of captured
    attention inputs and the model's Hugging Face checkpoint, where given, a recipe file to run in
    place of the component tests' fixture recipes, the model facts of its model (from
    --model-config) where the suite has none of its own, and the scale the CPU tiers run at
    (`--scale`: "smoke", their own small shapes, or "recipe", the recipe's rank-local shapes; a GPU
    tier's shapes are its own, whatever --scale says)."""

    checkpoint_dir: Path | None = None
    model_checkpoint: Path | None = None
    recipe: Any = None  # a user's recipe (correctness.recipes.Recipe), run in place of the fixture recipes
    model: Any = None  # correctness.models.ModelFacts from --model-config, for the recipe's model
    scale: str = "smoke"
    # The emulated GPU (--emulate-gpu: correctness.emulated_gpu.gpus.Emulated), None on a real machine:
    # the GPU tiers then build the CPU's smoke shapes (gpu_at_scale).
    emulated: Any = None

    def __post_init__(self):
        if self.scale not in SCALES:
            raise ValueError(f"lever options: scale must be one of {', '.join(SCALES)}, not {self.scale!r}")

    def at_scale(self, smoke: Any, recipe: Any) -> Any:
        """A CPU tier's shape choice: `smoke` at the smoke scale, `recipe` at the recipe's."""
        return recipe if self.scale == "recipe" else smoke

    def gpu_at_scale(self, smoke: Any, recipe: Any) -> Any:
        """A GPU tier's shape choice: the recipe's (`recipe`) on a GPU, the CPU's `smoke` on an emulated one
        (it proves code paths on the CPU, at the CPU's sizes)."""
        return smoke if self.emulated is not None else recipe

    def recorded(self, levers: Iterable["Lever"]) -> list["Lever"]:
        """The levers a factory built with these options, each to record the scale it was built at:
        a CPU tier's --scale; an emulated GPU's tier the smoke scale (a GPU tier's own shapes are recorded as
        null: correctness.harness.lever_summary)."""
        return [replace(lever, scale=self.scale if lever.tier.device == "cpu" or self.emulated is None else "smoke")
                for lever in levers]


SCALES = ("smoke", "recipe")
_DECLARATION_ONLY: ContextVar[bool] = ContextVar("declaration_only", default=False)


@contextlib.contextmanager
def declaration_only() -> Iterator[None]:
    """Levers built inside are declarations to compare a record with, never run: no case is refused
    for the memory this machine has (correctness.declaration)."""
    token = _DECLARATION_ONLY.set(True)
    try:
        yield
    finally:
        _DECLARATION_ONLY.reset(token)


@dataclass(frozen=True, kw_only=True)
class Lever:
    name: str  # "attention-backend": one per lever, stable; records are keyed by it
    version: int  # bump when the method changes so that older records are not mixed in
    tier: Tier  # where it runs and the markers that select it (correctness.tiers: CPU, GPU, recipe_gpu_tier("H100"))
    description: str  # one sentence naming what is compared, as a recipe's component test names it
    recipe: RecipeRef
    cases: tuple[Case, ...]
    candidate: Implementation
    default: Implementation
    reference: Implementation
    controls: tuple[Control, ...]
    rule: Rule = DEFAULT_RULE
    rule_reason: str | None = None  # required where `rule` differs from the default
    # Informational references (e.g. FP64 with FP32-rounded hyperparameters): the candidate's and
    # the default's errors against each are recorded, never judged.
    secondary_references: tuple[Implementation, ...] = ()
    # Lever-specific figures computed from a finished case (e.g. errors pooled per device share).
    summarize: Callable[[CaseResult], Mapping[str, Any]] | None = None
    # The lever is a choice between kernels of one computation (an attention backend): a case on
    # which the candidate ran the same backend as the default is "no kernel change", which must be
    # bitwise identical to the default and is never counted as evidence for another kernel.
    compares_kernels: bool = False
    # torch's CPU threads while a case runs (None: torch's default). A lever of many small tensors
    # (the optimizer's units) gains nothing from a second thread and spends twice the CPU on it.
    cpu_threads: int | None = None
    # Judge each tensor by slices as well as whole (attention: per head and block of positions),
    # so that an error confined to a few rows is not diluted; None: whole tensors only.
    slicing: Slicing | None = None
    invariants: tuple[Invariant, ...] = ()
    # The candidate's narrower format, where it has one (correctness.lever.FormatFloor): a case
    # whose candidate fails the rule only as its format must is `format-limited`, not `fail`.
    format_floor: FormatFloor | None = None
    # (case, its result) -> why a failed case is an upstream limitation the lever documents (a fused
    # kernel that takes no window, where it ran), else None: the pytest plugin reports such a case as
    # an expected failure (xfail), and its record keeps it failed. Never for a failure this suite's
    # own code could cause; None: every failure is a failure.
    known_failure: Callable[[Case, CaseResult], str | None] | None = None
    # The --scale its CPU tier's cases were built at, as recorded: "smoke" or "recipe"
    # (LeverOptions.recorded sets it). A GPU tier's shapes are its own, and its record says null;
    # an emulated GPU's tier runs the smoke scale, and its record says so.
    scale: str = "smoke"

    def __post_init__(self):
        if not isinstance(self.tier, Tier):
            raise TypeError(f"lever {self.name}: tier must be a Tier (correctness.tiers: CPU, GPU, ...), not {self.tier!r}")
        if self.rule != DEFAULT_RULE and not self.rule_reason:
            raise ValueError(f"lever {self.name}: overrides the rule ({self.rule.describe()}) without a rule_reason")
        if not self.controls:
            raise ValueError(f"lever {self.name}: declares no negative controls, so its test could not fail")
        if not self.cases:
            raise ValueError(f"lever {self.name}: declares no cases")
        if self.scale not in SCALES:
            raise ValueError(f"lever {self.name}: scale must be one of {', '.join(SCALES)}, not {self.scale!r}")
        ids = [case.id for case in self.cases]
        if len(set(ids)) != len(ids):
            raise ValueError(f"lever {self.name}: case ids repeat: {sorted(i for i in ids if ids.count(i) > 1)}")
        if self.tier.device == "cpu":
            self._refuse_cases_over_memory()

    def _refuse_cases_over_memory(self) -> None:
        """OverMemory (one line) where a case that would run is estimated to need more memory than
        this machine has available (correctness.memory); never for a declaration only rebuilt."""
        if _DECLARATION_ONLY.get():
            return
        estimated = [case for case in self.cases if case.memory_bytes is not None and case.skip_reason is None]
        if not estimated:
            return
        available = memory.available_bytes()
        largest = max(estimated, key=lambda case: case.memory_bytes)
        if available is not None and largest.memory_bytes > available:
            driver = f" ({largest.memory_driver})" if largest.memory_driver else ""
            raise OverMemory(
                f"lever {self.name}: case {largest.id} needs about {memory.shown(largest.memory_bytes)}{driver}, more"
                f" than the {memory.shown(available)} of memory available here ({memory.available_source()})")

    @property
    def record_id(self) -> str:
        """Names this lever run's record: lever, tier and the candidate path."""
        return f"{self.name}--{self.tier.name}--{self.candidate.name}"


def _always(case: Case) -> bool:
    return True


@dataclass(frozen=True, kw_only=True)
class WrongImplementation:
    """A realistic wrong implementation of a lever's candidate, to show what its evidence catches
    (correctness.wrong_implementations gathers them): built from the lever's honest path; `changes`
    says whether the mistake changes the computation on a case, `caught_on` where the suite claims
    to catch it: there the case must fail, or, for a scale error (`expected` "systematic"), be
    flagged systematic."""

    name: str
    lever: str  # the lever whose CPU tier judges it
    build: Callable[[Implementation], Implementation]  # from the lever's honest path
    changes: Callable[[Case], bool] = _always
    caught_on: Callable[[Case], bool] = _always
    expected: str = "fail"  # or "systematic": flagged by the diagnostic (a failure with --strict-systematic)
