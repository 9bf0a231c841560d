"""What this suite would have run for a recipe: a record's lever declaration rebuilt, and the first
place the record differs from it.

A record states its lever's declaration (its cases, their shapes, which are required, the controls
and which apply to each case, the rule, the format floor) beside its figures. Recomputing the
figures (correctness.recheck) holds a record to itself; an edit that keeps it self-consistent (a
failing case deleted with its entry in `lever.cases`, a required case made optional, a Gemma record
relabelled as Llama's) passes that. So every reader that takes a record as evidence for a recipe
rebuilds the declaration from the recipe and its model's facts with the code `correctness run`
collects with (the lever's spec and tier factories, `tier_levers`), and refuses a record that
differs, naming the first difference (`declaration_difference`).

The model facts are the suite's own for the recipe's model, or the file the record names as their
source where the suite has none (a --model-config run), held to the sha256 the record states.
"""

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from correctness.errors import CorrectnessError, RecipeError
from correctness.lever import Case, Lever, LeverOptions, NotApplicable, declaration_only
from correctness.recipe_sets import at_recipes
from correctness.recipes import Recipe
from correctness.results import LeverRecord, jsonable

LeverFactory = Callable[[LeverOptions], list[Lever]]


def tier_levers(factory: LeverFactory, options: LeverOptions) -> list[Lever]:
    """A `levers` factory's levers as a run records them: each at the scale it was built at, and once
    per record and recipe (with --recipe, each fixture recipe a test names stands for the user's, so
    the same lever comes once from each). NotApplicable or OverMemory as the factory raises them."""
    unique: dict[str, Lever] = {}
    for lever in options.recorded(factory(options)):
        unique.setdefault(f"{lever.record_id}|{lever.recipe.id}", lever)
    return list(unique.values())


def _model_facts(record: LeverRecord, recipe: Recipe) -> Any:
    """The facts the record's shapes were built from, where they are not the suite's own (None)."""
    from correctness.models import load_facts, load_model

    stated_source, stated_sha = record.recipe.model_facts, record.recipe.model_facts_sha256
    if stated_source is None:
        return None
    try:
        own = load_model(recipe.model)
    except RecipeError:
        own = None
    if own is not None and own.sha256 == stated_sha:
        return None
    if not Path(stated_source).exists():
        where = f"the suite's facts of {recipe.model} are {own.source}" if own is not None else \
            f"the suite has no facts of {recipe.model}"
        raise CorrectnessError(f"its model facts {stated_source} are not there to rebuild its cases from ({where})")
    given = load_facts(stated_source)
    if given.sha256 != stated_sha:
        raise CorrectnessError(f"its model facts {stated_source} changed since it ran (sha256 {stated_sha[:12]} then,"
                               f" {given.sha256[:12]} now)")
    return given


def rebuilt_lever(record: LeverRecord, recipe: Recipe) -> Lever:
    """The lever this suite builds for the recipe that makes a record of this record's id, at the
    record's scale; CorrectnessError (one line) where the suite builds none."""
    from correctness.registry import known_lever

    name, record_id = record.lever["name"], record.lever["record_id"]
    spec = known_lever(name)
    if spec is None:
        raise CorrectnessError(f"its lever {name} is not one of this suite's (`correctness levers` lists them), so"
                               " the declaration it states cannot be rebuilt")
    scale = record.lever.get("scale") or "smoke"
    try:
        options = LeverOptions(recipe=recipe, model=_model_facts(record, recipe), scale=scale)
    except ValueError as error:
        raise CorrectnessError(f"its lever.scale is not a scale ({error})") from None
    reasons = []
    with declaration_only():
        for test in spec.tests:
            try:
                levers = tier_levers(at_recipes(test.factory, test.recipes), options)
            except NotApplicable as reason:
                reasons.append(str(reason))
                continue
            found = next((lever for lever in levers if lever.record_id == record_id), None)
            if found is not None:
                return found
    why = f" ({'; '.join(dict.fromkeys(reasons))})" if reasons else ""
    raise CorrectnessError(f"this suite makes no record {record_id} for recipe {recipe.id}{why}")


def _summary_difference(stated: Mapping[str, Any], rebuilt: Mapping[str, Any]) -> str | None:
    for key, value in rebuilt.items():
        if key not in stated:
            return f"its lever states no {key}"
        if stated[key] == value:
            continue
        if isinstance(value, list) and isinstance(stated[key], list):
            extra = [item for item in stated[key] if item not in value]
            lacking = [item for item in value if item not in stated[key]]
            if extra or lacking:
                return (f"its lever.{key} " + (f"names {_shown(extra[0])}, which the lever does not declare" if extra
                                               else f"lacks {_shown(lacking[0])}, which the lever declares"))
            return f"its lever.{key} is in another order than the lever declares"
        return f"its lever.{key} is {_shown(stated[key])} where the lever declares {_shown(value)}"
    extra = sorted(set(stated) - set(rebuilt))
    return f"its lever states {extra[0]}, which no lever declares" if extra else None


