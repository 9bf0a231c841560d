"""Model facts from a Hugging Face config.json (correctness.model_config, `correctness model-facts`)."""

import json
import math

import pytest
import yaml

from correctness.cli import main
from correctness.fixtures import CONFIGS_DIR, MODELS_DIR, RECIPES_DIR
from correctness.model_config import ModelFactsError, facts_from_config, short_name
from correctness.models import facts_for, load_facts, load_model
from correctness.recipes import load_recipe
from correctness.errors import RecipeError

SEED_MODELS = ("Gemma-4-31B", "Nemotron-3-Super-120B-A12B")
OTHER_MODELS = ("Llama-3.1-8B", "Mistral-7B-v0.1", "Qwen3-32B", "Qwen3-30B-A3B", "GPT-OSS-20B", "Moonlight-16B-A3B")
# Fields of a facts file that say where it came from, not what the model is (config_fields: what
# became of each field of the config; tests/test_config_fields.py).
DOCUMENTATION = {"source", "revision", "config_sha256", "family", "config_fields"}


def leaves(data, prefix=""):
    if isinstance(data, dict):
        for key, value in data.items():
            yield from leaves(value, f"{prefix}{key}.")
    else:
        yield prefix[:-1], data


@pytest.mark.parametrize("model", SEED_MODELS)
def test_the_seed_models_facts_come_out_of_their_configs_identical(model):
    """Every field of the hand-written facts (the levers read nothing else) is what the config and
    its family give; the generated facts add nothing the hand-written ones lack but provenance."""
    written = dict(leaves(yaml.safe_load((MODELS_DIR / f"{model.lower()}.yaml").read_text())))
    generated = dict(leaves(facts_from_config(CONFIGS_DIR / model)))
    differing = {key: (written.get(key), generated.get(key)) for key in written.keys() | generated.keys()
                 if key.split(".")[0] not in DOCUMENTATION and written.get(key, "absent") != generated.get(key, "absent")}
    assert differing == {}


@pytest.mark.parametrize("model", SEED_MODELS + OTHER_MODELS)
def test_every_fixture_config_makes_facts_that_the_levers_read(model):
    facts = load_facts(CONFIGS_DIR / model)
    assert facts.name == model and facts.source.endswith(f"{model}/config.json") and len(facts.sha256) == 64
    for kind in facts.attention_kinds:
        geometry = facts.attention_kind(kind)
        assert geometry.query_heads % geometry.kv_heads == 0
        assert facts.attention_layers(kind), f"no layer runs {kind}"


def test_the_config_fields_land_where_the_levers_read_them():
    config = json.loads((CONFIGS_DIR / "Moonlight-16B-A3B" / "config.json").read_text())
    moonlight = load_model("Moonlight-16B-A3B")
    mla = moonlight.attention_kind("global")
    assert mla.head_dim == config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
    assert moonlight.field("attention.kinds.global.v_head_dim") == config["v_head_dim"]
    assert math.isclose(mla.softmax_scale, 1 / math.sqrt(mla.head_dim))
    assert moonlight.layer_kind(0) == "dense" and moonlight.layer_kind(1) == "moe"
    assert moonlight.attention_layers("global") == tuple(range(config["num_hidden_layers"]))
    assert moonlight.field("moe.shared_expert_ffn_hidden_size") == config["n_shared_experts"] * config["moe_intermediate_size"]
    gpt_oss = load_model("GPT-OSS-20B")
    gpt_config = json.loads((CONFIGS_DIR / "GPT-OSS-20B" / "config.json").read_text())
    assert gpt_oss.field("attention.sinks") is True
    assert gpt_oss.attention_kind("sliding").window == gpt_config["sliding_window"]
    assert [gpt_oss.layer_kind(layer) for layer in range(4)] == ["sliding", "global", "sliding", "global"]


