"""Every field of a config.json has a fate in the facts (`config_fields`: used, or ignored with the
reason), windows are applied as the model's code applies them (Mistral: every layer; Qwen3: not
with use_sliding_window false), and a malformed config is refused in one line
(correctness.model_config)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from correctness.attention.shapes import attention_shape
from correctness.shapes import SMOKE_SCALE
from correctness.fixtures import CONFIGS_DIR, recipe_path
from correctness.model_config import ModelFactsError, facts_from_config, families, field_table
from correctness.models import load_facts
from correctness.recipes import load_recipe

FIXTURE_CONFIGS = sorted(folder.name for folder in CONFIGS_DIR.iterdir() if (folder / "config.json").is_file())
CLI = Path(sys.executable).parent / "correctness"


def text_config(model: str) -> dict:
    config = json.loads((CONFIGS_DIR / model / "config.json").read_text())
    return config.get("text_config", config)


def config_at(tmp_path, fields: dict, name: str = "Tiny-Model") -> Path:
    folder = tmp_path / name
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(fields))
    return folder


def tiny(**changes) -> dict:
    """A small Llama config; a value of ... drops the field."""
    fields = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 4, "hidden_size": 64,
              "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256,
              "tie_word_embeddings": False, "rope_theta": 10000.0}
    fields.update(changes)
    return {key: value for key, value in fields.items() if value is not ...}


def fates(facts: dict) -> tuple[list[str], dict[str, str]]:
    section = facts["config_fields"]
    return section["used"], section["ignored"]


# -- every field has one fate --------------------------------------------------------------------

@pytest.mark.parametrize("model", FIXTURE_CONFIGS)
def test_every_field_of_a_fixture_config_is_used_or_ignored_exactly_once(model):
    used, ignored = fates(facts_from_config(CONFIGS_DIR / model))
    assert used == sorted(used)
    assert sorted(used + list(ignored)) == sorted(text_config(model))
    assert all(isinstance(reason, str) and reason and "\n" not in reason for reason in ignored.values())


@pytest.mark.parametrize("model", FIXTURE_CONFIGS)
def test_no_fixture_config_has_a_field_the_suite_does_not_know(model):
    _, ignored = fates(facts_from_config(CONFIGS_DIR / model))
    assert not [field for field, reason in ignored.items() if reason.startswith("not known to the suite")]


@pytest.mark.parametrize("model", FIXTURE_CONFIGS)
def test_every_field_the_facts_are_made_from_is_named_in_the_table(model):
    """The table (families.yaml config_fields.used) says what each field the code reads gives; the
    family's `expects` what the others are checked against."""
    facts = facts_from_config(CONFIGS_DIR / model)
    expected = families()[facts["family"]].get("config_fields", {}).get("expects", {})
    assert set(fates(facts)[0]) - set(expected) <= set(field_table()["used"])


def test_the_fields_section_reads_back_from_a_facts_file(tmp_path):
    from correctness.cli import main

    output = tmp_path / "mistral.yaml"
    assert main(["model-facts", str(CONFIGS_DIR / "Mistral-7B-v0.1"), "-o", str(output)]) == 0
    written = load_facts(output)
    assert written.data == facts_from_config(CONFIGS_DIR / "Mistral-7B-v0.1")
    assert written.attention_kind("sliding").window == 4096


# -- windows --------------------------------------------------------------------------------------

def test_mistral_slides_on_every_layer_with_its_configs_window():
    facts = facts_from_config(CONFIGS_DIR / "Mistral-7B-v0.1")
    used, _ = fates(facts)
    assert "sliding_window" in used
    assert facts["layer_pattern"] == {"repeat": ["sliding"]}
    assert list(facts["attention"]["kinds"]) == ["sliding"]
    assert facts["attention"]["kinds"]["sliding"]["window"] == 4096
    assert facts["attention"]["kinds"]["sliding"]["kv_heads"] == 8
    assert facts["attention"]["kinds"]["sliding"]["head_dim"] == 128


