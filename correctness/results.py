"""Result data: what one case and one lever run produced, and the JSON record format.

The record format is documented in docs/record-format.md and checked by
correctness/schema/record.schema.json; bump FORMAT_VERSION on any change that a reader of older
records would misread.
"""

import dataclasses
import functools
import hashlib
import json
import math
import re
import types
import typing
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from correctness.comparisons import RunSpread, Systematic, TensorComparison
from correctness.errors import CorrectnessError
from correctness.files import folder_parts, read_input, replace_file
from correctness.fixtures import checkout_root

FORMAT = "correctness.lever-record"
FORMAT_VERSION = 10  # 10: `provenance.emulated_gpu` (a run on an emulated GPU: the GPU named and the kernel stand-ins it called); 9: every slice's error/bound (`grid`, `grid_shape`); 8: failures as {kind, role, tensor, text}; 7: the recipe's path, the arguments its lever reads and their sha256, the model arguments checked, `interrupted`; 6: `format-limited`, a case's `format` (the format floor); 5: repeated runs (`runs`, spreads, controls' `fails`); 4: the model facts' source and sha256; 3: slices, systematic error, invariants, resolution; 2: `incomplete`, `completeness`

PASS, FAIL, SKIP = "pass", "fail", "skip"
INCOMPLETE = "incomplete"  # a lever verdict: a required case did not run
NO_KERNEL_CHANGE = "no kernel change"  # the candidate ran the default's own kernel (bitwise identical)
# The candidate fails the rule only as its narrower format must: the format floor (the FP64
# reference through the format's roundings alone) fails it too, and the candidate is within the
# rule measured against that floor (correctness.lever.FormatFloor).
FORMAT_LIMITED = "format-limited"
RAN = (PASS, NO_KERNEL_CHANGE, FORMAT_LIMITED)  # the case statuses of a case that ran and held
# Lever verdicts from the weakest evidence to the strongest: of several results for one lever
# (tiers, entries) the weakest stands for it. `skip` (nothing ran) is no evidence at all.
WEAKEST_FIRST = (FAIL, SKIP, INCOMPLETE, FORMAT_LIMITED, PASS, NO_KERNEL_CHANGE)


def weakest(verdicts: Collection[str]) -> str:
    """The weakest of several lever verdicts (an unknown word counts as the weakest of all)."""
    unknown = [verdict for verdict in verdicts if verdict not in WEAKEST_FIRST]
    if unknown:
        return unknown[0]
    return min(verdicts, key=WEAKEST_FIRST.index)


# What a case's failure is (Failure.kind):
OUTSIDE_RULE = "outside-rule"  # a tensor's (or a slice's) error is over its bound
NON_FINITE = "non-finite"  # NaN or Inf in an output
INVARIANT = "invariant"  # a lever's invariant (a property its outputs must have) is broken
NOT_REPEATABLE = "not-repeatable"  # outputs differ between runs where the rule wants them bitwise
NO_POWER = "no-power"  # a negative control is within the bound: the case could not tell it from the candidate
NO_CONTROL = "no-control"  # no negative control applies to the case
BACKEND = "backend"  # the candidate ran another backend than the recipe says
SAME_KERNEL_DIFFERS = "same-kernel-differs"  # candidate and default ran one kernel, yet differ
SYSTEMATIC = "systematic"  # a bias (scale or offset) beyond the default's or the floor's
FLOOR_MEETS_RULE = "floor-meets-rule"  # the format floor passes where the candidate fails: not the format's limit
ERROR = "error"  # an exception: the case was not judged
FAILURE_KINDS = (OUTSIDE_RULE, NON_FINITE, INVARIANT, NOT_REPEATABLE, NO_POWER, NO_CONTROL, BACKEND,
                 SAME_KERNEL_DIFFERS, SYSTEMATIC, FLOOR_MEETS_RULE, ERROR)


