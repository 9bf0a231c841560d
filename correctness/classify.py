"""Classing a tuned recipe's training arguments against its reference recipe's.

A tuned (candidate) recipe and its reference differ in some train.py arguments. Each changed, added
or removed argument gets a class from the rules file (`correctness/rules/arguments.yaml`):
placement, numerics, batching, must-match or inert; an argument the rules do not list is `unknown`.
A numerics change is covered by a lever (a component test) named in the rules; the candidate's
`correctness.component_tests` entries say whether that lever passed. An entry names its lever with
a `lever:` key, or else its `test:` title matches one of the lever's title patterns.

The configuration's verdict:
- "fail": a must-match argument changed, or a numerics change's lever result is a fail;
- "pass": no must-match change, no unknown argument, and every numerics change's lever passed;
- "incomplete": otherwise (an unknown argument, a numerics argument without a lever, a lever
  without a result).
A format-limited lever result, and a numerics change without a lever, count as covered only
together with a passing correctness.convergence block: their evidence is a convergence run.

Everything here is read-only: it reads files and returns values.
"""

import fnmatch
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from correctness.catalogue import lever_catalogue
from correctness.entries import CPU_LABEL
from correctness.errors import CorrectnessError, RecipeError
from correctness.files import YAML_LIMIT, read_input
from correctness.fixtures import FIXTURES_DIR
from correctness.recipes import Recipe, training_arguments
from correctness.yaml_documents import load_yaml, read_yaml_input
from correctness.results import FAIL, FORMAT_LIMITED, NO_KERNEL_CHANGE, PASS, weakest

REFERENCES_DIR = FIXTURES_DIR / "references"
CLASSES = ("placement", "numerics", "batching", "must-match", "inert")
UNKNOWN = "unknown"
Arguments = Mapping[str, list[list[str]]]

# A change's outcome: what it asks of the configuration.
OK = "ok"  # placement, batching, inert
# numerics: its lever passed, ran the reference's own kernel (no kernel change), or is as accurate
# as its format allows (format-limited), or it has no lever, and a passing convergence run is the evidence
COVERED = "covered"
FAILED = "fail"  # numerics, its lever failed
MISSING = "missing"  # numerics, no result for its lever, or an incomplete one
REVIEW = "review"  # unknown argument, or numerics without a lever
ERROR = "error"  # must-match: a configuration error
MEGATRON_DEFAULTS = "Megatron's defaults (no reference recipe)"  # what a recipe without one is classed against


class RulesError(CorrectnessError):
    """The rules file is missing, malformed, or names an unknown class or lever."""


@dataclass(frozen=True)
class ArgumentRule:
    klass: str
    reason: str
    levers: tuple[str, ...] = ()  # every lever whose component test a change of it needs
    default: tuple[str, ...] | None = None
    unordered: bool = False
    no_lever: str | None = None  # a numerics argument without a lever: why there is none


@dataclass(frozen=True)
class LeverRule:
    name: str
    description: str
    tests: tuple[re.Pattern[str], ...]

    def matches(self, title: str) -> bool:
        return any(pattern.search(title) for pattern in self.tests)


@dataclass(frozen=True)
class Rules:
    source: str
    classes: Mapping[str, str]
    levers: Mapping[str, LeverRule]
    arguments: Mapping[str, ArgumentRule]
    patterns: tuple[tuple[str, ArgumentRule], ...] = ()

    def rule(self, flag: str) -> ArgumentRule | None:
        """The flag's exact entry, else the first glob pattern that matches it, else None."""
        if flag in self.arguments:
            return self.arguments[flag]
        return next((rule for glob, rule in self.patterns if fnmatch.fnmatchcase(flag, glob)), None)


