"""`correctness check` (one verdict for a recipe) and `correctness run` (the component tests)."""

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from correctness.check import check_recipe
from correctness.cli import main
from correctness.fixtures import recipe_path
from correctness.yaml_documents import load_document, write_recipe
from recipe_agreement import assert_check_agrees_with_run, assert_fits_a_terminal, run_attach_check

GEMMA = "gemma-4-31b/h100/attune-tp2-pp4-split13"
NEMOTRON = "nemotron-3-super-120b-a12b/h200/attune-tp4-pp2-ep8-mt16k"


def test_gemma_seed_passes_every_part():
    result = check_recipe(recipe_path(GEMMA))
    assert result.verdict == "pass"
    assert [finding.part for finding in result.findings] == [
        "configuration", "component test attention-backend", "component test optimizer-offload", "convergence",
    ]


def test_nemotron_seed_lacks_its_offload_result(capsys):
    assert main(["check", str(recipe_path(NEMOTRON))]) == 1
    out = capsys.readouterr().out
    assert "INCOMPLETE (the recipe says pass)" in out
    assert "no H200 result attached" in out


def test_a_failed_convergence_fails_the_check(tmp_path):
    document = load_document(recipe_path(GEMMA))
    document["correctness"]["convergence"]["result"] = "fail"
    path = tmp_path / GEMMA.replace("/", "-")
    write_recipe(path, document)
    result = check_recipe(path, reference=recipe_path(GEMMA).parents[3] / "references" / f"{GEMMA}.yaml")
    assert result.verdict == "fail"
    assert {f.part: f.status for f in result.findings}["convergence"] == "fail"


@pytest.mark.parametrize(("result", "status"), [("incomplete", "incomplete"), ("no kernel change", "pass")])
def test_an_incomplete_component_test_is_not_covered(tmp_path, result, status):
    document = load_document(recipe_path(GEMMA))
    document["correctness"]["component_tests"][0]["result"] = result  # the attention-backend entry
    path = tmp_path / GEMMA.replace("/", "-")
    write_recipe(path, document)
    checked = check_recipe(path, reference=recipe_path(GEMMA).parents[3] / "references" / f"{GEMMA}.yaml")
    assert {f.part: f.status for f in checked.findings}["component test attention-backend"] == status
    assert checked.verdict == status


