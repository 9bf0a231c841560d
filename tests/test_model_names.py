"""A model's name matches as users write it: without regard to case, with `_`, `-` and `.` alike
(correctness.model_config.same_model), wherever a recipe's `model:` meets model facts, a config's
folder, a record or an attention capture; a real mismatch is refused in one line naming both."""

import json
import shutil
import subprocess
import sys

import pytest

from attention_shapes import tiny_shape
from correctness.attach import attach
from correctness.attention.inputs import checkpoint_file, checkpoint_inputs
from correctness.attention.shapes import attention_shape
from correctness.shapes import SMOKE_SCALE
from correctness.cli import main
from correctness.errors import CaseInputError, CorrectnessError, RecipeError, ShapeError
from correctness.fixtures import CONFIGS_DIR, MODELS_DIR, recipe_path
from correctness.model_config import name_key, same_model, short_name
from correctness.models import facts_for, fixture_config, load_facts, load_model, model_file
from correctness.recipes import load_recipe
from test_attention_paths import write_capture
from toy_records import toy_record

QWEN = "qwen3-32b/h100/example-tp4-pp2-offload08"
GEMMA = "gemma-4-31b/h100/attune-tp2-pp4-split13"
SPELLINGS = ("Qwen3-32B", "qwen3-32b", "QWEN3-32B", "Qwen3_32B", "qwen3.32b")


def config_in(tmp_path, folder: str, model: str = "Qwen3-32B"):
    """The fixture config of `model`, in a folder named `folder` (the model's name as a user wrote it)."""
    (tmp_path / folder).mkdir()
    shutil.copy(CONFIGS_DIR / model / "config.json", tmp_path / folder / "config.json")
    return tmp_path / folder


def one_line(text: str) -> bool:
    return text.count("\n") == 1 and text.endswith("\n")


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_spellings_of_a_name_are_one_model(spelling):
    assert same_model(spelling, "Qwen3-32B") and name_key(spelling) == "qwen3-32b"


@pytest.mark.parametrize("other", ["Qwen3-30B-A3B", "Qwen3-32B-Instruct", "Qwen332B", "Qwen3 32B", "Qwen3-32-B"])
def test_other_names_are_other_models(other):
    assert not same_model(other, "Qwen3-32B")


@pytest.mark.parametrize(("name", "spelling"), [("Gemma-4-31B", "gemma_4_31b"), ("Gemma-4-31B", "GEMMA.4.31B"),
                                                ("Llama-3.1-8B", "llama_3.1_8b"), ("Llama-3.1-8B", "LLAMA-3-1-8B")])
def test_short_names_of_one_model_are_one_models(name, spelling):
    """A capture's model is its short name: spellings of one model give short names of one model."""
    assert same_model(short_name(name), short_name(spelling))


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_a_config_in_a_folder_spelled_otherwise_is_the_recipes_model(tmp_path, spelling):
    facts = load_facts(config_in(tmp_path, spelling))
    assert facts.name == spelling and facts_for(load_recipe(recipe_path(QWEN)), facts) is facts


def test_a_config_of_another_model_is_refused_naming_both(tmp_path):
    facts = load_facts(config_in(tmp_path, "qwen3-30b-a3b", model="Qwen3-30B-A3B"))
    with pytest.raises(RecipeError) as refused:
        facts_for(load_recipe(recipe_path(QWEN)), facts)
    assert "are for qwen3-30b-a3b, but the recipe is for Qwen3-32B" in str(refused.value)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("spelling", ["gemma_4_31b", "GEMMA.4.31B", "gemma-4-31b"])
def test_the_suites_own_facts_file_is_found_however_the_model_is_written(spelling):
    assert model_file(spelling) == MODELS_DIR / "gemma-4-31b.yaml"
    assert load_model(spelling).name == "Gemma-4-31B"


@pytest.mark.parametrize("spelling", ["qwen3_32b", "QWEN3.32B", "qwen3-32b"])
def test_the_suites_own_config_is_found_however_the_model_is_written(spelling):
    assert model_file(spelling) is None
    assert fixture_config(spelling) == CONFIGS_DIR / "Qwen3-32B" / "config.json"
    assert load_model(spelling).name == "Qwen3-32B"


def test_attention_shapes_take_facts_of_the_model_spelled_otherwise(tmp_path):
    recipe = load_recipe(recipe_path(QWEN))
    assert attention_shape(recipe, load_facts(config_in(tmp_path, "qwen3_32b")), "global", SMOKE_SCALE).heads == 16
    llama = load_facts(CONFIGS_DIR / "Llama-3.1-8B")
    with pytest.raises(ShapeError, match=f"^recipe {QWEN} is for Qwen3-32B, not Llama-3.1-8B$"):
        attention_shape(recipe, llama, "global", SMOKE_SCALE)


def test_a_capture_of_the_model_spelled_otherwise_is_read_and_of_another_refused(tmp_path):
    case = tiny_shape(dtype="bf16", batch=1, model="qwen3-32b")
    write_capture(tmp_path, 1, tiny_shape(dtype="bf16", batch=1, model=short_name("Qwen3_32B")))
    assert checkpoint_inputs(case, checkpoint_file(tmp_path, 1), seed=0, device="cpu").q.shape[2] == case.heads
    write_capture(tmp_path, 2, tiny_shape(dtype="bf16", batch=1, model="qwen3-30b-a3b"))
    with pytest.raises(CaseInputError, match="model qwen3-30b-a3b in the capture, the case needs qwen3-32b$"):
        checkpoint_inputs(case, checkpoint_file(tmp_path, 2), seed=0, device="cpu")


def test_a_record_of_the_model_spelled_otherwise_is_attached_and_of_another_refused(tmp_path):
    recipe = tmp_path / "gemma.yaml"
    shutil.copy(recipe_path(GEMMA), recipe)
    record = toy_record(tmp_path / "records")
    data = json.loads(record.read_text())
    data["recipe"]["model"] = "GEMMA_4_31B"
    record.write_text(json.dumps(data))
    assert [done.action for done in attach(recipe, [record])] == ["added"]
    data["recipe"]["model"] = "Gemma-4-26B"
    record.write_text(json.dumps(data))
    with pytest.raises(CorrectnessError, match="it is for Gemma-4-26B, not Gemma-4-31B"):
        attach(recipe, [record])


def test_run_takes_a_config_in_a_folder_spelled_otherwise(tmp_path):
    finished = subprocess.run(
        [sys.executable, "-m", "correctness.cli", "run", str(recipe_path(QWEN)), "--tier", "cpu",
         "--model-config", str(config_in(tmp_path, "qwen3_32b")), "--results-dir", str(tmp_path / "results"),
         "--", "--collect-only", "-q", "-p", "no:cacheprovider"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    assert "[qwen3_32b-global-" in finished.stdout


@pytest.mark.parametrize("command", [["run", "--tier", "cpu"], ["check", "--reference", recipe_path(QWEN)]])
def test_run_and_check_refuse_a_config_of_another_model_in_one_line_naming_both(tmp_path, capsys, command):
    config = config_in(tmp_path, "qwen3-30b-a3b", model="Qwen3-30B-A3B")
    status = main([command[0], str(recipe_path(QWEN)), *map(str, command[1:]), "--model-config", str(config)])
    captured = capsys.readouterr()
    assert status == 2 and captured.out == "" and one_line(captured.err), captured.err
    assert "are for qwen3-30b-a3b, but the recipe is for Qwen3-32B" in captured.err
