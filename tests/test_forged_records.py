"""Records edited to stay self-consistent (each edit replayed through the suite's own recompute,
correctness.recheck, so that every figure, flag and verdict agrees with the rest) are refused by
every reader: a record must be what this suite would have run for the recipe
(correctness.declaration), with one default figure per tensor and its format gate whole; honest
records still attach. The edits are those a hostile trial got accepted (issue 38)."""

import json
import re
import shutil

import pytest

from correctness.attach import attach
from correctness.attention import backend_lever as attention
from correctness.cli import main
from correctness.errors import CorrectnessError
from correctness.fixtures import recipe_path
from correctness.harness import run_lever
from correctness.lever import LeverOptions
from correctness.optimizer import lever as offload
from correctness.recheck import arguments_sha256, recomputed
from correctness.recipe_binding import recipe_values
from correctness.recipes import load_recipe
from correctness.results import LeverRecord, record_to_json, stated_fields_disagree, write_record
from correctness.catalogue import lever_reads
from toy_records import GEMMA, declared_record, partial_record

LLAMA = "llama-3.1-8b/h100/example-tp2-pp1-offload05"


def replayed(data: dict) -> dict:
    """The edited record made self-consistent by the suite's own recompute (its verdict too)."""
    fixed = record_to_json(recomputed(LeverRecord.from_json(data)))
    assert stated_fields_disagree(fixed) is None
    return fixed


def written(folder, data: dict):
    out = folder / "edited.json"
    out.write_text(json.dumps(data))
    return out


@pytest.fixture(scope="module")
def offload_record(tmp_path_factory):
    (lever,) = offload.cpu_tier(GEMMA, LeverOptions())
    return json.loads(write_record(run_lever(lever), tmp_path_factory.mktemp("offload")).read_text())


@pytest.fixture(scope="module")
def partial_attention(tmp_path_factory):
    """The attention lever's CPU record with its window-edge case alone run: `incomplete`."""
    (lever,) = attention.cpu_tier(GEMMA, LeverOptions())
    record = partial_record(lever, "window-edge")
    assert record.verdict == "incomplete"
    return json.loads(write_record(record, tmp_path_factory.mktemp("attention")).read_text())


def refused(recipe, path, message):
    before = recipe.read_bytes()
    with pytest.raises(CorrectnessError, match=message):
        attach(recipe, [path])
    assert recipe.read_bytes() == before


def test_an_honest_record_attaches(offload_record, gemma_copy, tmp_path):
    assert attach(gemma_copy, [written(tmp_path, offload_record)])[0].result == "pass"


def test_a_duplicate_case_whose_failing_copy_comes_first_is_refused(offload_record, gemma_copy, tmp_path):
    data = json.loads(json.dumps(offload_record))
    failing = json.loads(json.dumps(data["cases"][0]))
    failing |= {"status": "fail", "failures": [{"kind": "error", "role": None, "tensor": None, "text": "it broke"}]}
    data["cases"].insert(0, failing)
    refused(gemma_copy, written(tmp_path, replayed(data)), "case .*-synthetic-seed0 appears twice")


def test_controls_deleted_but_the_strongest_are_refused(offload_record, gemma_copy, tmp_path):
    data = json.loads(json.dumps(offload_record))
    case = data["cases"][0]
    strongest = max((c for c in case["controls"] if c["judgement"]), key=lambda c: c["power"])
    case["controls"] = [strongest]
    data["lever"]["controls"] = [strongest["name"]]
    refused(gemma_copy, written(tmp_path, replayed(data)), "its lever.controls lacks .*, which the lever declares")


def test_a_case_deleted_with_its_declaration_is_refused(offload_record, gemma_copy, tmp_path):
    data = json.loads(json.dumps(offload_record))
    gone = data["cases"].pop()["case_id"]
    data["lever"]["cases"].remove(gone)
    data["lever"]["optional_cases"] = [case for case in data["lever"]["optional_cases"] if case != gone]
    refused(gemma_copy, written(tmp_path, replayed(data)), re.escape(f'its lever.cases lacks "{gone}"'))


def test_required_cases_made_optional_to_turn_incomplete_into_pass_are_refused(partial_attention, gemma_copy, tmp_path):
    data = json.loads(json.dumps(partial_attention))
    for case in data["cases"]:
        if case["status"] == "skip" and case["required"]:
            case["required"] = False
            data["lever"]["optional_cases"].append(case["case_id"])
    data["lever"]["optional_cases"] = [c for c in data["lever"]["cases"] if c in data["lever"]["optional_cases"]]
    forged = replayed(data)
    assert forged["verdict"] == "pass"  # what the edit was for
    refused(gemma_copy, written(tmp_path, forged), "its lever.optional_cases names .*, which the lever does not declare")


