"""Records made on an emulated GPU prove code paths, never numbers: they say so, they are kept
beside the lever records, `attach` refuses them, and `check`, `levers --results`, `report` and a
recipe's verdict never count them. And the emulation catches a CPU tensor planted among a GPU
tier's inputs, as a real GPU would."""

import dataclasses
import json

import pytest
import torch

from correctness.attach import attach
from correctness.loss import lever as loss_lever
from correctness.check import check_recipe
from correctness.cli import main
from correctness.emulated_gpu.gpus import parse_emulated
from correctness.emulated_gpu.session import emulated_gpu
from correctness.evidence import read_results
from correctness.fixtures import FIXTURES_DIR, recipe_path
from correctness.harness import run_case
from correctness.lever import LeverOptions
from correctness.recipe_verdict import judge_recipe, recipe_changes
from correctness.recipes import load_recipe
from correctness.record_store import EMULATED_FOLDER, store_record
from correctness.results import FAIL, PASS, LeverRecord, read_record, write_record
from correctness.tiers import GPU
from toy_records import GEMMA, declared_record, toy_record

NEMOTRON = "nemotron-3-super-120b-a12b/h200/attune-tp4-pp2-ep8-mt16k"

REFUSAL = "it was made on an emulated H100 (--emulate-gpu): it proves the GPU tier's code paths, never a GPU's numbers"


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """The toy lever's record made on the CPU, and the same lever's record made on an emulated H100."""
    folder = tmp_path_factory.mktemp("records")
    real = toy_record(folder / "cpu")
    with emulated_gpu(parse_emulated("H100")):
        emulated = toy_record(folder / "emulated", tier=GPU)
    return real, emulated


def test_a_record_made_on_the_emulated_gpu_says_so(records):
    _, emulated = records
    data = read_record(emulated)
    said = data["provenance"]["emulated_gpu"]
    assert (said["gpu"], said["count"], said["architecture"]) == ("H100", 8, "sm90")
    assert "never a GPU's numbers" in said["note"]
    device = data["provenance"]["device"]
    assert (device["type"], device["name"], device["emulated"]) == ("cuda", "NVIDIA H100 80GB HBM3", True)
    assert data["provenance"]["cuda"] is None and data["provenance"]["cudnn"] is None  # no CUDA library ran
    assert data["lever"]["scale"] == "smoke"
    assert "emulated_gpu" not in read_record(records[0])["provenance"]


def test_an_emulated_record_is_kept_beside_the_levers_record_never_in_its_place(records, tmp_path):
    real, emulated = records
    placed = store_record(read_record(real), tmp_path)
    beside = store_record(read_record(emulated), tmp_path)
    assert beside.parent.name == EMULATED_FOLDER and beside.parent.parent == placed.parent.parent / placed.parent.name