def test_check_json_and_bad_input(tmp_path, capsys):
    assert main(["check", str(recipe_path(GEMMA)), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"] == "pass"
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: [unclosed\n")
    assert main(["check", str(broken)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"recipe {broken}: malformed YAML" in err


def run_cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "correctness.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow(reason="correctness run end to end on one lever, and with --workers 2 two pytest-xdist workers that "
                         "merge one record")
@pytest.mark.parametrize("workers", [0, 2])
def test_run_writes_one_record_per_lever(tmp_path, workers):
    results = tmp_path / "results"
    finished = run_cli("run", str(recipe_path(GEMMA)), "--tier", "cpu", "--results-dir", str(results),
                       "--workers", str(workers), "--", "-k", "offload_fraction_cpu", "-p", "no:cacheprovider",
                       cwd=tmp_path)
    assert finished.returncode == 1, finished.stdout + finished.stderr  # the attention lever it needs did not run
    assert "lever verdicts" in finished.stdout
    assert f"recipe {GEMMA}: INCOMPLETE" in finished.stdout
    (record,) = results.rglob("*.json")
    data = json.loads(record.read_text())
    assert data["verdict"] == "pass"
    assert [case["case_id"] for case in data["cases"]] == data["lever"]["cases"]
    assert not (results / ".parts").exists() or not any((results / ".parts").iterdir())


def test_the_cpu_tier_includes_megatrons_optimizer_on_the_cpu_and_no_gpu_tier(tmp_path):
    finished = run_cli("run", str(recipe_path(GEMMA)), "--tier", "cpu", "--", "--collect-only", "-q",
                       "-p", "no:cacheprovider", cwd=tmp_path)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    collected = finished.stdout
    assert "test_offload_with_megatron_hybrid_optimizer_on_cpu[" in collected
    assert "test_offload_fraction_cpu[" in collected
    assert "test_offload_with_megatron_hybrid_optimizer[" not in collected
    assert "test_te_auto_against_te_unfused" not in collected and "test_sdpa_fused_against_eager_unfused" not in collected


def test_runs_marker_expressions_come_from_the_tiers():
    from correctness.commands.run import markers
    from correctness.tiers import CPU_TIER

    assert CPU_TIER == "not gpu and not te and not h100 and not h200"
    on = {gpu: SimpleNamespace(gpu=gpu) for gpu in ("H100", "H200", "A100")}
    assert markers(on["H100"], "cpu") == CPU_TIER
    assert [markers(recipe, "gpu") for recipe in on.values()] == ["gpu or h100", "gpu or h200", "gpu"]


def test_run_hands_strict_systematic_to_pytest(tmp_path):
    finished = run_cli("run", str(recipe_path(GEMMA)), "--tier", "cpu", "--strict-systematic", "--",
                       "--collect-only", "-q", "-p", "no:cacheprovider", cwd=tmp_path)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert "--strict-systematic" in finished.stdout.split("test session starts")[0]  # the pytest command it prints


def test_a_recipe_on_a_gpu_without_a_tier_runs_the_cpu_tiers_and_skips_the_gpu_ones(tmp_path):
    recipe = tmp_path / "gemma-on-a100.yaml"
    recipe.write_text(recipe_path(GEMMA).read_text().replace("  type: H100\n", "  type: A100\n"))
    finished = run_cli("run", str(recipe), "--tier", "cpu", "--results-dir", str(tmp_path),
                       "--", "--collect-only", "-q", "-p", "no:cacheprovider", cwd=tmp_path)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert "test_sdpa_flash_cpu_against_eager_unfused[" in finished.stdout
    finished = run_cli("run", str(recipe), "--tier", "cpu", "--results-dir", str(tmp_path),
                       "--", "-k", "te_auto", "-rs", "-p", "no:cacheprovider", cwd=tmp_path)
    assert finished.returncode == 1, finished.stdout + finished.stderr  # no lever it needs ran: incomplete
    assert "SKIPPED" in finished.stdout and "no tier for the GPU 'A100'" in finished.stdout


def test_run_selects_the_recipes_own_levers(tmp_path):
    finished = run_cli("run", str(recipe_path(NEMOTRON)), "--tier", "cpu", "--results-dir", str(tmp_path),
                       "--", "-k", "loss", "-p", "no:cacheprovider", cwd=tmp_path)
    assert finished.returncode == 1, finished.stdout + finished.stderr  # thd-packing and offload deselected
    records = sorted(path.name for path in tmp_path.rglob("*.json"))
    assert records == ["packed-loss--cpu--packed-token-sum.json"]
    assert all("nemotron" in str(path) for path in tmp_path.rglob("*.json"))


@pytest.mark.slow(reason="the Nemotron seed's whole CPU tier run, attached and checked end to end")
def test_a_seed_recipe_passes_on_the_cpu_and_check_agrees_with_run(tmp_path):
    """Nemotron is judged on what it changes against its reference: the CPU tier passes it, exit 0,
    and after attach `check` shows each lever's CPU evidence as `run` gave it, while it still asks
    for the recipe GPU's own results (it carries none). Gemma's levers pass their component tests in
    the same suite; its run, attach and check are the next test's, on one lever."""
    run, check = run_attach_check(recipe_path(NEMOTRON), tmp_path, "--tier", "cpu", "--", "-p", "no:cacheprovider")
    assert run["exit_status"] == 0 and run["verdict"]["verdict"] == "pass", run["verdict"]
    assert run["exit_reason"] == "the recipe's verdict is pass"
    assert run["records"] and all(record["for_recipe"] == record["verdict"] == "pass" and record["why"] is None
                                  for record in run["records"]), run["records"]
    assert run["verdict"]["not_changed"] == []
    assert_check_agrees_with_run(run, check)
    assert_fits_a_terminal(run["report"])
    levers = [finding for finding in check["findings"] if finding.get("lever")]
    assert levers and all(f["cpu_result"] == "pass" for f in levers), levers
    assert all(f["status"] == "incomplete" and f["result"] is None for f in levers), levers
    assert check["verdict"] == "incomplete"


@pytest.mark.slow(reason="the Gemma seed's offload lever run, attached and checked end to end")
def test_check_keeps_gemmas_h100_verdict_beside_the_cpu_evidence_run_gave(tmp_path):
    """Gemma is judged on what it changes against its reference (the attention backend and the
    offload fraction, not the gradient-accumulation fusion its reference shares). Run on its offload
    lever alone, the run is incomplete (the attention lever it needs did not run); after attach,
    `check` shows the offload lever's CPU evidence as `run` gave it, and its verdict still counts
    only the H100 results the recipe carries: pass."""
    run, check = run_attach_check(recipe_path(GEMMA), tmp_path, "--tier", "cpu", "--", "-p", "no:cacheprovider",
                                  "-k", "offload")
    assert run["exit_status"] == 1 and run["verdict"]["verdict"] == "incomplete", run["verdict"]
    said = {lever["lever"]: lever["verdict"] for lever in run["verdict"]["levers"]}
    assert said["optimizer-offload"] == "pass" and said["attention-backend"] != "pass", said
    assert "gradient-accumulation-fusion" not in said  # its reference shares the fusion
    assert_check_agrees_with_run(run, check)
    levers = {finding["lever"]: finding for finding in check["findings"] if finding.get("lever")}
    assert levers["optimizer-offload"]["cpu_result"] == "pass"
    assert all(finding["status"] == "pass" and finding["result"] == "pass" for finding in levers.values()), levers
    assert check["verdict"] == "pass"


def test_json_says_why_a_failing_record_leaves_the_exit_status_0():
    """A lever no change of the recipe needs, or one failing only on a setting the recipe does not
    run, fails beside exit status 0: each record and the exit reason say why."""
    from correctness.commands.run import _record_summary, exit_reason
    from correctness.recipe_verdict import LeverEvidence, RecipeVerdict

    needed = LeverEvidence(lever="cross-entropy-fusion", flags=("--cross-entropy-loss-fusion absent -> on",),
                           tiers=(("megatron-cpu", "pass"),), device=("cpu",), format=None, reasons=())
    verdict = RecipeVerdict(recipe="r", basis="b", changes=(), levers=(needed,), catalogue=(), other_changes={},
                            convergence_passes=False)

    def record(name, tier, lever_verdict):
        return {"lever": {"name": name, "tier": tier, "record_id": name}, "verdict": lever_verdict, "cases": []}

    other = _record_summary(record("rope-fusion", "megatron-cpu", "fail"), "x.json", verdict)
    assert other["for_recipe"] is None and "no change of the recipe needs this lever" in other["why"]
    own = _record_summary(record("cross-entropy-fusion", "megatron-cpu", "fail"), "y.json", verdict)
    assert own["for_recipe"] == "pass" and "the cases of the setting the recipe runs give pass" in own["why"]
    reason = exit_reason(0, verdict, [other, own])
    assert reason.startswith("the recipe's verdict is pass; 2 records whose lever verdict is not pass"), reason
    assert exit_reason(143, verdict, []).startswith("stopped by a signal (exit status 143)")


def test_check_and_classify_word_an_added_flag_alike(tmp_path, capsys):
    """A flag the recipe adds reads `absent -> on` in both (check once wrote `(default) -> (absent)`)."""
    recipe = tmp_path / "my-recipe.yaml"
    recipe.write_text(recipe_path("llama-3.1-8b/h100/example-tp2-pp1-offload05").read_text())
    main(["classify", str(recipe), "--json"])
    changes = json.loads(capsys.readouterr().out)["changes"]
    added = next(change for change in changes if change["flag"] == "--optimizer-cpu-offload")
    assert (added["reference"], added["candidate"]) == (None, [])
    main(["check", str(recipe), "--json"])
    findings = json.loads(capsys.readouterr().out)["findings"]
    assert any(finding.get("detail", "").startswith("--optimizer-cpu-offload absent -> on:") for finding in findings)
    main(["classify", str(recipe)])
    assert "--optimizer-cpu-offload               absent -> on" in capsys.readouterr().out


@pytest.mark.slow(reason="correctness run on an emulated H100 end to end: TE's FusedAdam tier at the smoke shapes")
def test_run_on_an_emulated_gpu_runs_the_gpu_tiers_and_leaves_the_recipe_incomplete(tmp_path):
    """`correctness run --emulate-gpu H100`: the recipe GPU's and any GPU's tiers run (here the offload
    lever's TE FusedAdam tier), their records are kept in .emulated/, and the recipe is not judged on
    them: incomplete, exit 1, each needed lever saying why."""
    results = tmp_path / "results"
    finished = run_cli("run", str(recipe_path(GEMMA)), "--emulate-gpu", "H100", "--results-dir", str(results), "--json",
                       "--", "-k", "offload_with_te_fused_adam", "-p", "no:cacheprovider", cwd=tmp_path)
    assert finished.returncode == 1, finished.stderr[-3000:]
    data = json.loads(finished.stdout)
    assert data["markers"] == "gpu or h100"
    (record,) = data["records"]
    assert record["tier"] == "h100" and record["verdict"] == "pass" and "/.emulated/" in record["path"]
    assert data["verdict"]["verdict"] == "incomplete"
    offload = next(lever for lever in data["verdict"]["levers"] if lever["lever"] == "optimizer-offload")
    assert offload["verdict"] == "not run" and "h100: emulated H100 only, not evidence" in offload["reasons"]


def test_run_refuses_an_emulated_gpu_with_the_cpu_tier(tmp_path):
    finished = run_cli("run", str(recipe_path(GEMMA)), "--emulate-gpu", "H100", "--tier", "cpu", cwd=tmp_path)
    assert finished.returncode == 2
    assert finished.stderr.strip().splitlines() == [
        "correctness run: --emulate-gpu runs the GPU tiers on an emulated GPU; --tier cpu runs none of them"]