class Failure(str):
    """One reason a case fails: its one-line text (a Failure is that string), what kind of failure
    it is, whose (the role: "candidate", "positive control (default repeated)", a control's name)
    and on which tensor, where one. Code reads the kind, a person the text."""

    kind: str
    role: str | None
    tensor: str | None

    def __new__(cls, text: str, *, kind: str, role: str | None = None, tensor: str | None = None) -> "Failure":
        if kind not in FAILURE_KINDS:
            raise ValueError(f"failure kind {kind!r}: one of {', '.join(FAILURE_KINDS)}")
        failure = super().__new__(cls, text)
        failure.kind, failure.role, failure.tensor = kind, role, tensor
        return failure

    def __getnewargs_ex__(self):
        return (str(self),), {"kind": self.kind, "role": self.role, "tensor": self.tensor}

    def extended(self, words: str) -> "Failure":
        """The same failure with words added to its text."""
        return Failure(f"{self}{words}", kind=self.kind, role=self.role, tensor=self.tensor)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "role": self.role, "tensor": self.tensor, "text": str(self)}

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> "Failure":
        return Failure(data["text"], kind=data["kind"], role=data["role"], tensor=data["tensor"])


@dataclass(frozen=True, kw_only=True)
class RecipeRef:
    """The recipe a lever's shapes come from and its results belong to."""

    id: str  # path below fixtures/recipes without ".yaml", or the user's file name
    model: str
    gpu: str
    sha256: str
    # Where the model facts the shapes come from were read (a facts file, or the config.json they
    # were generated from) and that file's sha256; None for a lever that reads no model facts.
    model_facts: str | None = None
    model_facts_sha256: str | None = None
    # The recipe's model arguments (its run script's --num-layers, --hidden-size, ...) held equal to
    # the model facts (correctness.model_arguments), and why any were not: hidden behind an array
    # expansion such as "${MODEL_ARGS[@]}" or a bridge's conversion; None where none were hidden.
    model_arguments_checked: tuple[str, ...] = ()
    model_arguments_unchecked: str | None = None
    # Where the record's recipe is (its path as given, resolved), and the recipe's values of the
    # arguments its lever reads (the lever's spec, LeverSpec.reads: name -> value, null
    # where the recipe does not set it) with their sha256: a record is for a recipe with those values.
    path: str | None = None
    arguments: Mapping[str, Any] = field(default_factory=dict)
    arguments_sha256: str | None = None


@dataclass(frozen=True, kw_only=True)
class PathRun:
    """One run of a path: its name, the backend that actually ran, and how long it took."""

    path: str
    backend: str
    details: Mapping[str, Any]
    seconds: float


def over_bound(figures: Any) -> float:
    """A tensor's (or slice's) error over its bound, for finding the worst: a figure that is NaN
    (an output with NaN, or a null read back from a record) counts as infinitely far."""
    value = figures.error_over_bound
    return math.inf if value is None or math.isnan(value) else value


@dataclass(frozen=True, kw_only=True)
class Judgement:
    """A path's outputs judged tensor by tensor against the default under the rule."""

    run: PathRun
    tensors: tuple[TensorComparison, ...]

    @property
    def passes(self) -> bool:
        return all(t.passes for t in self.tensors)

    @property
    def worst(self) -> TensorComparison:
        """The tensor nearest to failing (or farthest past the bound); NaN counts as farthest."""
        return max(self.tensors, key=over_bound)


@dataclass(frozen=True, kw_only=True)
class ControlResult:
    name: str
    inapplicable_reason: str | None  # why the control does not change this case, if it does not
    judgement: Judgement | None  # None where inapplicable
    # Where the rule asks for bitwise repeatability: the tensors its repeated runs changed (empty:
    # repeatable); None where the control ran once.
    spread: tuple[RunSpread, ...] | None = None

    @property
    def fails_bound(self) -> bool:
        return self.judgement is not None and not self.judgement.passes

    @property
    def fails_repeatability(self) -> bool:
        return self.judgement is not None and bool(self.spread)

    @property
    def fails(self) -> bool:
        """The control fails the rule, as it must: outside the bound, or not bitwise repeatable where
        the rule asks for that."""
        return self.fails_bound or self.fails_repeatability

    @property
    def power(self) -> float | None:
        """The control's largest error over the bound: above 1 means it fails, as it must."""
        return None if self.judgement is None else self.judgement.worst.error_over_bound


