"""Attach lever records to a recipe: each record becomes a correctness.component_tests entry.

An entry for the same test and GPU is replaced in place, others are appended (a convergence check
replaces the correctness.convergence block); every other byte of
the recipe stays as it was (round-trip YAML), and the file is replaced atomically, only after the
new recipe has passed the schema. A record that is no evidence for the recipe (correctness.trust:
it contradicts itself, is not what this suite runs for the recipe, belongs to another model, ran
other values of the arguments its lever reads, or was written by another version of a lever), or
lacks a case its lever declares, ran no case, or was interrupted, is refused, and the recipe is
left untouched. An `incomplete` verdict (a required case
skipped) is written as it is, never as a pass.

Each attach is one read-modify-write cycle under an advisory lock on the recipe (correctness.files
.locked: `.NAME.lock` beside it; see there for what it does on NFS), so that two attaches to one
recipe at once both land, one after the other. A read-only recipe (no write bit) is refused before
anything is read; a symlinked recipe is written through to its target. `--dry-run` takes no lock
and needs no write access.
"""

import contextlib
import dataclasses
import datetime
import importlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from correctness.catalogue import catalogued
from correctness.entries import errors_sentence, format_sentence, generic_text, gpu_label
from correctness.errors import CorrectnessError, RecipeError
from correctness.files import locked, refuse_read_only, shown_path
from correctness.recipes import load_recipe, validate_recipe
from correctness.results import LeverRecord, read_record, records_folder
from correctness.trust import attach_problems, record_problems
from correctness.yaml_documents import load_document, write_recipe

ENTRY_FIELDS = ("test", "shape", "gpu", "date", "result", "detail", "note")


@dataclass(frozen=True)
class Attached:
    test: str
    gpu: str
    result: str
    action: str  # "added" or "replaced"


def entry_text(record: LeverRecord) -> dict[str, str]:
    known = catalogued(record.lever["name"])
    if known is None or known.wording is None or not record.ran_cases():
        return generic_text(record)
    return importlib.import_module(known.wording).entry_text(record)


def component_test_entry(record: LeverRecord) -> dict[str, Any]:
    text = entry_text(record)
    detail = "; ".join(part for part in (text["detail"], format_sentence(record), errors_sentence(record)) if part)
    return {
        "test": record.lever["description"],
        "shape": text["shape"],
        "gpu": gpu_label(record),
        "date": datetime.date.fromisoformat(record.finished[:10]),
        "result": record.verdict,
        "detail": detail,
        "note": text["note"],
    }


PLAIN_UNSAFE = (": ", " #")
PLAIN_UNSAFE_START = tuple("!&*-?[]{}|>'\"%@`#,")


def _styled(value: Any) -> Any:
    """A string the recipes would quote goes in single quotes, as theirs do; others stay plain."""
    from ruamel.yaml.scalarstring import SingleQuotedScalarString

    if isinstance(value, str) and (any(s in value for s in PLAIN_UNSAFE) or value.startswith(PLAIN_UNSAFE_START)):
        return SingleQuotedScalarString(value)
    return value


def _component_tests(document: Any, name: str) -> Any:
    from ruamel.yaml.comments import CommentedSeq

    block = document.get("correctness") if hasattr(document, "get") else None
    if block is None:
        raise RecipeError(f"recipe {name}: no correctness block to attach to")
    tests = block.get("component_tests")
    if tests is None or (isinstance(tests, list) and not tests):
        tests = CommentedSeq()  # block style, also where the recipe had a flow-style []
        block["component_tests"] = tests
    return tests


@contextlib.contextmanager
def editing(recipe_path: str | Path, dry_run: bool = False) -> Iterator[None]:
    """The recipe's read-modify-write cycle: refused where the recipe is read-only, and serialised
    with every other attach to it by its lock (nothing for a dry run, which writes nothing)."""
    if dry_run:
        yield
        return
    label = f"recipe {recipe_path}"
    refuse_read_only(recipe_path, label, RecipeError)
    with locked(recipe_path, label, RecipeError):
        yield


def recipe_records(recipe_path: str | Path, results_dir: Path) -> list[Path]:
    """The records of a recipe's own folder in results_dir (records_folder; an interrupted run's lie
    in its hidden `.interrupted/`, left out here, and attach refuses one anywhere); RecipeError where
    there are none."""
    recipe = load_recipe(recipe_path)
    folder = records_folder(dataclasses.asdict(recipe.ref), results_dir)
    paths = sorted(folder.glob("*.json"))
    if not paths:
        raise RecipeError(f"recipe {recipe.id}: no records in {shown_path(folder)} (run it first)")
    return paths


def attach(recipe_path: str | Path, record_paths: Sequence[str | Path], dry_run: bool = False) -> list[Attached]:
    """Attach every record (all or none) and write the recipe once, under its lock; return what was done."""
    with editing(recipe_path, dry_run):
        return _attach(recipe_path, record_paths, dry_run)


def _attach(recipe_path: str | Path, record_paths: Sequence[str | Path], dry_run: bool) -> list[Attached]:
    from ruamel.yaml.comments import CommentedMap

    recipe = load_recipe(recipe_path)
    validate_recipe(recipe.data, recipe.id)
    records = []
    for path in record_paths:
        data = read_record(path)
        record = LeverRecord.from_json(data)
        problems = record_problems(record, recipe, data) + attach_problems(record)
        if problems:
            raise CorrectnessError(f"record {path} refused, recipe {recipe_path} untouched: {'; '.join(problems)}")
        records.append((Path(path), record))
    document = load_document(recipe_path)
    tests = _component_tests(document, recipe.id)
    done = []
    for _, record in records:
        entry = CommentedMap((key, _styled(value)) for key, value in component_test_entry(record).items())
        at = next(
            (i for i, old in enumerate(tests) if old.get("test") == entry["test"] and old.get("gpu") == entry["gpu"]),
            None,
        )
        if at is None:
            tests.append(entry)
        else:
            tests[at] = entry
        done.append(Attached(test=entry["test"], gpu=entry["gpu"], result=entry["result"],
                             action="added" if at is None else "replaced"))
    validate_recipe(document, recipe.id)
    if not dry_run:
        write_recipe(recipe_path, document)
    return done


def attach_convergence(recipe_path: str | Path, block: dict[str, Any], note: str) -> None:
    """Replace the recipe's correctness.convergence with a checked block (the same atomic,
    byte-preserving write, under the same lock, as the component tests')."""
    from ruamel.yaml.comments import CommentedMap

    with editing(recipe_path):
        recipe = load_recipe(recipe_path)
        validate_recipe(recipe.data, recipe.id)
        document = load_document(recipe_path)
        correctness = document.get("correctness")
        if correctness is None:
            raise RecipeError(f"recipe {recipe.id}: no correctness block to attach to")
        correctness["convergence"] = CommentedMap(
            [(key, _styled(value)) for key, value in block.items()] + [("note", _styled(note))]
        )
        validate_recipe(document, recipe.id)
        write_recipe(recipe_path, document)