def test_the_attention_lever_builds_a_window_edge_shape_of_mistral():
    """The lever reads Mistral's one kind as a windowed kind: Transformer Engine's (window - 1, 0),
    a sequence past the window at the smoke scale."""
    recipe = load_recipe(recipe_path("llama-3.1-8b/h100/example-tp2-pp1-offload05"))
    recipe = type(recipe)(id=recipe.id, path=recipe.path, data={**recipe.data, "model": "Mistral-7B-v0.1"},
                          sha256=recipe.sha256)
    shape = attention_shape(recipe, load_facts(CONFIGS_DIR / "Mistral-7B-v0.1"), "sliding", SMOKE_SCALE)
    assert shape.window == (4095, 0) and shape.seq_len > 4096


def test_a_mistral_config_without_a_window_slides_nowhere(tmp_path):
    facts = facts_from_config(config_at(tmp_path, tiny(architectures=["MistralForCausalLM"], sliding_window=None)))
    assert facts["layer_pattern"] == {"repeat": ["global"]}
    assert facts["attention"]["kinds"]["global"]["window"] is None
    assert "sliding_window" in fates(facts)[0]


def test_a_mistral_config_that_does_not_say_its_window_is_refused(tmp_path):
    """transformers' MistralConfig defaults sliding_window to 4096 where the field is absent."""
    with pytest.raises(ModelFactsError, match="missing field sliding_window"):
        facts_from_config(config_at(tmp_path, tiny(architectures=["MistralForCausalLM"])))


@pytest.mark.parametrize("model", ["Qwen3-32B", "Qwen3-30B-A3B"])
def test_qwen3s_window_does_not_apply_with_use_sliding_window_false(model, tmp_path):
    fields = json.loads((CONFIGS_DIR / model / "config.json").read_text())
    fields["sliding_window"] = 4096  # as Qwen2.5's and some Qwen3 configs carry it
    facts = facts_from_config(config_at(tmp_path, fields, model))
    used, ignored = fates(facts)
    assert "use_sliding_window" in used
    assert "use_sliding_window is false" in ignored["sliding_window"]
    assert "use_sliding_window is false" in ignored["max_window_layers"]
    assert [kind["window"] for kind in facts["attention"]["kinds"].values()] == [None]
    assert fates(facts_from_config(CONFIGS_DIR / model))[1]["sliding_window"] == ignored["sliding_window"]


def test_a_llama_config_with_a_window_keeps_none_and_says_why(tmp_path):
    facts = facts_from_config(config_at(tmp_path, tiny(sliding_window=4096)))
    assert facts["attention"]["kinds"]["global"]["window"] is None
    assert "LlamaForCausalLM" in fates(facts)[1]["sliding_window"]


# -- specific fates ----------------------------------------------------------------------------------

def test_llamas_rope_scaling_is_ignored_naming_the_lever_that_takes_it_from_the_recipe():
    used, ignored = fates(facts_from_config(CONFIGS_DIR / "Llama-3.1-8B"))
    assert "rope_scaling" not in used
    assert "--use-rope-scaling" in ignored["rope_scaling"]
    assert {"rope_theta", "num_key_value_heads", "hidden_act", "tie_word_embeddings"} <= set(used)
    assert ignored["bos_token_id"].startswith("tokenizer id")
    assert "cache" in ignored["use_cache"]