def _text(value: Any, where: str, source: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise RulesError(f"rules {source}: {where} must be a non-empty string")
    return value


def _argument_rule(flag: str, entry: Any, levers: Mapping[str, LeverRule], source: str) -> ArgumentRule:
    if not isinstance(entry, dict):
        raise RulesError(f"rules {source}: {flag} must be a mapping")
    unexpected = set(entry) - {"class", "reason", "lever", "default", "unordered", "no_lever"}
    if unexpected:
        raise RulesError(f"rules {source}: {flag} has unknown keys {sorted(unexpected)}")
    klass = entry.get("class")
    if klass not in CLASSES:
        raise RulesError(f"rules {source}: {flag} has class {klass!r}, not one of {', '.join(CLASSES)}")
    named = entry.get("lever")
    named_levers = tuple(named) if isinstance(named, list) else (() if named is None else (named,))
    for lever in named_levers:
        if klass != "numerics" or lever not in levers:
            raise RulesError(f"rules {source}: {flag} names lever {lever!r}: only numerics arguments name a lever, "
                             f"one of {', '.join(levers)}")
    no_lever = entry.get("no_lever")
    if no_lever is not None and (klass != "numerics" or named_levers):
        raise RulesError(f"rules {source}: {flag} gives no_lever: only a numerics argument without a lever says why it has none")
    default = entry.get("default")
    if default is not None:
        if not isinstance(default, list) or not all(isinstance(word, str) for word in default):
            raise RulesError(f"rules {source}: {flag} default must be a list of strings")
        default = tuple(default)
    return ArgumentRule(klass=klass, reason=_text(entry.get("reason"), f"{flag} reason", source),
                        levers=named_levers, default=default, unordered=bool(entry.get("unordered", False)),
                        no_lever=None if no_lever is None else _text(no_lever, f"{flag} no_lever", source))


def parse_rules(data: Any, source: str) -> Rules:
    """Rules from the rules file's data; RulesError names the first entry that does not fit."""
    if not isinstance(data, dict):
        raise RulesError(f"rules {source}: expected a mapping at the top level")
    classes = data.get("classes")
    if not isinstance(classes, dict) or set(classes) != set(CLASSES):
        raise RulesError(f"rules {source}: classes must describe exactly {', '.join(CLASSES)}")
    levers = {name: LeverRule(name=name, description=lever.description,
                              tests=tuple(re.compile(title, re.IGNORECASE) for title in lever.titles))
              for name, lever in lever_catalogue().items()}
    for name, entry in (data.get("levers") or {}).items():
        if not isinstance(entry, dict) or not isinstance(entry.get("tests"), list) or not entry["tests"]:
            raise RulesError(f"rules {source}: lever {name} needs a list of test-title patterns")
        try:
            tests = tuple(re.compile(_text(p, f"lever {name} test", source), re.IGNORECASE) for p in entry["tests"])
        except re.error as error:
            raise RulesError(f"rules {source}: lever {name}: bad test-title pattern ({error})") from None
        levers[name] = LeverRule(name=name, description=_text(entry.get("description"), f"lever {name} description",
                                                              source), tests=tests)
    arguments = data.get("arguments")
    if not isinstance(arguments, dict) or not arguments:
        raise RulesError(f"rules {source}: arguments must be a mapping of flags")
    patterns = data.get("patterns") or {}
    if not isinstance(patterns, dict):
        raise RulesError(f"rules {source}: patterns must be a mapping of globs")
    for flag in [*arguments, *patterns]:
        if not isinstance(flag, str) or not flag.startswith("--"):
            raise RulesError(f"rules {source}: {flag!r} is not a flag (--name)")
    return Rules(
        source=source,
        classes={name: _text(classes[name], f"class {name}", source) for name in CLASSES},
        levers=levers,
        arguments={flag: _argument_rule(flag, entry, levers, source) for flag, entry in arguments.items()},
        patterns=tuple((glob, _argument_rule(glob, entry, levers, source)) for glob, entry in patterns.items()),
    )


def _read_rules(text: str, source: str) -> Rules:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        raise RulesError(f"rules {source}: malformed YAML{f' at line {mark.line + 1}' if mark else ''}") from None
    return parse_rules(data, source)


@cache
def default_rules() -> Rules:
    """The rules file shipped with the package (correctness/rules/arguments.yaml)."""
    text = resources.files("correctness.rules").joinpath("arguments.yaml").read_text(encoding="utf-8")
    return _read_rules(text, "correctness/rules/arguments.yaml")


def load_rules(path: str | Path | None = None) -> Rules:
    """A rules file; without a path, the package's own."""
    if path is None:
        return default_rules()
    raw = read_input(path, f"rules {path}", RulesError, limit=YAML_LIMIT, kind="a YAML file")  # never a FIFO, a folder
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise RulesError(f"rules {path}: not UTF-8 text") from None
    return _read_rules(text, str(path))


def _listed(values: tuple[str, ...] | None) -> list[str] | None:
    return None if values is None else list(values)


def _shown_values(values: tuple[str, ...] | None, default: tuple[str, ...] | None) -> str:
    if values is None:
        return f"(default {' '.join(default)})" if default is not None else "absent"
    return " ".join(values) if values else "on"


@dataclass(frozen=True)
class Change:
    """One argument that differs. Values are the words of the flag's last occurrence (argparse keeps
    the last); None where the flag is absent, () for a switch that is present."""

    flag: str
    candidate_values: tuple[str, ...] | None
    reference_values: tuple[str, ...] | None
    klass: str
    reason: str
    levers: tuple[str, ...] = ()  # the levers whose component tests the change needs
    # each lever's result in the candidate ("pass", "fail", ...); a lever without one is absent
    lever_results: Mapping[str, str] = field(default_factory=dict)
    default: tuple[str, ...] | None = None  # what an absent flag means, from the rules
    notes: tuple[str, ...] = ()
    # The recipe's correctness.convergence block passes: a format-limited lever counts only with it.
    convergence_passes: bool = False

    def result_of(self, lever: str) -> str | None:
        return self.lever_results.get(lever)

    @property
    def transition(self) -> str:
        """`reference -> candidate` as output shows it: `(default 1.0) -> 0.8`, `absent -> on`."""
        return f"{_shown_values(self.reference_values, self.default)} -> {_shown_values(self.candidate_values, self.default)}"

    @property
    def text(self) -> str:
        """`--flag reference -> candidate`."""
        return f"{self.flag} {self.transition}"

    def covers(self, result: str | None) -> bool:
        """Whether a lever result covers this change."""
        return result in (PASS, NO_KERNEL_CHANGE) or (result == FORMAT_LIMITED and self.convergence_passes)

    @property
    def kind(self) -> str:
        if self.reference_values is None:
            return "added"
        if self.candidate_values is None:
            return "removed"
        return "changed"

    @property
    def outcome(self) -> str:
        if self.klass == "must-match":
            return ERROR
        if self.klass == UNKNOWN:
            return REVIEW
        if self.klass != "numerics":
            return OK
        if not self.levers:  # its evidence is a convergence run (the rules' no_lever)
            return COVERED if self.convergence_passes else REVIEW
        results = [self.result_of(lever) for lever in self.levers]
        if FAIL in results:
            return FAILED
        if all(self.covers(result) for result in results):
            return COVERED
        return MISSING

    def to_dict(self) -> dict[str, Any]:
        return {
            "flag": self.flag, "kind": self.kind, "reference": _listed(self.reference_values),
            "candidate": _listed(self.candidate_values), "default": _listed(self.default), "class": self.klass,
            "reason": self.reason, "levers": list(self.levers),
            "lever_results": {lever: self.result_of(lever) for lever in self.levers},
            "convergence_passes": self.convergence_passes, "outcome": self.outcome, "notes": list(self.notes),
        }


@dataclass(frozen=True)
class Classification:
    recipe: str
    reference: str
    rules: str
    changes: tuple[Change, ...]
    lever_results: Mapping[str, str] = field(default_factory=dict)

    @property
    def verdict(self) -> str:
        outcomes = {change.outcome for change in self.changes}
        if outcomes & {ERROR, FAILED}:
            return "fail"
        if outcomes & {REVIEW, MISSING} or self.reference == MEGATRON_DEFAULTS:  # no reference: unjudged arguments
            return "incomplete"
        return "pass"

    def of_class(self, klass: str) -> list[Change]:
        return [change for change in self.changes if change.klass == klass]

    @property
    def counts(self) -> dict[str, int]:
        return {klass: len(self.of_class(klass)) for klass in (*CLASSES, UNKNOWN)}

    def to_dict(self) -> dict[str, Any]:
        return {
            "recipe": self.recipe, "reference": self.reference, "rules": self.rules, "verdict": self.verdict,
            "counts": self.counts, "lever_results": dict(self.lever_results),
            "changes": [change.to_dict() for change in self.changes],
        }


_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _word(word: str) -> tuple[int, float | str]:
    return (0, float(word)) if _NUMBER.fullmatch(word) else (1, word)


def _same(a: tuple[str, ...] | None, b: tuple[str, ...] | None, unordered: bool) -> bool:
    if a is None or b is None:
        return a is b
    left, right = [_word(w) for w in a], [_word(w) for w in b]
    return sorted(left) == sorted(right) if unordered else left == right


def _effective(arguments: Arguments, flag: str) -> tuple[str, ...] | None:
    occurrences = arguments.get(flag)
    return tuple(occurrences[-1]) if occurrences else None


def _repeats(arguments: Arguments, flag: str, side: str) -> list[str]:
    occurrences = arguments.get(flag) or []
    if len(occurrences) < 2:
        return []
    given = "; ".join(" ".join(values) or "(switch)" for values in occurrences)
    return [f"given {len(occurrences)} times in the {side} ({given}): the last counts"]


def is_cpu_entry(gpu: Any) -> bool:
    """An entry run on a CPU tier: `CPU`, or `CPU (<tier>)` for a tier other than the plain CPU one
    (correctness.entries.gpu_label)."""
    return isinstance(gpu, str) and (gpu == CPU_LABEL or gpu.startswith(f"{CPU_LABEL} ("))


def component_test_results(candidate: Recipe, rules: Rules, on_cpu: bool = False) -> dict[str, str]:
    """Lever -> result of the candidate's `correctness.component_tests` entries for it: an entry's
    `lever:` key names it, or else its `test:` title matches the lever's patterns. Only entries run
    on the recipe's own GPU count (a CPU-tier entry is not evidence at the recipe's shape), or, with
    `on_cpu`, only those of the CPU tiers (CPU evidence, shown as such). Among several entries for
    one lever the weakest evidence wins (correctness.results.weakest)."""
    entries = candidate.field("correctness.component_tests")
    if not isinstance(entries, list):
        raise RecipeError(f"recipe {candidate.id}: field correctness.component_tests must be a list")
    found: dict[str, list[str]] = {}
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise RecipeError(f"recipe {candidate.id}: correctness.component_tests[{index}] must be a mapping")
        if is_cpu_entry(entry.get("gpu")) != on_cpu or (not on_cpu and entry.get("gpu") not in (None, candidate.gpu)):
            continue
        result = str(entry.get("result"))
        if entry.get("lever") is not None:
            levers = [str(entry["lever"])]
        else:
            title = entry.get("test")
            if not isinstance(title, str):
                raise RecipeError(f"recipe {candidate.id}: correctness.component_tests[{index}] has neither "
                                  "a lever nor a test title")
            levers = [name for name, lever in rules.levers.items() if lever.matches(title)]
        for lever in levers:
            found.setdefault(lever, []).append(result)
    return {lever: weakest(results) for lever, results in found.items()}


def convergence_passes(candidate: Recipe) -> bool:
    """The recipe's correctness.convergence block says pass."""
    correctness = candidate.data.get("correctness")
    block = correctness.get("convergence") if isinstance(correctness, dict) else None
    return isinstance(block, dict) and block.get("result") == PASS


def _ordered_flags(candidate: Arguments, reference: Arguments) -> list[str]:
    return list(candidate) + [flag for flag in reference if flag not in candidate]


def classify(candidate: Recipe, reference_arguments: Arguments, rules: Rules | None = None,
             reference: str = "") -> Classification:
    """Class every argument in which the candidate's train.py command differs from the reference's.

    `reference_arguments` is flag -> values per occurrence, as `training_arguments` parses a run
    script; `reference` only names where they came from. The candidate's component tests are read
    only when a numerics change has a lever."""
    rules = rules or default_rules()
    arguments = candidate.arguments
    if not arguments:
        raise RecipeError(f"recipe {candidate.id}: field run has no train.py command")
    changes = []
    for flag in _ordered_flags(arguments, reference_arguments):
        rule = rules.rule(flag)
        mine, theirs = _effective(arguments, flag), _effective(reference_arguments, flag)
        default = rule.default if rule else None
        if _same(mine if mine is not None else default, theirs if theirs is not None else default,
                 bool(rule and rule.unordered)):
            continue
        notes = _repeats(arguments, flag, "candidate") + _repeats(reference_arguments, flag, "reference")
        if rule is None:
            changes.append(Change(flag, mine, theirs, UNKNOWN, "not in the rules file: needs review",
                                  notes=tuple(notes)))
        else:
            changes.append(Change(flag, mine, theirs, rule.klass, rule.reason, levers=rule.levers, default=default,
                                  notes=tuple(notes)))
    results = component_test_results(candidate, rules) if any(change.levers for change in changes) else {}
    converged = convergence_passes(candidate)
    changes = [
        replace(change, lever_results={lever: results[lever] for lever in change.levers if lever in results},
                convergence_passes=converged)
        for change in changes
    ]
    return Classification(recipe=candidate.id, reference=reference, rules=rules.source, changes=tuple(changes),
                          lever_results=results)


def defaults_reference(candidate: Recipe, rules: Rules) -> dict[str, list[list[str]]]:
    """The arguments of a reference that differs from the candidate only where the candidate sets a
    numerics argument to anything but its default: each numerics argument at its default from the
    rules (absent where the rules give none, so that a switch, or a value whose default the rules do
    not know, counts as changed); every other argument as the candidate gives it."""
    reference: dict[str, list[list[str]]] = {}
    for flag, occurrences in candidate.arguments.items():
        rule = rules.rule(flag)
        if rule is None or rule.klass != "numerics":
            reference[flag] = occurrences
        elif rule.default is not None:
            reference[flag] = [list(rule.default)]
    return reference


def classify_against_defaults(candidate: Recipe, rules: Rules | None = None) -> Classification:
    """classify() where the recipe has no reference: its numerics arguments against Megatron's
    defaults (defaults_reference); no other argument can be judged without a reference."""
    rules = rules or default_rules()
    return classify(candidate, defaults_reference(candidate, rules), rules, reference=MEGATRON_DEFAULTS)


def reference_path(candidate: Recipe) -> Path:
    """The default reference of a recipe: fixtures/references/<recipe id>.yaml."""
    return REFERENCES_DIR / f"{candidate.id}.yaml"


def load_reference(path: str | Path) -> dict[str, list[list[str]]]:
    """The training arguments of a reference file: any YAML mapping with a `run:` script holding a
    train.py command (a reference file under fixtures/references/, or a whole recipe)."""
    path = Path(path)
    label = f"reference {path}"
    data = load_yaml(read_yaml_input(path, label), label)  # the recipes' limits: size, aliases, depth
    if not isinstance(data, dict) or "run" not in data:
        raise RecipeError(f"reference {path}: missing field run")
    if not isinstance(data["run"], str):
        raise RecipeError(f"reference {path}: field run must be a script")
    try:
        arguments = training_arguments(data["run"])
    except ValueError as error:
        raise RecipeError(f"reference {path}: field run cannot be split into words ({error})") from None
    if not arguments:
        raise RecipeError(f"reference {path}: field run has no train.py command")
    return arguments


def classify_recipe(candidate: Recipe, reference: str | Path | None = None,
                    rules: Rules | None = None) -> Classification:
    """classify() against a reference file: the given one, or the recipe's default reference."""
    path = Path(reference) if reference is not None else reference_path(candidate)
    if reference is None and not path.is_file():
        raise RecipeError(f"reference {path}: no such file, the default reference of recipe {candidate.id} "
                          "(give one with --reference)")
    return classify(candidate, load_reference(path), rules, reference=str(path))
