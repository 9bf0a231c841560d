"""What a record must be to count as evidence for a recipe: the one check every reader of records
applies (`attach`, `report`, `levers --results`).

A record is trusted for a recipe where:
- it reads back as written: every figure, flag and verdict is what its measurements give
  (correctness.recheck), and its rule is the suite's;
- it is what this suite would have run for the recipe: its lever's declaration, rebuilt from the
  recipe and its model's facts (correctness.declaration), is the one it states (cases, shapes,
  required cases, controls, rule, format floor);
- it is of the recipe's model and GPU, ran with the recipe's values of the arguments its lever
  reads, by this suite's version of its lever, on the device its tier names (a CUDA tier on a CUDA
  device of the tier's GPU or a stand-in for it);
- every case's status is what its figures say (correctness.recheck.case_problems);
- it was not made on an emulated GPU (code paths, never numbers).

`attach` asks more of a record it writes into a recipe (`attach_problems`): a finished run, every
declared case present, and a case that ran. The recipe a reader holds a record to is the one it is
given, else the record's own: the file at the path it names, else the fixture recipe of its id.
"""

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from correctness.catalogue import catalogued, lever_reads
from correctness.entries import count, counted
from correctness.errors import CorrectnessError
from correctness.recipes import Recipe, load_recipe
from correctness.results import (
    SKIP, LeverRecord, emulated_sentence, read_record, record_from_json, records_folder, stated_fields_disagree,
)
from correctness.tiers import GPU_MARKERS, stand_in_between

RECORDS_FOLDER = re.compile(r".+\.[0-9a-f]{8}")  # a recipe's records folder: <recipe name>.<hash of its path>


@dataclass(frozen=True)
class TrustedRecord:
    path: Path
    data: dict[str, Any]  # the record's JSON form, as read
    record: LeverRecord
    recipe: Recipe  # the recipe it was held to


def device_problem(record: LeverRecord) -> str | None:
    """Where the device the record ran on is not its tier's: a CUDA tier on a CPU, a CPU tier on a
    GPU, a recipe GPU's tier (h100) on another GPU that is no stand-in of its architecture."""
    device = record.provenance.get("device") or {}
    tier, wanted = record.lever["tier"], record.lever["device"]
    if device.get("type") != wanted:
        return f"its {tier} tier runs on {wanted}, but its provenance says it ran on {device.get('type')}"
    gpu = GPU_MARKERS.get(tier)
    ran = device.get("gpu_type")
    if gpu is not None and ran != gpu and stand_in_between(ran, gpu) is None:
        return f"its {tier} tier is the {gpu}'s, but it ran on {ran or device.get('name')}"
    return None


def record_problems(record: LeverRecord, recipe: Recipe, stated: dict[str, Any], emulated: bool = False) -> list[str]:
    """Why a record is no evidence for the recipe (see the module's docstring); empty where it is.
    `stated`: the record as read, whose fields written from others must agree with them. `emulated`:
    a record of an emulated GPU is read (a report shows it as such, never as evidence), held to
    itself and to the recipe's arguments, not to the GPU's declaration or device."""
    from correctness.declaration import declaration_difference
    from correctness.model_config import same_model
    from correctness.recheck import case_problems, recomputed, rule_problem
    from correctness.recipe_binding import argument_differences

    on_emulated = record.emulated_gpu is not None
    if on_emulated and not emulated:
        return [emulated_sentence(record.emulated_gpu)]
    problems = []
    disagreement = stated_fields_disagree(stated)
    if disagreement:
        problems.append(f"it contradicts itself: {disagreement}")
    lever = record.lever
    if not same_model(record.recipe.model, recipe.model):
        problems.append(f"it is for {record.recipe.model}, not {recipe.model}")
    elif record.recipe.gpu != recipe.gpu:
        problems.append(f"it is for the {record.recipe.gpu} recipe {record.recipe.id}, not an {recipe.gpu} one")
    differences = argument_differences(record.recipe.arguments, recipe, lever_reads(lever["name"]))
    if differences:
        problems.append(f"it ran recipe {record.recipe.id} with other arguments than this recipe's: {'; '.join(differences)}")
    known = catalogued(lever["name"])
    if known and lever["version"] != known.version:
        problems.append(f"it was written by {lever['name']} version {lever['version']}, this suite has {known.version}")
    if not problems and not on_emulated:
        difference = declaration_difference(record, stated, recipe)
        if difference:
            problems.append(f"it is not what this suite runs for recipe {recipe.id}: {difference}")
    device = None if on_emulated else device_problem(record)
    if device:
        problems.append(device)
    if rule_problem(lever) is None:
        for case in recomputed(record).cases:
            problems += case_problems(case, lever)
    return problems


def attach_problems(record: LeverRecord) -> list[str]:
    """What attach asks of a record beyond trust: a finished run, every declared case, a case that ran."""
    problems = ["its run was interrupted before it finished"] if record.interrupted else []
    expected, completeness = record.assessment()
    if completeness.missing:
        problems.append(
            f"it lacks {count(len(completeness.missing))} of the {counted(completeness.declared, 'case')} its lever"
            f" declares ({', '.join(completeness.missing)})"
        )
    if expected == SKIP:
        problems.append("none of its cases ran")
    if record.verdict != expected:
        problems.append(f"its verdict is {record.verdict} but its cases say {expected}")
    return problems


def record_recipe(record: LeverRecord, path: Path) -> Recipe:
    """The recipe a record names: the file at its recorded path, else the fixture recipe of its id
    (a record made in another checkout); refused in one line where neither is there."""
    from correctness.fixtures import recipe_path

    places = [Path(record.recipe.path)] if record.recipe.path else []
    for where in (*places, recipe_path(record.recipe.id)):
        if where.is_file():
            return load_recipe(where)
    raise CorrectnessError(f"result record {path}: its recipe {record.recipe.id} is not at {record.recipe.path}, to"
                           " hold the record to (put the recipe back there)")


def folder_problem(path: Path, record: LeverRecord) -> str | None:
    """Where a record lies in another recipe's records folder (its name and hash are the recipe's)."""
    folder = path.parent.name
    own = records_folder({"id": record.recipe.id, "path": record.recipe.path}, Path(".")).name
    if RECORDS_FOLDER.fullmatch(folder) and folder != own:
        return f"it lies in the records folder {folder}, but names recipe {record.recipe.id} (whose folder is {own})"
    return None


def trusted_record(path: str | Path, recipe: Recipe | None = None, emulated: bool = False) -> TrustedRecord:
    """The record at `path`, held to `recipe` (default: its own, record_recipe); refused in one line
    naming the file and the first problems where it is no evidence for that recipe (`emulated`: an
    emulated GPU's record is read, see record_problems)."""
    path = Path(path)
    data = read_record(path)
    record = record_from_json(data)
    held_to = recipe if recipe is not None else record_recipe(record, path)
    problems = record_problems(record, held_to, data, emulated)
    misplaced = folder_problem(path, record)
    if misplaced:
        problems.insert(0, misplaced)
    if problems:
        raise CorrectnessError(f"result record {path} refused: {'; '.join(problems)}")
    return TrustedRecord(path=path, data=data, record=record, recipe=held_to)


def trusted_records(paths: Sequence[str | Path], recipe: Recipe | None = None,
                    emulated: bool = False) -> list[TrustedRecord]:
    return [trusted_record(path, recipe, emulated) for path in paths]