@dataclass(frozen=True, kw_only=True)
class FormatControl:
    """A negative control judged against the format bound (the format floor in the default's
    place): it must fail that bound too, or the format bound could not tell it from the candidate."""

    name: str
    judgement: Judgement

    @property
    def fails(self) -> bool:
        return not self.judgement.passes

    @property
    def power(self) -> float:
        return self.judgement.worst.error_over_bound


@dataclass(frozen=True, kw_only=True)
class FormatResult:
    """A case judged against its candidate's format (correctness.lever.FormatFloor)."""

    format: str
    roundings: tuple[str, ...]
    # The floor judged under the rule against the default: where it fails, no implementation in
    # the format meets the rule on that tensor.
    floor: Judgement
    # The candidate's runs with the floor in the default's place: bound = factor x floor + slack.
    candidate: Judgement
    candidate_repeat: Judgement | None
    controls: tuple[FormatControl, ...]  # the applicable controls, against the same bound
    systematic: tuple[str, ...]  # candidate tensors biased beyond the floor's rounding (the diagnostic, floor as default)
    # The candidate's lines outside the rule where the case is format-limited (its format's limit,
    # not a failure); empty otherwise.
    outside_rule: tuple[Failure, ...]
    # Why a candidate outside the rule is not format-limited (worse than its format allows, a
    # control within the format bound, ...); empty where it is, or where it passes the rule.
    findings: tuple[Failure, ...]

    @property
    def floor_fails_rule(self) -> tuple[str, ...]:
        return tuple(t.tensor for t in self.floor.tensors if not t.passes)


@dataclass(frozen=True, kw_only=True)
class CaseResult:
    case_id: str
    source: str
    variant: str
    seed: int | None
    shape: Mapping[str, Any]
    status: str  # "pass", "fail", "skip", "no kernel change" or "format-limited"
    skip_reason: str | None
    required: bool  # whether the lever's evidence needs this case (see Case.required)
    expected_backend: str | None  # what the recipe says the candidate runs here, where it says
    failures: tuple[Failure, ...]
    reference: PathRun | None
    default: PathRun | None
    candidate: Judgement | None
    candidate_repeat: Judgement | None
    deterministic: bool | None  # candidate outputs bitwise equal between all its runs
    nondeterministic_tensors: tuple[str, ...]
    runs: int  # runs of the candidate and of the default (rule.runs; 1 for a candidate screened without repeats)
    candidate_spread: tuple[RunSpread, ...]  # the candidate's tensors its repeats changed, and by how much
    default_spread: tuple[RunSpread, ...]  # the same for the default (reported; judged only through the positive control)
    default_repeat: Judgement | None  # positive control: the default judged as a candidate
    controls: tuple[ControlResult, ...]
    secondary: tuple[Judgement, ...]  # the candidate against each secondary reference (not judged)
    invariants: tuple[str, ...]  # the lever's invariants checked on the candidate's and the default's runs
    # Tensors whose systematic error the diagnostic flags (correctness.rule), against the reference
    # and against every secondary one; a failure only where the run asks for strict systematic checks.
    systematic: tuple[str, ...]
    # The smallest errors this case detects: the rule's bound (random error) and the slope threshold
    # (scale bias), each the smallest over the candidate's tensors, with the tensor.
    resolution: Mapping[str, Any]
    summary: Mapping[str, Any]  # the lever's own figures for the case
    seconds: float
    format: FormatResult | None = None  # where the lever declares a format floor and the case was judged
    recipe_runs: str = "candidate"  # which path the recipe itself runs (correctness.lever.Case.recipe_runs)


