"""The records a report is made of: lever record files, or results folders searched for them, each
held to its recipe as `attach` holds it (correctness.trust: a record that contradicts itself, is
not what this suite runs for its recipe, or lies in another recipe's records folder is refused; an
emulated GPU's is read, and shown as such), and grouped by recipe."""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from correctness.errors import CorrectnessError
from correctness.results import LeverRecord
from correctness.trust import trusted_record


@dataclass(frozen=True)
class LoadedRecord:
    path: Path
    data: dict[str, Any]  # the record's JSON form, as read
    record: LeverRecord

    @property
    def recipe_key(self) -> tuple[str, str | None]:
        """A recipe as its records' folder tells recipes apart: its id and where it lies."""
        return self.record.recipe.id, self.record.recipe.path


def record_files(paths: Sequence[str | Path]) -> list[Path]:
    """The record files the paths name: each file as given, and every *.json below each folder
    (not under a hidden folder: a run's parts, or records kept beside the lever's own:
    correctness.record_store), once each, in the order given."""
    found: list[Path] = []
    for given in paths:
        path = Path(given)
        if path.is_dir():
            inside = sorted(file for file in path.rglob("*.json")
                            if not any(part.startswith(".") for part in file.relative_to(path).parts))
            if not inside:
                raise CorrectnessError(f"results folder {path}: no lever record (*.json) in it")
            found += inside
        elif path.exists() or path.is_symlink():
            found.append(path)
        else:
            raise CorrectnessError(f"{path}: no such record file or results folder")
    unique = {file.resolve(): file for file in reversed(found)}
    return [file for file in found if unique[file.resolve()] is file]


def load_records(paths: Sequence[str | Path]) -> list[LoadedRecord]:
    """Every record the paths name, read, held to its recipe and typed; a file that is not a record
    of this suite's format, or no evidence for its recipe, is refused in one line naming it."""
    loaded = []
    for path in record_files(paths):
        trusted = trusted_record(path, emulated=True)
        loaded.append(LoadedRecord(path=path, data=trusted.data, record=trusted.record))
    return loaded


def by_recipe(records: Iterable[LoadedRecord]) -> dict[tuple[str, str | None], list[LoadedRecord]]:
    """The records of each recipe, in the order the recipes first come."""
    grouped: dict[tuple[str, str | None], list[LoadedRecord]] = {}
    for loaded in records:
        grouped.setdefault(loaded.recipe_key, []).append(loaded)
    return grouped


def one_recipe(records: Sequence[LoadedRecord]) -> list[LoadedRecord]:
    """The records, where all are of one recipe; else refused, naming two of the recipes."""
    groups = list(by_recipe(records))
    if len(groups) > 1:
        (first, first_path), (second, second_path) = groups[:2]
        if first == second:
            first, second = f"{first} ({first_path})", f"{second} ({second_path})"
        more = f" (and {len(groups) - 2} more)" if len(groups) > 2 else ""
        raise CorrectnessError(f"records of two recipes, {first} and {second}{more}: one report file (-o) is for one"
                               " recipe's records; leave out -o to write one report per recipe")
    return list(records)
