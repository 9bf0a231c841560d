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
  run of some cases only, a case that skipped where the held record ran it);
- `.emulated/<record id>.json`: a record made on an emulated GPU (`provenance.emulated_gpu`,
  correctness.emulated_gpu), always (in `.interrupted/` where it was cut short): it proves code
  paths, never numbers, so it never takes the place of a record that could be evidence.

So an interrupted run never turns a complete record into an empty one, and a failure is never
hidden: a run whose case failed where the held record's passed decided that case, and replaces it.
Readers of a results folder pass over hidden folders (correctness.evidence.read_results, a shell's
`results/<recipe>/*.json`), so a record kept beside is no evidence; the session that wrote it shows
where it went. A later record of the same kind beside replaces the one there.

A file in the record's place that this suite cannot read as a record (another format version, a
broken file) holds no evidence it could keep: a record that is not interrupted replaces it.

A session also appends each case's result as it finishes, to a case log in `.cases/` beside the
record's place (`<record name>.<session>.<process>.<pid>.jsonl`: a line with the record without
cases, then one line per case), and removes the log once the record is written. A session killed
before its end (SIGKILL, a time limit) leaves its logs: recover_case_logs turns them into a record
marked interrupted, kept in `.interrupted/` as above, so that every case finished before the kill
is kept. The pytest plugin does so as a session starts, and scripts/gpu-check before it packs the
records.
"""

import contextlib
import datetime
import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from correctness.errors import CorrectnessError
from correctness.files import pid_alive
from correctness.results import (SKIP, LeverRecord, emulated_gpu, merge_records, read_record, record_path, record_to_json,
                                 write_record)

INTERRUPTED_FOLDER = ".interrupted"
PARTIAL_FOLDER = ".partial"
EMULATED_FOLDER = ".emulated"
CASES_FOLDER = ".cases"
CASE_LOG = re.compile(r"(?P<record>.+)\.(?P<session>[0-9a-f]+)\.(?P<process>[A-Za-z0-9]+)\.(?P<pid>[0-9]+)\.jsonl")
WHY_BESIDE = {
    INTERRUPTED_FOLDER: "interrupted before every case it selected had run: kept beside the lever's record",
    PARTIAL_FOLDER: "fewer cases decided than the record held: kept beside it, not in its place",
    EMULATED_FOLDER: "made on an emulated GPU (code paths, not numbers): kept beside the lever's record, never evidence",
}


def store_record(record: LeverRecord | Mapping[str, Any], results_dir: Path) -> Path:
    """Write a record (or its JSON form) where it belongs in `results_dir` (see the module's
    docstring), atomically; return its path."""
    data = record_to_json(record) if isinstance(record, LeverRecord) else record
    place = record_path(data, results_dir)
    if data["interrupted"]:
        return write_record(data, results_dir, beside(place, INTERRUPTED_FOLDER))
    if emulated_gpu(data.get("provenance", {})) is not None:
        return write_record(data, results_dir, beside(place, EMULATED_FOLDER))
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


def case_log_path(header: Mapping[str, Any], results_dir: Path, session: str, process: str) -> Path:
    """Where this process appends the cases of the lever run `header` (a record's JSON form) as they
    finish: `.cases/` beside the record's place; `session` is the session's token (hex digits, shared
    by its xdist workers), `process` names the writer ("main", or an xdist worker's id)."""
    place = record_path(header, results_dir)
    return place.parent / CASES_FOLDER / f"{place.stem}.{session}.{process}.{os.getpid()}.jsonl"


def start_case_log(path: Path, header: Mapping[str, Any]) -> None:
    """Begin a case log with its record's header (the record without cases)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _append_lines(path, [{"record": {**header, "cases": []}}])


def append_cases(path: Path, cases: Iterable[Mapping[str, Any]]) -> None:
    """Append finished cases (each in a record's JSON form) to a case log, a line each."""
    _append_lines(path, [{"case": case} for case in cases])


def _append_lines(path: Path, lines: list[dict[str, Any]]) -> None:
    text = "".join(json.dumps(line, allow_nan=False) + "\n" for line in lines)
    try:
        with open(path, "a", encoding="utf-8") as log:
            log.write(text)
    except OSError as error:
        raise CorrectnessError(f"case log {path}: cannot be written ({error.strerror or error})") from None


@dataclass(frozen=True)
class CaseLog:
    """One case log, as its name and lines give it."""

    path: Path
    record: str  # the record's file name, without .json
    session: str
    pid: int

    @property
    def group(self) -> tuple[Path, str, str]:
        """The logs of one lever run of one session (one per xdist worker) share this."""
        return self.path.parent, self.record, self.session


def case_logs(results_dir: Path) -> list[CaseLog]:
    """Every case log under results_dir."""
    found = []
    for path in sorted(Path(results_dir).rglob("*.jsonl")):
        named = CASE_LOG.fullmatch(path.name)
        if path.parent.name == CASES_FOLDER and named:
            found.append(CaseLog(path=path, record=named["record"], session=named["session"], pid=int(named["pid"])))
    return found


def read_case_log(path: Path) -> dict[str, Any] | None:
    """A case log as one part of a record (its header with the cases that follow it, marked
    interrupted, finished when the log was last written); None where it holds no case. A line cut
    short by the kill (the last) is passed over."""
    header, cases = None, []
    with open(path, encoding="utf-8", errors="replace") as log:
        for line in log:
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and isinstance(entry.get("record"), dict) and header is None:
                header = entry["record"]
            elif isinstance(entry, dict) and isinstance(entry.get("case"), dict) and header is not None:
                cases.append(entry["case"])
    if header is None or not cases:
        return None
    finished = datetime.datetime.fromtimestamp(path.stat().st_mtime, datetime.timezone.utc)
    return {**header, "cases": cases, "interrupted": True, "finished": finished.isoformat(timespec="seconds"),
            "seconds": sum(case.get("seconds") or 0.0 for case in cases)}


def recover_case_logs(results_dir: Path) -> list[Path]:
    """Turn the case logs under results_dir that no live process writes (a session killed before its
    end) into records marked interrupted, stored where store_record puts them (`.interrupted/`), and
    remove those logs; return the records written. A log whose every line is unreadable holds no
    case, and is removed; one whose lines are not a record's parts is left alone."""
    groups: dict[tuple[Path, str, str], list[CaseLog]] = {}
    for log in case_logs(results_dir):
        groups.setdefault(log.group, []).append(log)
    written = []
    for logs in groups.values():
        if any(pid_alive(log.pid) for log in logs):
            continue
        parts = [part for log in logs if (part := read_case_log(log.path)) is not None]
        try:
            record = merge_records(parts) if parts else None
        except (KeyError, TypeError, ValueError):
            continue  # not a log this suite wrote: left as it is
        if record is not None:
            written.append(store_record({**record, "interrupted": True}, results_dir))
        _remove(log.path for log in logs)
    return written


def remove_case_logs(results_dir: Path, session: str) -> None:
    """Remove a session's case logs (its records are written), and `.cases/` folders left empty."""
    _remove(log.path for log in case_logs(results_dir) if log.session == session)


def _remove(paths: Iterable[Path]) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        with contextlib.suppress(OSError):  # not empty: another run's logs are there
            path.parent.rmdir()
