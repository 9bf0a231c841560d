"""Sizes are input: a model's or a recipe's size over ten times the largest published one
(correctness.model_limits), or not a positive integer, is refused in one line where it is read, and a
case whose estimated memory exceeds what the machine has is refused when its lever is built
(correctness.memory), before anything is allocated."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from correctness import LeverOptions
from correctness.attention import backend_lever as attention
from correctness.cli import main
from correctness.cross_entropy import lever as cross_entropy
from correctness.errors import RecipeError, ShapeError
from correctness.fixtures import CONFIGS_DIR, MODELS_DIR, RECIPES_DIR
from correctness.memory import MEMORY_ENV, available_bytes
from correctness.model_limits import LARGEST, limit_of
from correctness.models import facts_for, load_facts
from correctness.recipes import load_recipe

GEMMA_FACTS = MODELS_DIR / "gemma-4-31b.yaml"
GEMMA = RECIPES_DIR / "gemma-4-31b/h100/attune-tp2-pp4-split13.yaml"
LLAMA = RECIPES_DIR / "llama-3.1-8b/h100/example-tp2-pp1-offload05.yaml"
LLAMA_ID = "llama-3.1-8b/h100/example-tp2-pp1-offload05"
FIXTURE_RECIPES = sorted(RECIPES_DIR.glob("*/*/*.yaml"))


def gemma_facts(tmp_path: Path, change) -> Path:
    """Gemma-4-31B's facts file with one change, in a file of its own."""
    data = yaml.safe_load(GEMMA_FACTS.read_text())
    change(data)
    path = tmp_path / "gemma-4-31b.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def run_cli(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "correctness.cli", *arguments], capture_output=True, text=True,
                          timeout=120)


def one_line_refusal(done: subprocess.CompletedProcess, *phrases: str) -> None:
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    for phrase in phrases:
        assert phrase in done.stderr


def test_a_hidden_size_of_2_to_the_40_is_refused_by_correctness_run(tmp_path):
    facts = gemma_facts(tmp_path, lambda data: data.update(hidden_size=2**40))
    done = run_cli("run", str(GEMMA), "--tier", "cpu", "--model-config", str(facts), "--results-dir", str(tmp_path / "r"))
    one_line_refusal(done, "field hidden_size is 1,099,511,627,776", f"{limit_of('hidden size'):,}", "Llama-3.1-405B")


def test_row_tokens_of_2_to_the_30_are_refused_by_correctness_run(tmp_path):
    data = yaml.safe_load(LLAMA.read_text())
    data["workload"]["row_tokens"] = 2**30
    recipe = tmp_path / "llama.yaml"
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    done = run_cli("run", str(recipe), "--tier", "cpu", "--results-dir", str(tmp_path / "r"))
    one_line_refusal(done, "field workload.row_tokens is 1,073,741,824", "Llama 4 Scout")


@pytest.mark.parametrize(("change", "phrase"), [
    (lambda data: data.update(ffn_hidden_size=10**15), "field ffn_hidden_size is 1,000,000,000,000,000"),
    (lambda data: data.update(layers=10**7), "field layers is 10,000,000"),
    (lambda data: data.update(layers=1e7), "field layers must be a positive integer"),
    (lambda data: data["attention"]["kinds"]["sliding"].update(head_dim=0),
     "field attention.kinds.sliding.head_dim must be a positive integer"),
    (lambda data: data["attention"]["kinds"]["global"].update(rope_theta=math.inf),
     "field attention.kinds.global.rope_theta must be a finite number above 0, got inf"),
    (lambda data: data["attention"]["kinds"]["sliding"].update(window=-1),
     "field attention.kinds.sliding.window must be a positive integer"),
    (lambda data: data["attention"].update(softmax_scale=0.0), "field attention.softmax_scale must be a finite number"),
    (lambda data: data.update(final_logit_softcap=math.nan), "field final_logit_softcap must be a finite number"),
], ids=["ffn-1e15", "layers-1e7", "layers-float", "head-dim-0", "rope-theta-inf", "window-negative", "scale-0",
        "softcap-nan"])
