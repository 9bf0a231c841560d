"""A model config is its model's (correctness.model_config): its architecture's family is the one the
model's name says (a Llama config in a folder named Gemma-4-31B is refused), its model_type agrees
with its architectures, and a field whose name says it may shape numerics (a multiplier, a clip, a
scaling, a muP width) is refused until the family table gives it a fate."""

import copy
import json

import pytest
import yaml

from correctness import model_config
from correctness.cli import main
from correctness.errors import RecipeError
from correctness.fixtures import CONFIGS_DIR, RECIPES_DIR
from correctness.model_config import ModelFactsError, facts_from_config, name_families
from correctness.models import facts_for, load_facts
from correctness.recipes import load_recipe

GEMMA_RECIPE = RECIPES_DIR / "gemma-4-31b/h100/attune-tp2-pp4-split13.yaml"


def config_in(tmp_path, model: str, folder: str, **changes):
    """The fixture config of `model` in tmp_path/folder/config.json, its fields changed (... drops one)."""
    config = json.loads((CONFIGS_DIR / model / "config.json").read_text())
    config.update(changes)
    config = {key: value for key, value in config.items() if value is not ...}
    path = tmp_path / folder / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config))
    return path


# The config's architecture is the model's family

def test_a_llama_config_in_a_folder_named_gemma_is_refused_naming_both(tmp_path):
    path = config_in(tmp_path, "Llama-3.1-8B", "Gemma-4-31B")
    with pytest.raises(ModelFactsError) as refused:
        facts_from_config(path)
    assert str(refused.value) == (
        f"model config {path}: architecture LlamaForCausalLM is of the llama family, but the model Gemma-4-31B (the"
        " name of the folder holding its config.json) is of the gemma4 family: this is another model's config")


def test_run_refuses_it_before_any_test_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(pytest, "main", lambda *args, **kwargs: pytest.fail("pytest started"))
    path = config_in(tmp_path, "Llama-3.1-8B", "Gemma-4-31B")
    status = main(["run", str(GEMMA_RECIPE), "--tier", "cpu", "--model-config", str(path.parent),
                   "--results-dir", str(tmp_path / "results")])
    captured = capsys.readouterr()
    assert status == 2 and captured.out == "" and captured.err.count("\n") == 1, captured.err
    assert "LlamaForCausalLM is of the llama family, but the model Gemma-4-31B" in captured.err
    assert not (tmp_path / "results").exists()


