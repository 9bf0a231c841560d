"""attach trusts nothing it can recompute: every pass flag, bound, ratio, flag and verdict of a record
is recomputed from its figures (correctness.recheck), and a case's status from its judgements."""

import json

import pytest

from correctness.attach import attach
from correctness.errors import CorrectnessError
from correctness.recheck import recomputed
from correctness.results import LeverRecord, read_record, record_to_json, stated_fields_disagree
from toy_records import toy_record


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    return toy_record(tmp_path_factory.mktemp("records"))


def candidate_tensor(data):
    return data["cases"][0]["candidate"]["tensors"][0]


def raise_error_left_passing(data):
    """The issue's edit: the candidate's error 5 x its bound, `passes: true` left in."""
    tensor = candidate_tensor(data)
    tensor["error"] = 5 * tensor["bound"]


def test_a_record_reads_back_as_its_figures_give_it(record):
    data = read_record(record)
    assert stated_fields_disagree(data) is None
    assert record_to_json(recomputed(LeverRecord.from_json(data))) == data


EDITS = [
    (raise_error_left_passing, "field cases.0.candidate.passes says true where its figures give false"),
    (lambda data: candidate_tensor(data).update(bound=1.0), "field cases.0.candidate.tensors.0.bound says 1.0"),
    (lambda data: candidate_tensor(data).update(ratio=0.5), "field cases.0.candidate.tensors.0.ratio says 0.5"),
    (lambda data: data["cases"][0]["default_repeat"]["tensors"][0].update(error=1.0),
     "field cases.0.default_repeat.passes says true where its figures give false"),
    (lambda data: candidate_tensor(data)["systematic"].update(slope=1.0),
     "field cases.0.candidate.tensors.0.systematic.flagged says false where its figures give true"),
    (lambda data: data["lever"]["rule"].update(factor=10.0), "its rule \\(10 x default \\+ 0.001\\) is looser than"),
    (lambda data: data["lever"]["rule"].update(slack=0.5), "is looser than the suite's \\(2 x default \\+ 0.001\\)"),
    (lambda data: data["lever"]["rule"].update(factor=0.5), "its rule is not a rule \\(rule: factor must be >= 1"),
    (lambda data: data.update(verdict="fail"), "field verdict says \"fail\" where its figures give \"pass\""),
    (lambda data: data["completeness"].update(ran=3), "field completeness.ran says 3 where its figures give 1"),
    (lambda data: data["recipe"]["arguments"].update({"layout.tp": 8}), "field recipe.arguments_sha256 says"),
    (lambda data: data["cases"][0].update(failures=[{"kind": "outside-rule", "role": "candidate", "tensor": "sums",
                                                        "text": "candidate sums: error 1e-2 > bound 1e-3"}]),
     "case sums-seed0 is pass while it states failures: candidate sums"),
    (lambda data: data["cases"][0].update(status="fail"), "case sums-seed0 fails without saying why"),
    (lambda data: data["cases"][0].update(status="skip"), "case sums-seed0 is skipped while it has a judgement"),
    (lambda data: data["cases"][0].update(status="no kernel change"),
     "case sums-seed0 is no kernel change while its candidate ran fp32 sums and its default bf16 sums \\(the lever"
     " compares no kernels\\)"),
    (lambda data: data["cases"][0].update(expected_backend="te-fused"),
     "its candidate ran fp32 sums, not the recipe's te-fused"),
    (lambda data: data["cases"][0]["controls"][0].update(judgement=None, applies=False, fails_bound=False, fails=False,
                                                         power=None, inapplicable_reason="edited"),
     "case sums-seed0 is pass while no negative control applies to it"),
]


@pytest.mark.parametrize(("edit", "message"), EDITS, ids=[str(i) for i in range(len(EDITS))])
def test_a_record_that_its_figures_contradict_is_refused_naming_the_field(record, gemma_copy, tmp_path, edit, message):
    data = json.loads(record.read_text())
    edit(data)
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(data))
    before = gemma_copy.read_bytes()
    with pytest.raises(CorrectnessError, match=message):
        attach(gemma_copy, [edited])
    assert gemma_copy.read_bytes() == before


def test_the_issue_edit_names_the_candidates_pass_flag_among_its_problems(record, gemma_copy, tmp_path):
    """3.94e-2 against a bound of 7.89e-3 with `passes: true` left in was attached as a pass."""
    data = json.loads(record.read_text())
    raise_error_left_passing(data)
    derived = record_to_json(recomputed(LeverRecord.from_json(data)))
    assert candidate_tensor(data)["passes"] is True and candidate_tensor(derived)["passes"] is False
    assert derived["verdict"] == "pass"  # the stated status stands: the case's own check refuses it
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(data))
    with pytest.raises(CorrectnessError, match="case sums-seed0 passes while its candidate fails on \\['sums'\\]"):
        attach(gemma_copy, [edited])


def test_one_case_is_worded_in_the_singular(record):
    from correctness.attach import component_test_entry

    shape = component_test_entry(LeverRecord.from_json(read_record(record)))["shape"]
    assert "one case run" in shape and "one cases" not in shape
