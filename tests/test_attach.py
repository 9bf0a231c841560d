"""Attaching lever records to recipes: wording, round trip, replacement, refusals."""

import difflib
import json
import os
import shutil

import pytest

from correctness.attach import ENTRY_FIELDS, attach, component_test_entry
from correctness.results import LeverRecord
from correctness.attention import backend_lever as attention
from correctness.cli import main
from correctness.errors import CorrectnessError, RecipeError
from correctness.fixtures import FIXTURES_DIR, recipe_path
from correctness.harness import run_lever
from correctness.lever import LeverOptions
from correctness.optimizer import lever as offload
from correctness.check import check_recipe
from correctness.recipes import load_recipe
from correctness.yaml_documents import load_document, recipe_text, write_recipe
from correctness.results import write_record
from toy_records import partial_record, toy_case, toy_record

GEMMA = "gemma-4-31b/h100/attune-tp2-pp4-split13"
NEMOTRON = "nemotron-3-super-120b-a12b/h200/attune-tp4-pp2-ep8-mt16k"


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """Fresh CPU-tier records: the offload lever, and the attention lever on one sliding case."""
    folder = tmp_path_factory.mktemp("records")
    (attention_lever,) = attention.cpu_tier(GEMMA, LeverOptions())
    (offload_lever,) = offload.cpu_tier(GEMMA, LeverOptions())
    return {"attention-backend": write_record(partial_record(attention_lever, "window-edge"), folder),
            "optimizer-offload": write_record(run_lever(offload_lever), folder)}


def edited_record(path, tmp_path, edit):
    data = json.loads(path.read_text())
    edit(data)
    out = tmp_path / f"edited-{path.name}"
    out.write_text(json.dumps(data))
    return out


@pytest.mark.parametrize("recipe", [GEMMA, NEMOTRON])
def test_seeds_round_trip_byte_for_byte(recipe):
    path = recipe_path(recipe)
    assert recipe_text(load_document(path)) == path.read_text()


def test_attached_entries_are_appended_and_nothing_else_changes(records, gemma_copy):
    before = gemma_copy.read_text()
    done = attach(gemma_copy, list(records.values()))
    assert [item.action for item in done] == ["added", "added"]
    after = gemma_copy.read_text()
    operations = difflib.SequenceMatcher(a=before.splitlines(), b=after.splitlines(), autojunk=False).get_opcodes()
    changes = [(tag, j2 - j1) for tag, _, _, j1, j2 in operations if tag != "equal"]
    assert changes == [("insert", 2 * len(ENTRY_FIELDS))]  # one block of lines added, nothing else touched
    entries = load_recipe(gemma_copy).field("correctness.component_tests")
    assert [list(entry) for entry in entries[-2:]] == [list(ENTRY_FIELDS)] * 2
    assert [list(entry)[:6] for entry in entries[:2]] == [list(ENTRY_FIELDS)[:6]] * 2  # the seed's own order


def test_entries_are_worded_from_the_figures(records):
    record = json.loads(records["optimizer-offload"].read_text())
    entry = component_test_entry(LeverRecord.from_json(record))
    assert entry["test"] == "CPU optimizer offload fraction 0.8 against fraction 1.0 and an FP64 reference"
    assert entry["gpu"] == "CPU" and entry["result"] == "pass"
    assert "21 tensors, 2,174,688 parameters, 19.9% of them on the GPU at fraction 0.8" in entry["shape"]
    assert "the CPU partition is bitwise identical to the default" in entry["detail"]
    assert "three negative controls (no bias correction, BF16 masters and no clipping) fail" in entry["detail"]
    attention_entry = component_test_entry(LeverRecord.from_json(json.loads(records["attention-backend"].read_text())))
    assert "window 1,024" in attention_entry["shape"] and "at the smoke scale" in attention_entry["shape"]
    assert "against a bound of" in attention_entry["detail"]