def test_model_facts_refuses_it_and_writes_nothing(tmp_path, capsys):
    path = config_in(tmp_path, "Qwen3-32B", "Llama-3.1-8B")
    output = tmp_path / "facts.yaml"
    assert main(["model-facts", str(path), "--output", str(output)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Qwen3ForCausalLM is of the qwen3 family, but the model Llama-3.1-8B" in err
    assert not output.exists()


@pytest.mark.parametrize("model, folder", [
    ("Llama-3.1-8B", "Llama-3.1-8B"),
    ("Llama-3.1-8B", "Mistral-7B"),  # one family: the model's own arguments then say what differs
    ("Llama-3.1-8B", "my-finetune-8b"),  # a name no family's: taken as its config says
    ("Llama-3.1-8B", "DeepSeek-R1-Distill-Llama-8B"),  # the name holds both families' words
    ("Qwen3-30B-A3B", "qwen3_30b_a3b"),
    ("Moonlight-16B-A3B", "Moonlight-16B-A3B-Instruct"),
    ("Gemma-4-31B", "gemma-4-31b-it"),
])
def test_a_config_of_the_models_own_family_is_taken(tmp_path, model, folder):
    facts = facts_from_config(config_in(tmp_path, model, folder))
    assert facts["name"] == folder


@pytest.mark.parametrize("model", sorted(folder.name for folder in CONFIGS_DIR.iterdir() if folder.is_dir()))
def test_every_fixture_configs_name_is_its_familys(model):
    facts = facts_from_config(CONFIGS_DIR / model)
    assert facts["family"] in name_families(model)


def test_the_recipes_model_and_its_config_must_agree_through_the_folders_name(tmp_path):
    """The facts' name is the folder's, which the recipe's model must be: a Gemma config renamed for
    a Llama recipe is refused by its name, a Llama config named Gemma by its family."""
    gemma = load_facts(config_in(tmp_path, "Gemma-4-31B", "Gemma-4-31B").parent)
    llama = load_recipe(RECIPES_DIR / "llama-3.1-8b/h100/example-tp2-pp1-offload05.yaml")
    with pytest.raises(RecipeError, match="are for Gemma-4-31B, but the recipe is for Llama-3.1-8B"):
        facts_for(llama, gemma)


@pytest.mark.parametrize("model, changes, message", [
    ("Llama-3.1-8B", {"model_type": "gemma4"},
     "field model_type 'gemma4' is not the llama family's (llama, mistral), but architectures names LlamaForCausalLM"),
    ("Qwen3-32B", {"model_type": "qwen3_moe"},
     "field model_type 'qwen3_moe' is not the qwen3 family's (qwen3), but architectures names Qwen3ForCausalLM"),
])
def test_a_model_type_that_contradicts_the_architecture_is_refused(tmp_path, model, changes, message):
    with pytest.raises(ModelFactsError) as refused:
        facts_from_config(config_in(tmp_path, model, model, **changes))
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_gemmas_text_config_model_type_is_checked_too(tmp_path):
    config = json.loads((CONFIGS_DIR / "Gemma-4-31B" / "config.json").read_text())
    config["text_config"]["model_type"] = "llama"
    path = tmp_path / "Gemma-4-31B" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(config))
    with pytest.raises(ModelFactsError, match="field text_config.model_type 'llama' is not the gemma4 family's"):
        facts_from_config(path)


def test_model_type_is_used_as_a_check():
    facts = facts_from_config(CONFIGS_DIR / "Llama-3.1-8B")
    assert "model_type" in facts["config_fields"]["used"]


# Fields that shape numerics are refused until the table names them

NUMERICS_SHAPING = ["clip_qkv", "residual_multiplier", "embedding_multiplier", "mup_width_multiplier",
                    "attention_multiplier", "logits_scaling", "logit_scale", "lm_head_multiplier", "width_mult",
                    "residual_in_fp32", "attn_softmax_in_fp32", "router_z_loss_coef", "logitScale", "scaleEmb"]


@pytest.mark.parametrize("field", NUMERICS_SHAPING)
def test_a_field_that_may_shape_numerics_is_refused_until_the_table_names_it(tmp_path, field):
    path = config_in(tmp_path, "Llama-3.1-8B", "Llama-3.1-8B", **{field: 2.0})
    with pytest.raises(ModelFactsError) as refused:
        facts_from_config(path)
    message = str(refused.value)
    assert f"field {field} is not known to the suite, and its name" in message and "\n" not in message
    assert "add it to config_fields in families.yaml" in message


@pytest.mark.parametrize("fate", ["used", "ignored"])
def test_a_field_the_table_names_is_taken_with_its_fate(tmp_path, monkeypatch, fate):
    table = copy.deepcopy(model_config._family_table())
    table["config_fields"][fate]["clip_qkv"] = "a test's fate for it"
    monkeypatch.setattr(model_config, "_family_table", lambda: table)
    facts = facts_from_config(config_in(tmp_path, "Llama-3.1-8B", "Llama-3.1-8B", clip_qkv=8.0))
    ignored = facts["config_fields"]["ignored"]["clip_qkv"]
    assert ignored == ("a test's fate for it" if fate == "ignored"
                       else "not needed by this config (where it applies it gives a test's fate for it)")


def test_a_field_whose_name_says_nothing_of_numerics_is_still_listed(tmp_path):
    facts = facts_from_config(config_in(tmp_path, "Llama-3.1-8B", "Llama-3.1-8B", fancy_tokenizer_flag=True))
    assert facts["config_fields"]["ignored"]["fancy_tokenizer_flag"].startswith("not known to the suite")


def test_the_word_list_is_in_the_family_table():
    words = set(yaml.safe_load((model_config.FAMILIES_FILE).read_text())["config_fields"]["numerics_words"])
    assert {"multiplier", "clip", "mup", "scaling", "residual"} <= words