def _first_field(name: str, stated: Any, declared: Any) -> tuple[str, Any, Any]:
    """The first field of two differing mappings that differs (shape.tp_size), else the whole."""
    if isinstance(stated, Mapping) and isinstance(declared, Mapping):
        for key in [*declared, *(key for key in stated if key not in declared)]:
            if stated.get(key) != declared.get(key):
                return _first_field(f"{name}.{key}", stated.get(key), declared.get(key))
    return name, stated, declared


def _shown(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 100 else text[:97] + "..."


IDENTITY = ("source", "variant", "seed", "shape", "required", "expected_backend", "recipe_runs")


def _case_difference(stated: Mapping[str, Any], case: Case, lever: Lever) -> str | None:
    """Where a record's case (its JSON form) differs from the lever's declaration of it: its identity
    (shape, seed, whether it is required, ...), and, where it was judged, the controls that apply to
    it and the format's controls."""
    from correctness.harness import case_identity

    where = f"case {case.id}"
    declared = jsonable(case_identity(case))
    for key in IDENTITY:
        if stated.get(key) != declared[key]:
            field, value, wanted = _first_field(key, stated.get(key), declared[key])
            return f"{where} states {field} {_shown(value)} where the lever declares {_shown(wanted)}"
    if stated.get("candidate") is None:
        return None  # skipped, or failed before it was judged: no control ran
    applies = [(control.name, control.why_inapplicable(case)) for control in lever.controls]
    controls = [(control.get("name"), control.get("inapplicable_reason")) for control in stated.get("controls", [])]
    if controls != applies:
        return _controls_difference(where, controls, applies)
    missing = [name for (name, why), control in zip(applies, stated["controls"]) if why is None and
               control.get("judgement") is None]
    if missing:
        return f"{where} has no judgement of its control '{missing[0]}', which applies to it"
    floor = stated.get("format")
    if (floor is None) != (lever.format_floor is None):
        return (f"{where} has format figures where the lever declares no format floor" if floor is not None
                else f"{where} has no format figures where the lever declares a {lever.format_floor.format} floor")
    if floor is not None:
        names = [control.get("name") for control in floor.get("controls", [])]
        declared_names = [name for name, why in applies if why is None]
        if names != declared_names:
            lacking = [name for name in declared_names if name not in names]
            return (f"{where} lacks the format control '{lacking[0]}', which applies to it" if lacking
                    else f"{where} states format controls {names} where the lever's that apply are {declared_names}")
    return None


def _controls_difference(where: str, stated: list, declared: list) -> str:
    stated_names, declared_names = [name for name, _ in stated], [name for name, _ in declared]
    lacking = [name for name in declared_names if name not in stated_names]
    if lacking:
        return f"{where} lacks the control '{lacking[0]}', which the lever declares"
    extra = [name for name in stated_names if name not in declared_names]
    if extra:
        return f"{where} states a control '{extra[0]}', which the lever does not declare"
    if stated_names != declared_names:
        return f"{where} states its controls in another order or more than once"
    name, why = next((s, d) for s, d in zip(stated, declared) if s != d)
    return (f"{where} states that its control '{name[0]}' "
            + (f"does not apply ({name[1]}) where it applies" if why[1] is None
               else f"applies where it does not ({why[1]})"))


def declaration_difference(record: LeverRecord, data: Mapping[str, Any], recipe: Recipe) -> str | None:
    """The first place the record (typed, and its JSON form as read) differs from the declaration
    this suite builds for the recipe, in words; None where it is what the suite would have run."""
    from correctness.harness import lever_summary

    try:
        lever = rebuilt_lever(record, recipe)
    except (CorrectnessError, ValueError) as error:
        return str(error)
    found = _summary_difference(data["lever"], lever_summary(lever))
    if found:
        return found
    stated_facts, built_facts = record.recipe.model_facts_sha256, lever.recipe.model_facts_sha256
    if stated_facts != built_facts:
        return (f"its shapes come from model facts of sha256 {str(stated_facts)[:12]}, the recipe's model has"
                f" {str(built_facts)[:12]}")
    cases = {case.id: case for case in lever.cases}
    seen: set[str] = set()
    for stated in data["cases"]:
        case_id = stated.get("case_id")
        if case_id in seen:
            return f"case {case_id} appears twice"
        seen.add(case_id)
        if case_id not in cases:
            return f"case {case_id} is not one the lever declares for recipe {recipe.id}"
        found = _case_difference(stated, cases[case_id], lever)
        if found:
            return found
    return None