def test_quoted_fields_use_the_recipes_single_quotes(records, gemma_copy):
    attach(gemma_copy, [records["optimizer-offload"]])
    text = gemma_copy.read_text()
    assert "    shape: 'TP 2 rank 0''s slices of Gemma-4-31B" in text
    assert '"' not in text.split("component_tests:")[1].split("convergence:")[0]


def test_an_entry_for_the_same_test_and_gpu_is_replaced(records, gemma_copy):
    attach(gemma_copy, [records["optimizer-offload"]])
    once = gemma_copy.read_text()
    done = attach(gemma_copy, [records["optimizer-offload"]])
    assert done[0].action == "replaced"
    assert gemma_copy.read_text() == once
    assert len(load_recipe(gemma_copy).field("correctness.component_tests")) == 3


def test_an_empty_flow_list_becomes_a_block_list(tmp_path):
    path = tmp_path / "nemotron.yaml"
    shutil.copy(recipe_path(NEMOTRON), path)
    record = toy_record(tmp_path / "records", recipe=load_recipe(recipe_path(NEMOTRON)))
    attach(path, [record])
    text = path.read_text()
    assert "component_tests: []" not in text
    assert "  component_tests:\n  - test: toy sums sums" in text


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda data: data["recipe"].update(model="Another-Model"), "it is for Another-Model, not Gemma-4-31B"),
        (lambda data: data["lever"].update(version=99), f"version 99, this suite has {offload.VERSION}"),
        (lambda data: data["recipe"].update(gpu="H200"), "it is for the H200 recipe .*, not an H100 one"),
        (lambda data: [case["shape"].update(tp_size=4) for case in data["cases"]], "states shape.tp_size 4 where the lever declares 2"),
        (lambda data: data.update(verdict="fail"), "its verdict is fail but its cases say pass"),
        (lambda data: data["cases"][0]["controls"][0].update(fails_bound=False),
         "it contradicts itself: field cases.0.controls.0.fails_bound says false where its figures give true"),
        (lambda data: [t.update(passes=True) for t in data["cases"][0]["controls"][0]["judgement"]["tensors"]],
         "it contradicts itself: field cases.0.controls.0.judgement.tensors.\\d.passes says true where its figures"
         " give false"),
        (lambda data: [case.update(status="skip") for case in data["cases"]], "none of its cases ran"),
        (lambda data: data["cases"].pop(), "it lacks one of the two cases its lever declares"),
        (lambda data: data["cases"][0].update(status="no kernel change"),
         "its verdict is pass but its cases say no kernel change"),
    ],
)
def test_a_record_that_cannot_be_attached_leaves_the_recipe_untouched(records, gemma_copy, tmp_path, edit, message):
    before = gemma_copy.read_bytes()
    bad = edited_record(records["optimizer-offload"], tmp_path, edit)
    with pytest.raises(CorrectnessError, match=message):
        attach(gemma_copy, [records["attention-backend"], bad])
    assert gemma_copy.read_bytes() == before
    assert sorted(os.listdir(gemma_copy.parent)) == sorted(["gemma.yaml", bad.name])


def test_an_incomplete_record_is_attached_as_incomplete(gemma_copy, tmp_path):
    path = toy_record(tmp_path, [toy_case(0), toy_case(1, skip_reason="the fused sum refuses 64 columns")])
    (done,) = attach(gemma_copy, [path])
    assert done.result == "incomplete"
    entry = load_recipe(gemma_copy).field("correctness.component_tests")[-1]
    assert entry["result"] == "incomplete"
    assert "one case skipped: the fused sum refuses 64 columns" in entry["note"]


def test_a_record_lacking_a_declared_case_is_refused(gemma_copy, tmp_path):
    cases = [toy_case(0), toy_case(1)]
    path = toy_record(tmp_path, cases, run=cases[:1])
    before = gemma_copy.read_bytes()
    with pytest.raises(CorrectnessError, match=r"it lacks one of the two cases its lever declares \(sums-seed1\)"):
        attach(gemma_copy, [path])
    assert gemma_copy.read_bytes() == before


