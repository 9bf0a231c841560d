"""correctness.record_store: a record is only ever replaced by one at least as complete; an
interrupted or less complete one lands beside it, where readers of a results folder pass it over."""

import json

import pytest

from correctness.evidence import read_results
from correctness.record_store import INTERRUPTED_FOLDER, PARTIAL_FOLDER, store_record
from correctness.results import read_record, record_path
from toy_records import toy_case, toy_record

CASES = (toy_case(0), toy_case(1))


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """The toy lever's records over two cases, as JSON: both run, the first only, the second
    skipped, and none."""
    scratch = tmp_path_factory.mktemp("scratch")
    made = {}
    for name, cases, run in (("complete", CASES, None), ("first only", CASES, CASES[:1]),
                             ("second skipped", (CASES[0], toy_case(1, skip_reason="no inputs here")), None),
                             ("none", CASES, ())):
        made[name] = read_record(toy_record(scratch / name.replace(" ", "-"), cases, run=run))
    return made


def interrupted(record: dict) -> dict:
    return {**record, "interrupted": True}


def test_the_first_record_goes_to_its_record_path(tmp_path, records):
    path = store_record(records["complete"], tmp_path)
    assert path == record_path(records["complete"], tmp_path)
    assert read_record(path)["verdict"] == "pass"


@pytest.mark.parametrize("later", ["complete", "first only", "second skipped", "none"])
def test_a_complete_record_is_never_replaced_by_an_interrupted_one(tmp_path, records, later):
    held = store_record(records["complete"], tmp_path)
    before = held.read_bytes()
    kept = store_record(interrupted(records[later]), tmp_path)
    assert held.read_bytes() == before
    assert kept == held.parent / INTERRUPTED_FOLDER / held.name
    assert read_record(kept)["interrupted"] is True
    assert [case["case_id"] for case in read_record(kept)["cases"]] == [
        case["case_id"] for case in records[later]["cases"]]


@pytest.mark.parametrize("later", ["first only", "second skipped", "none"])
def test_a_complete_record_is_not_replaced_by_a_less_complete_one(tmp_path, records, later):
    """A record that ran fewer of the declared cases (one case of two, a skip where the held record
    passed, nothing at all: a passing record with 1 case became a skip with 0) lands beside it."""
    held = store_record(records["complete"], tmp_path)
    before = held.read_bytes()
    kept = store_record(records[later], tmp_path)
    assert held.read_bytes() == before
    assert kept == held.parent / PARTIAL_FOLDER / held.name
    assert read_record(kept) == records[later]


def test_a_record_at_least_as_complete_replaces_the_held_one(tmp_path, records):
    held = store_record(records["first only"], tmp_path)
    assert store_record(records["complete"], tmp_path) == held
    assert read_record(held) == records["complete"]
    again = {**records["complete"], "finished": "2026-12-02T00:00:00+00:00"}
    assert store_record(again, tmp_path) == held  # the same cases: the later run replaces
    assert read_record(held)["finished"] == "2026-12-02T00:00:00+00:00"


def test_a_failed_case_counts_as_decided(tmp_path, records):
    """A run whose case failed where the held one passed replaces it: the failure is the evidence."""
    held = store_record(records["complete"], tmp_path)
    failing = json.loads(json.dumps(records["complete"]))
    failing["cases"][1] = {**failing["cases"][1], "status": "fail", "candidate": None,
                           "failures": [{"kind": "error", "role": None, "tensor": None,
                                                        "text": "ValueError: inputs unreadable"}]}
    assert store_record(failing, tmp_path) == held
    assert read_record(held)["cases"][1]["status"] == "fail"


def test_an_interrupted_record_goes_beside_even_where_none_is_held(tmp_path, records):
    kept = store_record(interrupted(records["first only"]), tmp_path)
    main = record_path(records["first only"], tmp_path)
    assert kept == main.parent / INTERRUPTED_FOLDER / main.name and not main.exists()
    assert store_record(records["first only"], tmp_path) == main  # the next complete-enough run takes the place


def test_a_held_file_that_is_no_record_is_replaced(tmp_path, records):
    """A file in a record's place that this suite cannot read (another format version, a broken
    write of another tool) is no evidence to keep: a record that is not interrupted replaces it."""
    main = record_path(records["complete"], tmp_path)
    main.parent.mkdir(parents=True)
    main.write_text(json.dumps({**records["complete"], "format_version": 6}))
    assert store_record(records["first only"], tmp_path) == main
    assert read_record(main) == records["first only"]


def test_readers_of_a_results_folder_pass_over_the_records_kept_beside(tmp_path, records):
    held = store_record(records["complete"], tmp_path)
    store_record(interrupted(records["first only"]), tmp_path)
    store_record(records["none"], tmp_path)
    assert [run.path for run in read_results(tmp_path).cpu] == [str(held)]
    assert sorted(path.name for path in held.parent.glob("*.json")) == [held.name]
