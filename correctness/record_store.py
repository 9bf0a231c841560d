"""Where a lever record goes in a results folder: a record is only ever replaced by one at least as
complete.

`<results>/<recipe folder>/<record id>.json` (correctness.results.record_path) holds the record of
one lever run: one lever, tier and candidate (the record id) on one recipe. A new record takes that
place where it is not interrupted and decided every declared case the record there decided: ran
(pass, no kernel change, format-limited) or failed; a skipped case decided nothing. Otherwise it is
written beside, in a hidden folder of the same folder, under the same name:

- `.interrupted/<record id>.json`: a record of a session stopped (Ctrl-C, SIGTERM) before every case
  it selected of the lever had run (`interrupted: true`), whether or not a record was held;
- `.partial/<record id>.json`: a record that decided fewer of the declared cases than the one held (a
  run of some cases only, a case that skipped where the held record ran it).

So an interrupted run never turns a complete record into an empty one, and a failure is never
hidden: a run whose case failed where the held record's passed decided that case, and replaces it.
Readers of a results folder pass over hidden folders (correctness.evidence.read_results, a shell's
`results/<recipe>/*.json`), so a record kept beside is no evidence; the session that wrote it shows
where it went. A later record of the same kind beside replaces the one there.

A file in the record's place that this suite cannot read as a record (another format version, a
broken file) holds no evidence it could keep: a record that is not interrupted replaces it.
"""

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from correctness.errors import CorrectnessError
from correctness.results import SKIP, LeverRecord, read_record, record_path, record_to_json, write_record

INTERRUPTED_FOLDER = ".interrupted"
PARTIAL_FOLDER = ".partial"
WHY_BESIDE = {
    INTERRUPTED_FOLDER: "interrupted before every case it selected had run: kept beside the lever's record",
    PARTIAL_FOLDER: "fewer cases decided than the record held: kept beside it, not in its place",
}


def store_record(record: LeverRecord | Mapping[str, Any], results_dir: Path) -> Path:
    """Write a record (or its JSON form) where it belongs in `results_dir` (see the module's
    docstring), atomically; return its path."""
    data = record_to_json(record) if isinstance(record, LeverRecord) else record
    place = record_path(data, results_dir)
    if data["interrupted"]:
        return write_record(data, results_dir, beside(place, INTERRUPTED_FOLDER))
    held = decided_cases_held(place)
    if held is not None and not held <= decided_cases(data):
        return write_record(data, results_dir, beside(place, PARTIAL_FOLDER))
    return write_record(data, results_dir, place)


def beside(place: Path, folder: str) -> Path:
    """The path of a record kept beside the one at `place`."""
    return place.parent / folder / place.name


def why_beside(path: Path) -> str | None:
    """Why a record store_record wrote to `path` was kept beside the lever's record; None where it
    took the record's own place."""
    return WHY_BESIDE.get(Path(path).parent.name)


def decided_cases(data: Mapping[str, Any]) -> set[str]:
    """The declared cases a record (JSON form) decided: each that ran or failed."""
    declared = set(data["lever"]["cases"])
    return {case["case_id"] for case in data["cases"] if case["status"] != SKIP and case["case_id"] in declared}


def decided_cases_held(place: Path) -> set[str] | None:
    """The cases the record at `place` decided; None where no record of this suite's is there."""
    if not place.is_file():
        return None
    try:
        return decided_cases(read_record(place))
    except CorrectnessError:
        return None