def test_an_absurd_fact_in_a_facts_file_is_refused_in_one_line(tmp_path, change, phrase):
    path = gemma_facts(tmp_path, change)
    with pytest.raises(RecipeError) as refused:
        load_facts(path)
    assert phrase in str(refused.value) and str(path) in str(refused.value) and "\n" not in str(refused.value)


def config_with(tmp_path: Path, **fields) -> Path:
    folder = tmp_path / "Llama-3.1-8B"
    folder.mkdir()
    config = json.loads((CONFIGS_DIR / "Llama-3.1-8B" / "config.json").read_text())
    config.update(fields)
    (folder / "config.json").write_text(json.dumps(config))
    return folder / "config.json"


@pytest.mark.parametrize(("fields", "phrase"), [
    ({"hidden_size": 2**40, "head_dim": 128}, "hidden_size is 1,099,511,627,776"),
    ({"intermediate_size": 1e15}, "intermediate_size"),
    ({"num_hidden_layers": 10**7}, "layers is 10,000,000"),
])
def test_model_facts_writes_nothing_for_an_absurd_config(tmp_path, capsys, fields, phrase):
    output = tmp_path / "facts.yaml"
    status = main(["model-facts", str(config_with(tmp_path, **fields)), "-o", str(output)])
    err = capsys.readouterr().err
    assert status == 2 and not output.exists()
    assert phrase in err and err.count("\n") == 1


def test_an_absurd_config_is_refused_where_facts_are_made_from_it(tmp_path):
    with pytest.raises(RecipeError, match="hidden_size is 1,099,511,627,776"):
        load_facts(config_with(tmp_path, hidden_size=2**40, head_dim=128))


def test_every_size_limit_names_the_model_it_comes_from():
    assert all(largest > 0 and model for largest, model in LARGEST.values())


@pytest.mark.parametrize("path", FIXTURE_RECIPES, ids=lambda path: path.parent.parent.name)
def test_the_fixture_recipes_and_their_facts_pass_the_size_checks(path):
    recipe = load_recipe(path)
    facts_for(recipe, None)
    assert recipe.row_tokens <= limit_of("context tokens")


# Memory: estimated from a case's shape, refused when the lever is built.

def test_a_lever_whose_case_exceeds_the_available_memory_is_refused_naming_it(monkeypatch):
    monkeypatch.setenv(MEMORY_ENV, str(10**6))
    with pytest.raises(ShapeError) as refused:
        attention.cpu_tier(LLAMA_ID, LeverOptions())
    message = str(refused.value)
    assert message.startswith("lever attention-backend: case llama3.1-8b-")
    assert "seq_len" in message and "1.0 MB of memory available here (CORRECTNESS_MEMORY_BYTES)" in message
    assert "\n" not in message


def test_correctness_run_refuses_a_case_over_the_available_memory(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "correctness.cli", "run", str(LLAMA), "--tier", "cpu", "--results-dir", str(tmp_path / "r")],
        capture_output=True, text=True, timeout=120, env={**__import__("os").environ, MEMORY_ENV: str(10**6)},
    )
    one_line_refusal(done, "the component tests cannot be built", "of memory available here")


def test_the_fixture_levers_fit_the_memory_here():
    for lever in attention.cpu_tier(LLAMA_ID, LeverOptions()) + cross_entropy.cpu_tier(LLAMA_ID, LeverOptions()):
        assert all(case.memory_bytes for case in lever.cases), lever.name


def test_the_available_memory_is_read_from_meminfo_or_the_environment(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemAvailable:    8000000 kB\n")
    monkeypatch.delenv(MEMORY_ENV, raising=False)
    assert available_bytes(meminfo) == 8_000_000 * 1024
    monkeypatch.setenv(MEMORY_ENV, "12345")
    assert available_bytes(meminfo) == 12345
    monkeypatch.setenv(MEMORY_ENV, "lots")
    with pytest.raises(RecipeError, match=f"{MEMORY_ENV} must be a positive number of bytes, got 'lots'"):
        available_bytes(meminfo)