def test_a_gemma_record_relabelled_as_llama_is_refused(offload_record, tmp_path):
    llama = load_recipe(recipe_path(LLAMA))
    data = json.loads(json.dumps(offload_record))
    arguments = recipe_values(llama, lever_reads(data["lever"]["name"]))
    data["recipe"] |= {"id": llama.id, "model": llama.model, "path": str(llama.path.resolve()),
                       "sha256": llama.sha256, "arguments": arguments, "arguments_sha256": arguments_sha256(arguments)}
    recipe = tmp_path / "llama.yaml"
    shutil.copy(recipe_path(LLAMA), recipe)
    refused(recipe, written(tmp_path, replayed(data)), "not what this suite runs for recipe .*: .*")


def test_an_offload_record_run_at_another_fraction_is_refused(tmp_path):
    """Run at 0.8 on a copy of the Llama recipe, its arguments edited to 0.5 with their sha256
    recomputed, attached to the 0.5 recipe: its shares were split at 0.8."""
    copy = tmp_path / "llama-08.yaml"
    copy.write_text(recipe_path(LLAMA).read_text().replace("optimizer_fraction: 0.5", "optimizer_fraction: 0.8")
                    .replace("--optimizer-offload-fraction 0.5", "--optimizer-offload-fraction 0.8"))
    (lever,) = offload.cpu_tier(LLAMA, LeverOptions(recipe=load_recipe(copy)))
    data = json.loads(write_record(run_lever(lever), tmp_path / "records").read_text())
    arguments = data["recipe"]["arguments"] | {"--optimizer-offload-fraction": ["0.5"]}
    data["recipe"] |= {"arguments": arguments, "arguments_sha256": arguments_sha256(arguments)}
    recipe = tmp_path / "llama.yaml"
    shutil.copy(recipe_path(LLAMA), recipe)
    refused(recipe, written(tmp_path, replayed(data)), "this suite makes no record optimizer-offload--cpu--offload-0.8 for recipe")


def test_a_candidates_default_error_raised_alone_is_refused(offload_record, gemma_copy, tmp_path):
    """Its bound covers 1.5 x the true one, while the default's repeat and the controls keep the
    default's true error: a case has one default error per tensor."""
    data = json.loads(json.dumps(offload_record))
    for tensor in data["cases"][0]["candidate"]["tensors"]:
        tensor["default_error"] *= 1.5
    refused(gemma_copy, written(tmp_path, replayed(data)), "states two default errors for")


def test_the_report_refuses_a_record_drawn_as_pass_beyond_its_bounds(offload_record, tmp_path, capsys):
    data = json.loads(json.dumps(offload_record))
    for tensor in data["cases"][0]["candidate"]["tensors"]:
        tensor["error"] = 5 * tensor["bound"]
    path = written(tmp_path, data)
    assert main(["report", str(path), "-o", str(tmp_path / "report.html")]) == 2
    assert "contradicts itself" in capsys.readouterr().err and not (tmp_path / "report.html").exists()


def test_the_report_refuses_a_folder_whose_records_name_another_recipe(offload_record, tmp_path, capsys):
    """A record moved into another recipe's records folder."""
    (llama,) = offload.cpu_tier(LLAMA, LeverOptions())
    llama_path = write_record(run_lever(llama), tmp_path)
    stray = llama_path.parent / "gemma-offload.json"
    stray.write_text(json.dumps(offload_record))
    assert main(["report", str(tmp_path)]) == 2
    assert "lies in the records folder example-tp2-pp1-offload05." in capsys.readouterr().err


def test_levers_count_no_cuda_tier_record_with_cpu_provenance(tmp_path, capsys):
    path = declared_record(tmp_path, "cross-entropy-fusion", "h100",
                           device={"type": "cpu", "name": None, "gpu_type": None})
    assert main(["levers", "--results", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "its h100 tier runs on cuda, but its provenance says it ran on cpu" in err


def test_levers_show_a_failing_gpu_record_as_failing(tmp_path, capsys):
    declared_record(tmp_path, "cross-entropy-fusion", "h100", wrong=True)
    assert main(["levers", "--results", str(tmp_path), "--json"]) == 0
    entries = json.loads(capsys.readouterr().out)["arguments"]
    fusion = next(entry for entry in entries if entry["argument"] == "--cross-entropy-fusion-impl")
    assert fusion["gpu_run"]["verdict"] == "fail" and fusion["where"].endswith("(h100: fail)")