@dataclass(frozen=True, kw_only=True)
class Completeness:
    """How much of a lever's declared evidence a record holds."""

    declared: int
    ran: int
    missing: tuple[str, ...]  # declared cases the record lacks (deselected, interrupted, another worker's)
    required_skipped: tuple[str, ...]
    optional_skipped: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class LeverRecord:
    """One lever run, as written and as read back (`LeverRecord.from_json`)."""

    lever: Mapping[str, Any]
    recipe: RecipeRef
    verdict: str  # see assess()
    completeness: Completeness
    cases: tuple[CaseResult, ...]
    provenance: Mapping[str, Any]
    started: str
    finished: str
    seconds: float
    # The run was stopped (Ctrl-C, SIGTERM) before every case it selected had run: its record is
    # kept beside a complete one, never in its place.
    interrupted: bool = False

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> "LeverRecord":
        return record_from_json(data)

    def assessment(self) -> tuple[str, Completeness]:
        """What the verdict and completeness must be, from the cases and the lever's declaration."""
        return assess({case.case_id: case.status for case in self.cases}, self.lever["cases"],
                      set(self.lever["optional_cases"]))

    def ran_cases(self) -> list[CaseResult]:
        """The cases that were judged (a case that failed with an error before its judgement was not)."""
        return [case for case in self.cases if case.candidate is not None]

    @property
    def emulated_gpu(self) -> str | None:
        return emulated_gpu(self.provenance)


def emulated_gpu(provenance: Mapping[str, Any]) -> str | None:
    """The GPU a run on an emulated GPU stood for ("H100"; `provenance.emulated_gpu`,
    correctness.emulated_gpu), None for a run on a real device. Such a record proves code paths,
    never a GPU's numbers: no reader counts it as evidence."""
    emulated = provenance.get("emulated_gpu") if isinstance(provenance, Mapping) else None
    if emulated is None:
        return None
    return str(emulated.get("gpu", "GPU")) if isinstance(emulated, Mapping) else "GPU"


def emulated_sentence(gpu: str) -> str:
    return (f"it was made on an emulated {gpu} (--emulate-gpu): it proves the GPU tier's code paths, never a GPU's"
            " numbers, so it is no evidence")


@functools.cache
def _field_hints(kind: type) -> tuple[tuple[str, Any], ...]:
    """A record dataclass's fields and their resolved types (resolving them is most of a large
    record's reading time, and they never change)."""
    hints = typing.get_type_hints(kind)
    return tuple((field.name, hints[field.name]) for field in dataclasses.fields(kind))


def _from_json(kind: Any, value: Any) -> Any:
    """A value of the record's JSON form as the type `kind` (a dataclass, tuple[X, ...], X | None,
    float, a Mapping or Any); a null figure becomes NaN (the record writes non-finite figures as
    null)."""
    if value is None:
        return math.nan if kind is float else None
    if kind is Failure:
        return Failure.from_json(value)
    origin, arguments = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        return _from_json(next(argument for argument in arguments if argument is not type(None)), value)
    if dataclasses.is_dataclass(kind):
        return kind(**{name: _from_json(hint, value[name]) for name, hint in _field_hints(kind)})
    if origin is tuple:
        item = arguments[0]
        return tuple(_from_json(item, element) for element in value)
    if kind is float:
        return float(value)
    return value


def _first_difference(stated: Any, derived: Any, where: str = "") -> tuple[str, Any, Any] | None:
    if isinstance(stated, dict) and isinstance(derived, dict):
        for key in [*stated, *(key for key in derived if key not in stated)]:  # in the record's order
            found = _first_difference(stated.get(key), derived.get(key), f"{where}.{key}" if where else key)
            if found:
                return found
        return None
    if isinstance(stated, list) and isinstance(derived, list) and len(stated) == len(derived):
        for index, (a, b) in enumerate(zip(stated, derived)):
            found = _first_difference(a, b, f"{where}.{index}")
            if found:
                return found
        return None
    return None if stated == derived and type(stated) is type(derived) or (
        isinstance(stated, (int, float)) and isinstance(derived, (int, float)) and not isinstance(stated, bool)
        and not isinstance(derived, bool) and stated == derived) else (where, stated, derived)


