"""A recipe of each of five more architectures runs the CPU tier from its Hugging Face config alone:
`correctness run RECIPE --model-config CONFIG` (and pytest with the same options underneath), with
every shape derived from the recipe and the config (fixtures/configs/, fixtures/recipes/)."""

import json
import re

import pytest
import yaml

from correctness.fixtures import CONFIGS_DIR, recipe_path
from correctness.model_config import read_config
from recipe_agreement import assert_check_agrees_with_run, run_attach_check

RECIPES = (
    "llama-3.1-8b/h100/example-tp2-pp1-offload05",
    "qwen3-32b/h100/example-tp4-pp2-offload08",
    "qwen3-30b-a3b/h100/example-tp2-ep4-offload07",
    "gpt-oss-20b/h100/example-tp2-ep4-offload06",
    "moonlight-16b-a3b/h100/example-tp2-ep4-offload07",
)


# The levers whose shapes the model's facts give (attention, offload, packing). The later levers
# name the example recipes they run on in their own component tests (the MoE levers the MoE
# recipes, bias-SwiGLU fusion Llama's); the loss and reduction levers read only the vocabulary and
# the first layer's slices and run on the seed recipes.
THIS_ISSUES_LEVERS = "attention_backend or optimizer_offload or thd_packing"


def model_of(recipe_id: str) -> str:
    return yaml.safe_load(recipe_path(recipe_id).read_text())["model"]


@pytest.mark.slow(reason="correctness run, attach and check end to end from a model's config: three levers at its smoke "
                         "shapes")
@pytest.mark.parametrize("recipe_id", RECIPES)
def test_the_cpu_tier_runs_from_the_config(recipe_id, tmp_path):
    model = model_of(recipe_id)
    config = CONFIGS_DIR / model / "config.json"
    summary, check = run_attach_check(
        recipe_path(recipe_id), tmp_path, "--tier", "cpu", "--model-config", str(config), "--", "-p", "no:cacheprovider",
        "-k", THIS_ISSUES_LEVERS)
    # No reference recipe: its numerics arguments are judged against Megatron's defaults, and the
    # levers deselected here leave the verdict incomplete.
    assert summary["verdict"]["against"] == "Megatron's defaults (no reference recipe)"
    assert summary["exit_status"] == 1 and summary["verdict"]["verdict"] == "incomplete"
    verdicts = {record["lever"]: record["verdict"] for record in summary["records"]}
    assert verdicts.get("attention-backend") == "pass", verdicts
    assert verdicts.get("optimizer-offload") == "pass", verdicts
    sha256 = read_config(config).sha256
    for record in summary["records"]:
        data = json.loads(open(record["path"]).read())
        assert data["recipe"]["model"] == model
        assert data["recipe"]["model_facts_sha256"] == sha256
        assert data["recipe"]["model_facts"].endswith(f"{model}/config.json")
    assert_check_agrees_with_run(summary, check)
    assert check["findings"][0]["part"] == "configuration" and check["findings"][0]["status"] == "incomplete"

    # Attached, the entries name the controls that ran and those that applied to no case.
    copy = tmp_path / "copy" / recipe_path(recipe_id).name
    entries = yaml.safe_load(copy.read_text())["correctness"]["component_tests"]
    (attention,) = [entry for entry in entries if entry["test"].startswith("torch SDPA's flash CPU kernel against an eager")]
    assert "wrong softmax scale" in attention["detail"]
    # The te-cpu tier: TE 2.17's own unfused attention as the default, on the same cases.
    (by_te,) = [entry for entry in entries if entry["test"].startswith(
        "torch SDPA's flash CPU kernel against Transformer Engine 2.17's own unfused attention")]
    assert by_te["result"] == attention["result"] == "pass", (by_te, attention)
    if not summary_has_window(summary):
        assert re.search(r"\(window off by one, window one short.*: no case here they apply to\)", attention["detail"])


def summary_has_window(summary) -> bool:
    record = next(r for r in summary["records"] if r["lever"] == "attention-backend")
    data = json.loads(open(record["path"]).read())
    return any(case["shape"]["window"] for case in data["cases"])