def test_a_case_that_failed_with_an_error_is_attached_as_a_failure_with_its_message(gemma_copy, tmp_path):
    def corrupt(device):
        raise CorrectnessError("checkpoint case layer-00.safetensors: header too large")

    path = toy_record(tmp_path, [toy_case(0), toy_case(1, make_inputs=corrupt)])
    (done,) = attach(gemma_copy, [path])
    entry = load_recipe(gemma_copy).field("correctness.component_tests")[-1]
    assert done.result == entry["result"] == "fail"
    assert "case sums-seed1 failed: CorrectnessError: checkpoint case layer-00.safetensors: header too large" in entry["detail"]


def test_a_record_whose_every_case_failed_with_an_error_is_worded_from_the_errors(gemma_copy, tmp_path):
    def corrupt(device):
        raise CorrectnessError("no such file")

    path = toy_record(tmp_path, [toy_case(0, make_inputs=corrupt)])
    attach(gemma_copy, [path])
    entry = load_recipe(gemma_copy).field("correctness.component_tests")[-1]
    assert entry["result"] == "fail" and entry["detail"] == "case sums-seed0 failed: CorrectnessError: no such file"


def test_dry_run_writes_nothing(records, gemma_copy):
    before = gemma_copy.read_bytes()
    assert attach(gemma_copy, [records["optimizer-offload"]], dry_run=True)[0].action == "added"
    assert gemma_copy.read_bytes() == before


def test_a_recipe_off_the_schema_is_refused(records, gemma_copy):
    gemma_copy.write_text(gemma_copy.read_text().replace("  tp: 2\n", "  tp: two\n"))
    before = gemma_copy.read_bytes()
    with pytest.raises(RecipeError, match="layout.tp: 'two' is not of type 'integer'"):
        attach(gemma_copy, [records["optimizer-offload"]])
    assert gemma_copy.read_bytes() == before


def test_the_write_keeps_the_file_mode(records, gemma_copy):
    gemma_copy.chmod(0o640)
    attach(gemma_copy, [records["optimizer-offload"]])
    assert gemma_copy.stat().st_mode & 0o777 == 0o640


def test_cli_attach_and_its_exit_codes(records, gemma_copy, tmp_path, capsys):
    assert main(["attach", str(records["optimizer-offload"]), str(gemma_copy), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["entries"][0]["action"] == "added"
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    assert main(["attach", str(broken), str(gemma_copy)]) == 2
    assert f"result record {broken}" in capsys.readouterr().err


def test_a_cpu_tier_entry_is_not_evidence_for_the_recipes_gpu(records, tmp_path):
    """Only entries run on the recipe's GPU satisfy `check`: a CPU-tier pass does not replace them."""
    path = tmp_path / "gemma.yaml"
    document = load_document(recipe_path(GEMMA))
    document["correctness"]["component_tests"] = []
    write_recipe(path, document)
    attach(path, list(records.values()))
    result = check_recipe(path, reference=FIXTURES_DIR / "references" / f"{GEMMA}.yaml")
    statuses = {finding.part: finding.status for finding in result.findings}
    assert statuses["component test optimizer-offload"] == "incomplete"
    assert result.verdict == "incomplete"


def test_converge_attach_replaces_only_the_convergence_block(gemma_copy, capsys):
    data = FIXTURES_DIR.parent / "tests" / "data" / "convergence"
    before = gemma_copy.read_text().splitlines()
    status = main(["converge", str(data / "candidate.log"), str(data / "reference.log"), "--attach", str(gemma_copy)])
    assert status == 0
    after = gemma_copy.read_text().splitlines()
    changed = [(tag, before[i1:i2]) for tag, i1, i2, _, _ in
               difflib.SequenceMatcher(a=before, b=after, autojunk=False).get_opcodes() if tag != "equal"]
    assert all(line.split(":")[0].strip() in {"correlation", "final_loss_difference", "note"}
               for _, lines in changed for line in lines)
    block = load_recipe(gemma_copy).field("correctness.convergence")
    assert block["result"] == "pass" and block["steps"] == 20 and "checked by correctness converge" in block["note"]