def stated_fields_disagree(data: Mapping[str, Any]) -> str | None:
    """Where a record's stated fields differ from what its own figures give (a field written from
    others, such as a tensor's `passes` or bound, a control's `fails_bound`, the verdict, edited by
    hand: correctness.recheck recomputes them), or its rule is looser than the suite's: the first
    such field, or None where the record reads back as it was written."""
    from correctness.recheck import recomputed, rule_problem

    problem = rule_problem(data["lever"])
    if problem is not None:
        return problem
    found = _first_difference(dict(data), record_to_json(recomputed(record_from_json(data))))
    if found is None:
        return None
    where, stated, derived = found
    return f"field {where} says {json.dumps(stated)} where its figures give {json.dumps(derived)}"


def record_from_json(data: Mapping[str, Any]) -> "LeverRecord":
    """The typed record of a record's JSON form (as read_record returns it, already checked against
    the schema): the one form every reader works on."""
    return _from_json(LeverRecord, data)


def assess(statuses: Mapping[str, str], declared: Sequence[str], optional: Collection[str]) -> tuple[str, Completeness]:
    """A lever's verdict from its cases' statuses (case id -> status) and its declaration:
    - "fail": a case failed (its candidate, a control, or an error);
    - "skip": no case ran (every one refused or skipped);
    - "incomplete": a required case skipped, or a declared case is not in the record;
    - "format-limited": a case that ran is format-limited, and every other one passed;
    - "no kernel change": every case that ran ran the default's own kernel;
    - "pass": otherwise: every case that ran passed, and every required case ran."""
    missing = tuple(case for case in declared if case not in statuses)
    skipped = [case for case, status in statuses.items() if status == SKIP]
    completeness = Completeness(
        declared=len(declared),
        ran=sum(status in RAN for status in statuses.values()),
        missing=missing,
        required_skipped=tuple(case for case in skipped if case not in optional),
        optional_skipped=tuple(case for case in skipped if case in optional),
    )
    ran = {status for status in statuses.values() if status != SKIP}
    if FAIL in ran:
        verdict = FAIL
    elif not ran:
        verdict = SKIP
    elif missing or completeness.required_skipped:
        verdict = INCOMPLETE
    elif FORMAT_LIMITED in ran:
        verdict = FORMAT_LIMITED
    elif ran == {NO_KERNEL_CHANGE}:
        verdict = NO_KERNEL_CHANGE
    else:
        verdict = PASS
    return verdict, completeness