def test_mla_with_yarn_uses_rope_scaling_for_its_softmax_scale(tmp_path):
    fields = json.loads((CONFIGS_DIR / "Moonlight-16B-A3B" / "config.json").read_text())
    fields["rope_scaling"] = {"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0}
    assert "rope_scaling" in fates(facts_from_config(config_at(tmp_path, fields)))[0]


@pytest.mark.parametrize("model, field, words", [
    ("Nemotron-3-Super-120B-A12B", "rope_theta", "no position embedding"),
    ("Nemotron-3-Super-120B-A12B", "intermediate_size", "dense MLP layer, and the pattern has none"),
    ("GPT-OSS-20B", "hidden_act", "quick_gelu"),
    ("GPT-OSS-20B", "rope_scaling", "--use-rope-scaling"),
    ("Qwen3-30B-A3B", "intermediate_size", "every layer is MoE"),
    ("Gemma-4-31B", "rms_norm_eps", "epsilon"),
])
def test_a_field_the_family_overrides_is_ignored_with_the_familys_reason(model, field, words):
    used, ignored = fates(facts_from_config(CONFIGS_DIR / model))
    assert field not in used and words in ignored[field]


def test_a_second_name_of_a_field_must_agree_with_the_first(tmp_path):
    assert "experts_per_token" in fates(facts_from_config(CONFIGS_DIR / "GPT-OSS-20B"))[0]
    fields = json.loads((CONFIGS_DIR / "GPT-OSS-20B" / "config.json").read_text())
    fields["experts_per_token"] = 2
    with pytest.raises(ModelFactsError, match="num_experts_per_tok 4 and experts_per_token 2 disagree"):
        facts_from_config(config_at(tmp_path, fields))


@pytest.mark.parametrize("model, field, value", [
    ("Qwen3-30B-A3B", "norm_topk_prob", False),
    ("Gemma-4-31B", "num_kv_shared_layers", 4),
])
def test_a_value_the_familys_facts_do_not_model_is_refused(model, field, value, tmp_path):
    fields = json.loads((CONFIGS_DIR / model / "config.json").read_text())
    (fields.get("text_config") or fields)[field] = value
    with pytest.raises(ModelFactsError, match=f"field {field} {json.dumps(value)}: the .* family"):
        facts_from_config(config_at(tmp_path, fields, model))


def test_an_unknown_field_is_listed_as_ignored(tmp_path):
    used, ignored = fates(facts_from_config(config_at(tmp_path, tiny(fancy_tokenizer_flag=True))))
    assert ignored["fancy_tokenizer_flag"].startswith("not known to the suite")


@pytest.mark.parametrize("field", ["attn_temperature", "rope_local_scaling", "sliding_window_size", "qk_layernorm_eps",
                                   "logit_scale"])
def test_an_unknown_field_that_looks_numerics_shaping_is_refused(field, tmp_path):
    with pytest.raises(ModelFactsError, match=f"field {field} is not known to the suite"):
        facts_from_config(config_at(tmp_path, tiny(**{field: 1.0})))


# -- malformed input ---------------------------------------------------------------------------------

def refused(tmp_path, text: str, match: str) -> None:
    path = tmp_path / "Bad-Model" / "config.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    with pytest.raises(ModelFactsError, match=match) as error:
        facts_from_config(path)
    assert "\n" not in str(error.value)


def test_a_config_nested_too_deep_is_refused(tmp_path):
    refused(tmp_path, '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deep")


def test_a_number_with_too_many_digits_is_refused(tmp_path):
    refused(tmp_path, json.dumps(tiny())[:-1] + ', "vocab_size": ' + "9" * 5000 + "}", "digits")


@pytest.mark.parametrize("text, key", [
    ('{"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "hidden_size": 128}', "hidden_size"),
    ('{"rope_scaling": {"factor": 8.0, "factor": 1.0}}', "factor"),
])
def test_a_duplicate_key_is_refused_naming_it(tmp_path, text, key):
    refused(tmp_path, text, f"duplicate key {key}")


BAD_NUMBERS = [math.inf, -math.inf, math.nan, 0, -1.0, "10000", True]


def with_value(where, value):
    """`where` with its "VALUE" replaced by value, at any depth."""
    if isinstance(where, dict):
        return {key: with_value(item, value) for key, item in where.items()}
    return value if where == "VALUE" else where


@pytest.mark.parametrize("value", BAD_NUMBERS)
@pytest.mark.parametrize("where, field", [
    ({"rope_theta": "VALUE"}, "rope_theta"),
    ({"rope_theta": ..., "rope_parameters": {"rope_theta": "VALUE"}}, "rope_parameters.rope_theta"),
    ({"rope_theta": ..., "rope_parameters": {"full_attention": {"rope_theta": "VALUE"}}},
     "rope_parameters.full_attention.rope_theta"),
    ({"sliding_window": 8, "sliding_window_pattern": 2, "rope_local_base_freq": "VALUE"}, "rope_local_base_freq"),
    ({"query_pre_attn_scalar": "VALUE"}, "query_pre_attn_scalar"),
    ({"attn_logit_softcapping": "VALUE"}, "attn_logit_softcapping"),
    ({"final_logit_softcapping": "VALUE"}, "final_logit_softcapping"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": "VALUE"}}, "rope_scaling.factor"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": "VALUE"}},
     "rope_scaling.high_freq_factor"),
])
def test_a_bad_number_is_refused_naming_the_field(tmp_path, where, field, value):
    refused(tmp_path, json.dumps(tiny(**with_value(where, value)), allow_nan=True), f"field {field} ")