def test_attach_refuses_an_emulated_record_and_leaves_the_recipe_untouched(records, gemma_copy, capsys):
    real, emulated = records
    before = gemma_copy.read_bytes()
    attach(gemma_copy, [real], dry_run=True)  # the same lever's record off the emulation attaches
    with pytest.raises(Exception, match="refused.*" + REFUSAL.replace("(", r"\(").replace(")", r"\)")):
        attach(gemma_copy, [emulated])
    assert main(["attach", str(emulated), str(gemma_copy)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "emulated H100" in err
    assert gemma_copy.read_bytes() == before


def test_an_emulated_record_planted_with_a_real_ones_provenance_is_still_refused(records, gemma_copy, tmp_path):
    """Only the marker decides: a record made off the emulation, given an emulated record's
    provenance, is refused; the emulated record stripped of it would read as a CUDA run."""
    real, emulated = records
    data = read_record(real)
    data["provenance"]["emulated_gpu"] = read_record(emulated)["provenance"]["emulated_gpu"]
    planted = tmp_path / "planted.json"
    planted.write_text(json.dumps(data))
    with pytest.raises(Exception, match="emulated H100"):
        attach(gemma_copy, [planted], dry_run=True)


def test_check_never_counts_what_attach_refused(records, gemma_copy):
    reference = FIXTURES_DIR / "references" / f"{GEMMA}.yaml"
    before = check_recipe(gemma_copy, reference=reference).to_dict()
    with pytest.raises(Exception):
        attach(gemma_copy, [records[1]])
    assert check_recipe(gemma_copy, reference=reference).to_dict() == before


def gpu_lever_record(source, folder, lever: str, tier: str, emulated: bool, recipe: str = GEMMA):
    """A record of `lever` on an H100 as the suite declares it (tests/toy_records.py: declared_record),
    with the emulation's marker of the emulated toy record where `emulated`."""
    path = declared_record(folder, lever, tier, recipe)
    if not emulated:
        return path
    data = read_record(path)
    data["provenance"]["emulated_gpu"] = read_record(source)["provenance"]["emulated_gpu"]
    return write_record(data, folder)


def test_levers_results_never_count_an_emulated_gpu_record(records, tmp_path, capsys):
    _, emulated = records
    gpu_lever_record(emulated, tmp_path / "emulated", "moe-router-dtype", "megatron", emulated=True, recipe=NEMOTRON)
    assert read_results(tmp_path / "emulated").gpu == ()
    assert main(["levers", "--results", str(tmp_path / "emulated"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["evidence"]["gpu-run"] == 0 and data["results"]["gpu_records"] == 0
    gpu_lever_record(emulated, tmp_path / "real", "moe-router-dtype", "megatron", emulated=False, recipe=NEMOTRON)
    assert len(read_results(tmp_path / "real").gpu) == 1  # the same record off the emulation would count


def test_a_recipes_verdict_and_report_never_count_an_emulated_record(records, tmp_path, capsys):
    _, emulated = records
    path = gpu_lever_record(emulated, tmp_path, "attention-backend", "h100", emulated=True)
    record = LeverRecord.from_json(read_record(path))
    assert record.verdict == PASS and record.emulated_gpu == "H100"
    recipe = load_recipe(recipe_path(GEMMA))
    verdict = judge_recipe(recipe, recipe_changes(recipe), [record])
    needed = next(lever for lever in verdict.levers if lever.lever == "attention-backend")
    assert needed.verdict == "not run" and verdict.verdict != PASS
    assert needed.reasons == ("h100: emulated H100 only, not evidence",)
    assert main(["report", str(path), "-o", str(tmp_path / "report.html")]) == 0
    capsys.readouterr()
    page = (tmp_path / "report.html").read_text()
    assert 'data-emulated="H100"' in page and "Emulated GPU: it was made on an emulated H100" in page
    assert "h100: emulated H100 only, not evidence" in page and "(emulated on the CPU" in page


def test_the_emulation_catches_a_cpu_tensor_planted_among_a_gpu_tiers_inputs():
    """The packed-loss lever's GPU tier, on one case as made and on the same case with its labels
    left on the CPU: the first runs to a verdict, the second fails where a GPU would."""
    emulation = parse_emulated("H100")
    with emulated_gpu(emulation):
        (lever,) = loss_lever.gpu_tier(NEMOTRON, LeverOptions(emulated=emulation))
        case = lever.cases[0]

        def planted(device):
            inputs = case.make_inputs(device)
            return dataclasses.replace(inputs, labels=inputs.labels.cpu())

        honest = run_case(lever, case)
        caught = run_case(lever, dataclasses.replace(case, make_inputs=planted))
    assert honest.status == PASS, honest.failures
    assert caught.status == FAIL
    assert any("Expected all tensors to be on the same device" in failure and "cuda:0 and cpu" in failure
               for failure in caught.failures), caught.failures
    assert torch.ones(1).device.type == "cpu"  # the emulation is gone after its block