def jsonable(value: Any) -> Any:
    """Dataclasses to dicts (properties that matter included), non-finite floats to None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Judgement):
        return {"passes": value.passes, "run": jsonable(value.run), "tensors": jsonable(value.tensors)}
    if isinstance(value, TensorComparison):
        fields = {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {**fields, "systematic_flagged": value.systematic_flagged}
    if isinstance(value, Systematic):
        fields = {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {**fields, "over_threshold": jsonable(value.over_threshold)}
    if isinstance(value, Failure):
        return value.to_json()
    if isinstance(value, FormatControl):
        return {"name": value.name, "fails": value.fails, "power": jsonable(value.power),
                "judgement": jsonable(value.judgement)}
    if isinstance(value, FormatResult):
        fields = {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {**fields, "floor_fails_rule": list(value.floor_fails_rule)}
    if isinstance(value, ControlResult):
        return {
            "name": value.name,
            "applies": value.inapplicable_reason is None,
            "inapplicable_reason": value.inapplicable_reason,
            "fails_bound": value.fails_bound,
            "fails": value.fails,
            "power": jsonable(value.power),
            "spread": jsonable(value.spread),
            "judgement": jsonable(value.judgement),
        }
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    return str(value)


def record_to_json(record: LeverRecord) -> dict[str, Any]:
    return {"format": FORMAT, "format_version": FORMAT_VERSION, **jsonable(record)}


def case_to_json(case: CaseResult) -> dict[str, Any]:
    """One case's result in a record's JSON form (an element of its `cases`), for writing each case
    as it finishes (correctness.record_store.CaseLog)."""
    return jsonable(case)


FOLDER_HASH = 8  # hex digits of the recipe location's sha256 in its records' folder name


def recipe_location(path: str | Path) -> str:
    """Where a recipe lies, as its records' folder is keyed: below the checkout for a recipe in it,
    else its resolved path."""
    resolved = Path(path).resolve()
    root = checkout_root()
    if root is not None and resolved.is_relative_to(root.resolve()):
        return resolved.relative_to(root.resolve()).as_posix()
    return str(resolved)


def folder_suffix(path: str | Path | None) -> str:
    """The short hash of a recipe's location that its records' folder name ends with ("" for none)."""
    if path is None:
        return ""
    return "." + hashlib.sha256(recipe_location(path).encode()).hexdigest()[:FOLDER_HASH]


def records_folder(recipe: Mapping[str, Any], results_dir: Path) -> Path:
    """results_dir/<recipe id>.<hash>: a recipe's records' folder, by its id and a short hash of
    where it lies (folder_suffix), so that two recipes with one file name, model and GPU never share
    one; refused where the id would lead outside results_dir (an empty, `.` or `..` part, an
    absolute id; load_recipe refuses such a recipe id already)."""
    recipe_parts = folder_parts(recipe["id"])
    if recipe_parts is None:
        raise CorrectnessError(f"recipe id {recipe['id']!r} would place a record outside the results folder {results_dir}")
    *parents, last = recipe_parts
    return Path(results_dir).joinpath(*parents, last + folder_suffix(recipe.get("path")))


NAME_HASH = 8  # hex digits of a label's sha256 in a file name made from it
_NOT_IN_A_FILE_NAME = re.compile(r"[^A-Za-z0-9._-]+")


def file_name(label: str) -> str:
    """A file name (without its extension) of letters, digits, `.`, `_` and `-` alone for a label:
    the label itself where it is one; else the label with each run of other characters as `_`, and
    a short hash of the whole label, so that two labels never share a name (the GPU machine returns
    only files so named, and a shell quotes no such name)."""
    if not _NOT_IN_A_FILE_NAME.search(label):
        return label
    readable = _NOT_IN_A_FILE_NAME.sub("_", label).strip("_") or "_"
    return f"{readable}.{hashlib.sha256(label.encode()).hexdigest()[:NAME_HASH]}"


def record_path(data: Mapping[str, Any], results_dir: Path) -> Path:
    """records_folder/<file name of the record id>.json (file_name: `deterministic-mode--gpu--sdpa-
    efficient (deterministic mode)` is `deterministic-mode--gpu--sdpa-efficient_deterministic_mode.
    <hash>.json`; the record holds its readable id), refused where the record id would lead outside
    the folder."""
    record_id = data["lever"]["record_id"]
    if folder_parts(record_id, several=False) is None:
        raise CorrectnessError(f"record id {record_id!r} would place a record outside the results folder {results_dir}")
    return records_folder(data["recipe"], results_dir) / f"{file_name(record_id)}.json"


def write_record(record: LeverRecord | Mapping[str, Any], results_dir: Path, target: Path | None = None) -> Path:
    """Write a record (or its JSON form) atomically (correctness.files.replace_file), by default to
    results_dir/<recipe id>/<record id>.json; return its path. A write that fails (a read-only
    folder, a full disk) raises CorrectnessError with its own error, in one line."""
    data = record_to_json(record) if isinstance(record, LeverRecord) else record
    target = target or record_path(data, results_dir)
    text = json.dumps(data, indent=1, allow_nan=False) + "\n"
    label = f"result record {target}"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CorrectnessError(f"{label}: cannot be written ({error.strerror or error})") from None
    replace_file(target, text.encode("utf-8"), label)
    return target


def merge_records(parts: list[Mapping[str, Any]]) -> dict[str, Any]:
    """One record from the parts several processes wrote for the same lever run (pytest-xdist):
    the cases in the lever's declared order, the verdict recomputed, the times spanned, and
    interrupted where any part was."""
    first = parts[0]
    order = {case_id: index for index, case_id in enumerate(first["lever"]["cases"])}
    cases = sorted((case for part in parts for case in part["cases"]), key=lambda case: order[case["case_id"]])
    verdict, completeness = record_assessment({**first, "cases": cases})
    provenance = dict(first["provenance"])
    devices = [part["provenance"]["device"] for part in parts]
    if len(parts) > 1:
        provenance["workers"] = devices
    return {
        **first,
        "verdict": verdict,
        "completeness": jsonable(completeness),
        "cases": cases,
        "provenance": provenance,
        "started": min(part["started"] for part in parts),
        "finished": max(part["finished"] for part in parts),
        "seconds": sum(part["seconds"] for part in parts),
        "interrupted": any(part["interrupted"] for part in parts),
    }


def record_assessment(data: Mapping[str, Any]) -> tuple[str, Completeness]:
    """assess() over a record in its JSON form: what its verdict and completeness must be."""
    statuses = {case["case_id"]: case["status"] for case in data["cases"]}
    return assess(statuses, data["lever"]["cases"], set(data["lever"]["optional_cases"]))


def _nonfinite_field(data: Any) -> tuple[str, float] | None:
    """The first figure that is NaN or infinite (a JSON NaN or Infinity token, or a number too
    large for a double), with its path; iterative, so a deep record cannot exhaust the stack."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return where, value
        if isinstance(value, dict):
            stack.extend((f"{where}.{key}" if where else str(key), item) for key, item in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend((f"{where}.{index}", item) for index, item in reversed(list(enumerate(value))))
    return None


def read_record(path: Path) -> dict[str, Any]:
    """Load a record, refusing (one line naming the file and the field) files of another format or
    format version, anything record.schema.json does not allow (a missing `lever`, `cases` that is
    not a list, a date that is not an ISO 8601 time), and a non-finite figure anywhere: the suite
    writes such a figure as null, so a NaN or Infinity is a hand edit, and would be worded as a
    figure ("inf x") in a passing entry."""
    from correctness.schema import first_problem

    path = Path(path)
    label = f"result record {path}"
    raw = read_input(path, label)
    try:
        data = json.loads(raw.decode("utf-8-sig"))
    except ValueError as error:  # bad JSON, or bytes that are not UTF-8
        raise CorrectnessError(f"{label}: cannot be read as JSON ({error})") from None
    except RecursionError:
        raise CorrectnessError(f"{label}: cannot be read as JSON (nested too deeply)") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CorrectnessError(f"{label}: not a {FORMAT} file")
    version = data.get("format_version")
    if isinstance(version, str):
        raise CorrectnessError(f"{label}: format_version is the string {version!r}; this suite reads the number"
                               f" {FORMAT_VERSION}")
    if version != FORMAT_VERSION or isinstance(version, bool):
        raise CorrectnessError(f"{label}: format version {version}, this suite reads {FORMAT_VERSION}")
    problem = first_problem("record.schema.json", data)
    if problem is not None:
        where, message = problem
        raise CorrectnessError(f"{label}: field {where}: {message}")
    nonfinite = _nonfinite_field(data)
    if nonfinite is not None:
        where, value = nonfinite
        raise CorrectnessError(f"{label}: field {where} is {value}, not a finite number (a record writes null"
                               " where a figure is not finite)")
    return data
