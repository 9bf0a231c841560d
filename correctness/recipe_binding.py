"""A record is for one recipe: the values of the recipe arguments its lever reads, and its folder.

A lever's spec declares the arguments its factories read (`LeverSpec.reads`: run-script flags such
as "--optimizer-offload-fraction" and dotted recipe fields such as "layout.tp"). Its record
carries their values in the recipe it ran (`recipe.arguments`, with their sha256), and
`argument_differences` names those another recipe sets otherwise: an offload record of fraction
0.9 is not evidence for a recipe of 0.5, nor for one that does not offload.

A record's folder is its recipe's id and a short hash of where the recipe lies
(correctness.results.record_path).
"""

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from correctness.errors import RecipeError
from correctness.results import RecipeRef
from correctness.recheck import arguments_sha256
from correctness.recipes import Recipe, load_recipe

def recipe_values(recipe: Recipe, names: Iterable[str]) -> dict[str, Any]:
    """The recipe's value of each argument: a flag's values at its last occurrence ([] for a switch),
    a field's value; None where the recipe does not set it."""
    values: dict[str, Any] = {}
    for name in names:
        if name.startswith("--"):
            values[name] = recipe.argument(name)
        else:
            try:
                values[name] = recipe.field(name)
            except RecipeError:  # a missing field: unset
                values[name] = None
    return values


def bound_ref(ref: RecipeRef, reads: Iterable[str]) -> RecipeRef:
    """The recipe reference a record carries: with the values of the arguments its lever reads, read
    from the recipe file the lever was built from (none for a reference to no file)."""
    if ref.path is None:
        return ref
    recipe = load_recipe(ref.path)
    if recipe.sha256 != ref.sha256:
        raise RecipeError(f"recipe {ref.path} changed while its levers ran (sha256 {ref.sha256[:12]} when they were"
                          f" built, {recipe.sha256[:12]} now): run them again")
    arguments = recipe_values(recipe, reads)
    return dataclasses.replace(ref, arguments=arguments, arguments_sha256=arguments_sha256(arguments))


def argument_differences(arguments: Mapping[str, Any], recipe: Recipe, reads: Iterable[str]) -> list[str]:
    """"NAME VALUE, the recipe has VALUE" for each argument the lever reads that the record's run
    (`arguments`) and the recipe set otherwise; a record without an argument's value counts as
    another value."""
    differences = []
    for name, value in recipe_values(recipe, reads).items():
        stated = arguments.get(name, "(not recorded)")
        if stated != value:
            differences.append(f"{name} {_shown(stated)}, the recipe has {_shown(value)}")
    return differences


def _shown(value: Any) -> str:
    if value is None:
        return "(not set)"
    if isinstance(value, list):
        return "(switch)" if not value else " ".join(str(v) for v in value)
    return str(value)