@pytest.mark.parametrize("model, activation, gated", [
    ("Gemma-4-31B", "gelu_tanh", True), ("Nemotron-3-Super-120B-A12B", "squared_relu", False),
    ("Llama-3.1-8B", "silu", True), ("Mistral-7B-v0.1", "silu", True), ("Qwen3-32B", "silu", True), ("Qwen3-30B-A3B", "silu", True),
    ("Moonlight-16B-A3B", "silu", True), ("GPT-OSS-20B", "quick_gelu", True),
])
def test_the_mlp_activation_comes_from_the_config_and_its_family(model, activation, gated):
    """The activation each config names (GPT-OSS's family replaces its `silu`: the experts run
    Megatron's quick_gelu with an offset of 1 on the up half, clamped at the config's swiglu_limit)."""
    mlp = load_model(model).field("mlp")
    assert (mlp["activation"], mlp["gated"]) == (activation, gated)
    if model == "GPT-OSS-20B":
        config = json.loads((CONFIGS_DIR / model / "config.json").read_text())
        assert (mlp["glu_linear_offset"], mlp["clamp"]) == (1.0, config["swiglu_limit"])
    else:
        assert "clamp" not in mlp and "glu_linear_offset" not in mlp


def test_a_config_naming_no_activation_leaves_it_unsaid(tmp_path):
    assert facts_from_config(config_with(tmp_path))["mlp"] == {"gated": True}


def config_with(tmp_path, name="Tiny-Model", **fields):
    base = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 4, "hidden_size": 64,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256,
            "tie_word_embeddings": False, "rope_theta": 10000.0}
    base.update(fields)
    base = {key: value for key, value in base.items() if value is not ...}
    folder = tmp_path / name
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(base))
    return folder


def test_query_pre_attn_scalar_sets_the_scale_and_a_softcap_is_read(tmp_path):
    facts = facts_from_config(config_with(tmp_path, query_pre_attn_scalar=144, attn_logit_softcapping=50.0))
    assert facts["attention"]["softmax_scale"] == 144 ** -0.5
    assert facts["attention"]["logit_softcap"] == 50.0


def test_a_sliding_window_pattern_makes_every_nth_layer_global(tmp_path):
    facts = facts_from_config(config_with(tmp_path, sliding_window=512, sliding_window_pattern=2))
    assert facts["layer_pattern"] == {"repeat": ["sliding", "global"]}
    assert facts["attention"]["kinds"]["sliding"]["window"] == 512
    assert facts["attention"]["kinds"]["global"]["window"] is None