@pytest.mark.parametrize("value", [0, -4096, 1.5, math.inf, "4096"])
@pytest.mark.parametrize("architecture, extra", [
    ("MistralForCausalLM", {}),
    ("Qwen3ForCausalLM", {"use_sliding_window": False, "head_dim": 16}),  # refused even where unused
    ("LlamaForCausalLM", {"layer_types": ["sliding_attention"] * 4}),
])
def test_a_bad_window_is_refused(tmp_path, value, architecture, extra):
    text = json.dumps(tiny(architectures=[architecture], sliding_window=value, **extra), allow_nan=True)
    refused(tmp_path, text, "field sliding_window ")


@pytest.mark.parametrize("value", [0, -0.5, 1.5, math.nan, "half"])
@pytest.mark.parametrize("where, field", [
    ({"partial_rotary_factor": "VALUE"}, "partial_rotary_factor"),
    ({"rope_parameters": {"rope_theta": 10000.0, "partial_rotary_factor": "VALUE"}}, "rope_parameters.partial_rotary_factor"),
])
def test_a_rotary_fraction_outside_0_1_is_refused(tmp_path, where, field, value):
    refused(tmp_path, json.dumps(tiny(**with_value(where, value)), allow_nan=True), f"field {field} ")


def test_mla_yarn_without_a_factor_is_refused(tmp_path):
    fields = json.loads((CONFIGS_DIR / "Moonlight-16B-A3B" / "config.json").read_text())
    fields["rope_scaling"] = {"type": "yarn", "mscale_all_dim": 1.0}
    refused(tmp_path, json.dumps(fields), "missing field rope_scaling.factor")


@pytest.mark.parametrize("text", [
    '{"architectures": ["LlamaForCausalLM"], "a": ' + "[" * 100_000 + "]" * 100_000 + "}",
    json.dumps(tiny(rope_theta=math.inf), allow_nan=True),
    json.dumps(tiny())[:-1] + ', "hidden_size": 64}',  # valid but for the key given twice
])
def test_the_cli_refuses_a_malformed_config_in_one_line(tmp_path, text):
    path = tmp_path / "Bad-Model" / "config.json"
    path.parent.mkdir()
    path.write_text(text)
    output = tmp_path / "facts.yaml"
    finished = subprocess.run([str(CLI), "model-facts", str(path), "-o", str(output)], capture_output=True, text=True,
                              timeout=120)
    assert finished.returncode == 2, finished.stderr[-2000:]
    assert finished.stderr.count("\n") == 1 and "Traceback" not in finished.stderr, finished.stderr[-2000:]
    assert str(path) in finished.stderr and not output.exists()


def test_the_facts_written_hold_no_config_values_of_ignored_fields(tmp_path):
    """The section names fields and reasons only: a huge ignored value does not reach the facts."""
    facts = facts_from_config(config_at(tmp_path, tiny(fancy_blob=list(range(1000)))))
    assert "999" not in yaml.safe_dump(facts["config_fields"])