def test_mla_with_yarn_scales_the_softmax_by_mscale_squared(tmp_path):
    config = json.loads((CONFIGS_DIR / "Moonlight-16B-A3B" / "config.json").read_text())
    config["rope_scaling"] = {"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0}
    folder = tmp_path / "DeepSeek-Like"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    mscale = 0.1 * math.log(40) + 1.0
    assert math.isclose(facts_from_config(folder)["attention"]["softmax_scale"], mscale ** 2 / math.sqrt(192))


@pytest.mark.parametrize("name, short", [("Gemma-4-31B", "gemma4-31b"), ("Llama-3.1-8B", "llama3.1-8b"),
                                         ("Nemotron-3-Super-120B-A12B", "nemotron3-super-120b-a12b"),
                                         ("GPT-OSS-20B", "gpt-oss-20b")])
def test_short_names_join_a_version_to_its_word_only(name, short):
    assert short_name(name) == short


@pytest.mark.parametrize("fields, message", [
    ({"num_attention_heads": 6, "num_key_value_heads": 4}, "num_attention_heads 6 is not a multiple of num_key_value_heads 4"),
    ({"num_hidden_layers": ...}, "missing field num_hidden_layers"),
    ({"hidden_size": "4096"}, "field hidden_size must be an integer"),
    ({"layer_types": ["full_attention", "chunked_attention", "full_attention", "full_attention"]},
     "layer type 'chunked_attention' is not one the llama family knows"),
    ({"layer_types": ["full_attention"]}, "field layer_types must list a layer type per layer (4)"),
    ({"architectures": ["FancyForCausalLM"]}, "architecture FancyForCausalLM has no family in families.yaml"),
    ({"architectures": ...}, "missing field architectures"),
    ({"layer_types": ["sliding_attention"] * 4}, "missing field sliding_window"),
    ({"num_experts": 8, "num_experts_per_tok": 9, "moe_intermediate_size": 32}, "num_experts_per_tok 9 is more than the 8 experts"),
    ({"hidden_act": "mish"}, "field hidden_act names the activation 'mish', not one the facts know"),
])
def test_a_bad_config_is_refused_in_one_line_naming_the_field(tmp_path, capsys, fields, message):
    folder = config_with(tmp_path, **fields)
    with pytest.raises(ModelFactsError) as refused:
        facts_from_config(folder)
    assert message in str(refused.value) and "\n" not in str(refused.value)
    output = tmp_path / "facts.yaml"
    assert main(["model-facts", str(folder), "--output", str(output)]) == 2
    assert not output.exists()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_malformed_json_is_refused(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text('{"architectures": [')
    assert main(["model-facts", str(path)]) == 2
    assert "malformed JSON at line 1" in capsys.readouterr().err


def test_model_facts_writes_a_file_the_levers_read_back(tmp_path, capsys):
    output = tmp_path / "llama.yaml"
    assert main(["model-facts", str(CONFIGS_DIR / "Llama-3.1-8B"), "-o", str(output)]) == 0
    written = load_facts(output)
    from_config = load_facts(CONFIGS_DIR / "Llama-3.1-8B")
    assert written.data == from_config.data and written.name == "Llama-3.1-8B"


def test_facts_for_another_model_are_refused(tmp_path):
    facts = load_facts(CONFIGS_DIR / "Qwen3-32B")
    with pytest.raises(RecipeError, match="are for Qwen3-32B, but the recipe is for Llama-3.1-8B"):
        facts_for(load_recipe(RECIPES_DIR / "llama-3.1-8b/h100/example-tp2-pp1-offload05.yaml"), facts)
    assert facts_for(load_recipe(RECIPES_DIR / "qwen3-32b/h100/example-tp4-pp2-offload08.yaml"), facts) is facts


def llama_recipe(tmp_path, **changes):
    """The Gemma fixture recipe rewritten for Llama-3.1-8B (its model and layout fields only)."""
    from correctness.fixtures import recipe_path

    data = yaml.safe_load(recipe_path("gemma-4-31b/h100/attune-tp2-pp4-split13").read_text())
    data["model"] = changes.pop("model", "Llama-3.1-8B")
    data["layout"].update(changes)
    if "tp" in changes:  # the run script and the GPUs as the layout says (correctness.recipe_arguments)
        tp, pp = changes["tp"], data["layout"]["pp"]
        data["gpu"]["count"] = tp * pp
        data["run"] = data["run"].replace("--tensor-model-parallel-size 2", f"--tensor-model-parallel-size {tp}") \
            .replace("--actor-num-gpus-per-node 8", f"--actor-num-gpus-per-node {tp * pp}")
    path = tmp_path / "llama.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_run_refuses_a_config_of_another_model_before_any_test(tmp_path, capsys):
    recipe = llama_recipe(tmp_path)
    status = main(["run", str(recipe), "--tier", "cpu", "--model-config", str(CONFIGS_DIR / "Qwen3-32B"),
                   "--results-dir", str(tmp_path / "results")])
    captured = capsys.readouterr()
    assert status == 2 and captured.out == "" and captured.err.count("\n") == 1
    assert "are for Qwen3-32B, but the recipe is for Llama-3.1-8B" in captured.err


def test_run_refuses_a_tp_size_that_does_not_split_the_heads(tmp_path, capsys):
    recipe = llama_recipe(tmp_path, tp=3)
    status = main(["run", str(recipe), "--tier", "cpu", "--model-config", str(CONFIGS_DIR / "Llama-3.1-8B"),
                   "--results-dir", str(tmp_path / "results")])
    captured = capsys.readouterr()
    assert status == 2 and captured.err.count("\n") == 1, captured.err
    assert "32 query heads and 8 key-value heads do not split over TP 3" in captured.err
