"""Recipes, model facts and the attention shapes derived from them.

The numbers here (heads, groups, head dims, windows, layer indices) are the specification the
derivation must reproduce, taken from the two recipes and the models' public configs.
"""

import dataclasses
import hashlib
import re

import pytest
import yaml

from correctness.errors import RecipeError, ShapeError
from correctness.fixtures import recipe_path
from correctness.models import load_model
from correctness.recipes import load_recipe, training_arguments
from correctness.attention.shapes import attention_shape
from correctness.shapes import RECIPE_SCALE, Scale, SMOKE_SCALE

GEMMA_RECIPE = "gemma-4-31b/h100/attune-tp2-pp4-split13"
NEMOTRON_RECIPE = "nemotron-3-super-120b-a12b/h200/attune-tp4-pp2-ep8-mt16k"


# The fixture recipes


def test_gemma_recipe_fields(gemma_recipe):
    assert gemma_recipe.id == GEMMA_RECIPE
    assert (gemma_recipe.model, gemma_recipe.gpu) == ("Gemma-4-31B", "H100")
    assert (gemma_recipe.tp, gemma_recipe.row_tokens, gemma_recipe.rows_per_microbatch) == (2, 8192, 1)
    assert gemma_recipe.precision == "bf16"
    assert gemma_recipe.sha256 == hashlib.sha256(recipe_path(GEMMA_RECIPE).read_bytes()).hexdigest()


def test_nemotron_recipe_fields(nemotron_recipe):
    assert nemotron_recipe.id == NEMOTRON_RECIPE
    assert (nemotron_recipe.model, nemotron_recipe.gpu) == ("Nemotron-3-Super-120B-A12B", "H200")
    assert (nemotron_recipe.tp, nemotron_recipe.row_tokens, nemotron_recipe.rows_per_microbatch) == (4, 8192, 2)


def test_recipe_ref_carries_id_model_gpu_and_hash(gemma_recipe):
    ref = gemma_recipe.ref
    assert (ref.id, ref.model, ref.gpu, ref.sha256) == (
        GEMMA_RECIPE, "Gemma-4-31B", "H100", gemma_recipe.sha256,
    )


def test_gemma_training_arguments(gemma_recipe):
    assert gemma_recipe.argument("--tensor-model-parallel-size") == ["2"]
    assert gemma_recipe.argument("--qkv-format") == ["bshd"]
    assert gemma_recipe.argument("--recompute-modules") == ["core_attn", "mlp"]
    assert gemma_recipe.argument("--sequence-parallel") == []
    assert gemma_recipe.argument("--use-dynamic-batch-size") is None


def test_nemotron_training_arguments(nemotron_recipe):
    assert nemotron_recipe.argument("--tensor-model-parallel-size") == ["4"]
    assert nemotron_recipe.argument("--use-dynamic-batch-size") == []
    assert nemotron_recipe.argument("--max-tokens-per-gpu") == ["16384"]
    assert nemotron_recipe.argument("--qkv-format") is None


# training_arguments

RUN = """\
export CUDA_DEVICE_MAX_CONNECTIONS=1
python3 train.py \\
  --tensor-model-parallel-size 2 \\
  --sequence-parallel \\
  --recompute-modules core_attn mlp \\
  --lr 1e-5 --optimizer adam \\
  --lr 2e-5  # a comment
"""


def test_training_arguments_joins_continuation_lines_and_splits_values():
    arguments = training_arguments(RUN)
    assert arguments["--tensor-model-parallel-size"] == [["2"]]
    assert arguments["--recompute-modules"] == [["core_attn", "mlp"]]
    assert arguments["--optimizer"] == [["adam"]]


def test_training_arguments_gives_a_switch_no_values():
    assert training_arguments(RUN)["--sequence-parallel"] == [[]]


def test_training_arguments_keeps_every_occurrence_of_a_repeated_flag():
    assert training_arguments(RUN)["--lr"] == [["1e-5"], ["2e-5"]]


def test_training_arguments_reads_only_the_train_py_command():
    arguments = training_arguments(RUN)
    assert set(arguments) == {
        "--tensor-model-parallel-size", "--sequence-parallel", "--recompute-modules", "--lr", "--optimizer",
    }


@pytest.mark.parametrize(
    "after", ["| tee --append train.log", "&& python3 eval.py --lr 3e-5", "; echo --lr", "\npython3 eval.py --lr 3e-5"]
)
def test_training_arguments_stop_where_the_command_ends(after):
    arguments = training_arguments(RUN.replace("# a comment", after))
    assert arguments["--lr"] == [["1e-5"], ["2e-5"]]
    assert "--append" not in arguments


def test_training_arguments_unquotes_words_as_a_shell_would():
    arguments = training_arguments('python3 train.py --prompt-data "$SFT_DATA" --name \'two words\'')
    assert arguments == {"--prompt-data": [["$SFT_DATA"]], "--name": [["two words"]]}


@pytest.mark.parametrize("run", ["echo no training here --tp 2", "python3 train.pyc --tp 2", ""])
def test_training_arguments_without_a_train_py_command_is_empty(run):
    assert training_arguments(run) == {}


def test_recipe_argument_is_the_last_occurrence(tmp_path):
    recipe = load_recipe(write_recipe(tmp_path, valid_recipe(run=RUN)))
    assert recipe.argument("--lr") == ["2e-5"]


# Recipe errors, on broken copies written to tmp_path


def valid_recipe(**changes):
    data = {
        "model": "Gemma-4-31B",
        "gpu": {"type": "H100"},
        "workload": {"row_tokens": 8192, "precision": "bf16"},
        "layout": {"tp": 2, "rows_per_microbatch": 1},
        "run": "python3 train.py --qkv-format bshd\n",
    }
    return {**data, **changes}


def write_recipe(tmp_path, data, name="broken.yaml"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def test_a_recipe_outside_a_recipes_tree_is_named_by_its_model_gpu_and_file(tmp_path):
    recipe = load_recipe(write_recipe(tmp_path, valid_recipe(), name="my-recipe.yaml"))
    assert recipe.id == "gemma-4-31b/h100/my-recipe"
    assert recipe.tp == 2 and recipe.argument("--qkv-format") == ["bshd"]
    assert load_recipe(write_recipe(tmp_path, valid_recipe(), name="recipe.yaml")).id == "gemma-4-31b/h100/recipe"


@pytest.mark.parametrize("model", ["Qwen3-32B", "qwen3_32b", "QWEN3.32B"])
def test_an_id_built_from_fields_writes_the_model_and_gpu_as_compared(tmp_path, model):
    data = valid_recipe(model=model, gpu={"type": "h100"})
    assert load_recipe(write_recipe(tmp_path, data, name="My_Recipe.yaml")).id == "qwen3-32b/h100/My_Recipe"


@pytest.mark.parametrize("folders", ["recipes/gemma-4-31b/h100", "recipes/GEMMA_4_31B/H100", "a/b/recipes/gemma-4-31b/h100"])
def test_a_recipe_in_a_recipes_tree_of_its_model_and_gpu_takes_its_path_there(tmp_path, folders):
    (tmp_path / folders).mkdir(parents=True)
    recipe = load_recipe(write_recipe(tmp_path, valid_recipe(), name=f"{folders}/mine.yaml"))
    assert recipe.id == f"{'/'.join(folders.split('/')[-2:])}/mine"


@pytest.mark.parametrize("folders", ["recipes/qwen3-32b/h100", "recipes/gemma-4-31b/h200", "stuff/gemma-4-31b/h100"])
def test_a_recipe_in_a_tree_that_does_not_name_its_model_and_gpu_takes_its_fields(tmp_path, folders):
    """A misplaced file never takes another model's id, nor that model's claims and references."""
    (tmp_path / folders).mkdir(parents=True)
    assert load_recipe(write_recipe(tmp_path, valid_recipe(), name=f"{folders}/mine.yaml")).id == "gemma-4-31b/h100/mine"


@pytest.mark.parametrize(("edit", "message"), [
    (lambda data: data.pop("model"), "missing field model, which its id (<model>/<gpu>/<file name>) is built from"),
    (lambda data: data.pop("gpu"), "missing field gpu.type, which its id (<model>/<gpu>/<file name>) is built from"),
    (lambda data: data.update(gpu={"type": 100}), "field gpu.type must be a name, got 100"),
    (lambda data: data.update(model="Gemma/4"), "its model cannot name a results folder (its id would be 'gemma/4/h100/broken')"),
    (lambda data: data.update(model="", gpu={"type": "H/100"}),
     "its model and gpu.type cannot name a results folder (its id would be '/h/100/broken')"),
])
def test_a_recipe_without_a_model_and_gpu_that_name_a_folder_is_refused_in_one_line(tmp_path, edit, message):
    data = valid_recipe()
    edit(data)
    path = write_recipe(tmp_path, data)
    with pytest.raises(RecipeError) as refused:
        load_recipe(path)
    assert str(refused.value) == f"recipe {path}: {message}"


def test_a_missing_field_is_named_by_its_dotted_path(tmp_path):
    recipe = load_recipe(write_recipe(tmp_path, valid_recipe(layout={"rows_per_microbatch": 1})))
    with pytest.raises(RecipeError, match=r"^recipe gemma-4-31b/h100/broken: missing field layout\.tp$"):
        recipe.tp


def test_a_missing_parent_field_is_named_by_the_full_dotted_path(tmp_path):
    data = valid_recipe()
    del data["workload"]
    with pytest.raises(RecipeError, match=r"^recipe gemma-4-31b/h100/broken: missing field workload\.row_tokens$"):
        load_recipe(write_recipe(tmp_path, data)).row_tokens


def test_malformed_yaml_names_the_file_and_line(tmp_path):
    path = write_recipe(tmp_path, "model: Gemma-4-31B\nlayout:\n  tp: 2\n   pp: 4\n")
    with pytest.raises(RecipeError, match=re.escape(f"recipe {path}: malformed YAML at line 4")):
        load_recipe(path)


def test_a_top_level_that_is_not_a_mapping_is_refused(tmp_path):
    path = write_recipe(tmp_path, "- model: Gemma-4-31B\n- layout: {tp: 2}\n")
    with pytest.raises(RecipeError, match=re.escape(f"recipe {path}: expected a mapping at the top level")):
        load_recipe(path)


def test_a_missing_recipe_file_is_named(tmp_path):
    path = tmp_path / "absent.yaml"
    with pytest.raises(RecipeError, match=re.escape(f"recipe {path}: cannot be read")):
        load_recipe(path)


@pytest.mark.parametrize("tp", [0, -2, "2", True, 1.5])
def test_tp_must_be_a_positive_integer(tmp_path, tp):
    recipe = load_recipe(write_recipe(tmp_path, valid_recipe(layout={"tp": tp, "rows_per_microbatch": 1})))
    with pytest.raises(RecipeError, match=r"^recipe gemma-4-31b/h100/broken: field layout\.tp must be a positive integer, got "):
        recipe.tp


def test_a_run_script_with_an_unbalanced_quote_names_the_recipe(tmp_path):
    recipe = load_recipe(write_recipe(tmp_path, valid_recipe(run='python3 train.py --name "unclosed\n')))
    with pytest.raises(RecipeError, match=r"^recipe gemma-4-31b/h100/broken: field run cannot be split into words"):
        recipe.argument("--name")


def test_a_run_field_that_is_not_a_script_is_refused(tmp_path):
    recipe = load_recipe(write_recipe(tmp_path, valid_recipe(run=["python3", "train.py"])))
    with pytest.raises(RecipeError, match="^recipe gemma-4-31b/h100/broken: field run must be a script, got list$"):
        recipe.argument("--tp")


# Model facts


def test_gemma_has_60_layers_with_every_sixth_global(gemma):
    assert gemma.layers == 60
    kinds = [gemma.layer_kind(layer) for layer in range(60)]
    assert [layer for layer, kind in enumerate(kinds) if kind == "global"] == [
        layer for layer in range(60) if (layer + 1) % 6 == 0
    ]
    assert set(kinds) == {"sliding", "global"}
    assert kinds[-1] == "global"
    assert gemma.layers_of_kind("global") == (5, 11, 17, 23, 29, 35, 41, 47, 53, 59)


def test_nemotron_layer_kinds(nemotron):
    assert nemotron.layers == 88
    assert nemotron.layers_of_kind("attention") == (7, 16, 25, 36, 47, 58, 69, 78)
    assert len(nemotron.layers_of_kind("mamba")) == 40
    assert len(nemotron.layers_of_kind("moe")) == 40


@pytest.mark.parametrize("layer", [-1, 60])
def test_a_layer_outside_the_model_is_refused(gemma, layer):
    with pytest.raises(RecipeError, match=rf"^model facts Gemma-4-31B: layer {layer} outside 0\.\.59$"):
        gemma.layer_kind(layer)


def test_an_unknown_attention_kind_is_refused_naming_the_known_ones(gemma):
    with pytest.raises(RecipeError, match=r"no attention kind 'chunked' \(has \['sliding', 'global'\]\)"):
        gemma.attention_kind("chunked")


def test_an_unknown_model_is_refused_naming_it():
    with pytest.raises(RecipeError, match="^model No-Such-Model: the suite has no model facts for it .*--model-config"):
        load_model("No-Such-Model")


# Attention shapes at the recipe scale


def test_gemma_sliding_attention_at_recipe_scale(gemma_recipe, gemma):
    shape = attention_shape(gemma_recipe, gemma, "sliding", RECIPE_SCALE)
    assert (shape.heads, shape.groups, shape.head_dim) == (16, 8, 256)
    assert shape.window == (1023, 0)
    assert (shape.seq_len, shape.batch, shape.dtype, shape.qkv_format) == (8192, 1, "bf16", "bshd")
    assert shape.softmax_scale == 1.0
    assert shape.causal and (shape.tp_size, shape.tp_rank) == (2, 0)


def test_gemma_global_attention_at_recipe_scale(gemma_recipe, gemma):
    shape = attention_shape(gemma_recipe, gemma, "global", RECIPE_SCALE)
    assert (shape.heads, shape.groups, shape.head_dim) == (16, 2, 512)
    assert shape.window is None
    assert (shape.seq_len, shape.batch, shape.dtype, shape.qkv_format) == (8192, 1, "bf16", "bshd")
    assert shape.softmax_scale == 1.0


def test_recipe_scale_is_the_default(gemma_recipe, gemma):
    assert attention_shape(gemma_recipe, gemma, "sliding") == attention_shape(
        gemma_recipe, gemma, "sliding", RECIPE_SCALE
    )


# Attention shapes at the smoke scale


@pytest.mark.parametrize("kind", ["sliding", "global"])
def test_smoke_scale_keeps_what_can_go_wrong(gemma_recipe, gemma, kind):
    full = attention_shape(gemma_recipe, gemma, kind, RECIPE_SCALE)
    smoke = attention_shape(gemma_recipe, gemma, kind, SMOKE_SCALE)
    assert smoke.head_dim == full.head_dim
    assert smoke.gqa_ratio == full.gqa_ratio
    assert smoke.softmax_scale == full.softmax_scale
    assert smoke.window == full.window
    assert smoke.groups == 2
    assert smoke.window is None or smoke.seq_len > smoke.window[0] + 1
    assert smoke.seq_len < full.seq_len


def test_a_scale_caps_the_groups_at_what_one_rank_has(gemma_recipe, gemma):
    four_groups = Scale(name="four-groups", kv_groups=4, seq_len=2048, rows=1)
    assert attention_shape(gemma_recipe, gemma, "sliding", four_groups).groups == 4  # of 8 at TP 2
    assert attention_shape(gemma_recipe, gemma, "global", four_groups).groups == 2  # all a rank has


def test_smoke_case_ids_are_readable(gemma_recipe, gemma):
    ids = [attention_shape(gemma_recipe, gemma, kind, SMOKE_SCALE).id for kind in ("sliding", "global")]
    assert ids == [
        "gemma4-31b-sliding-s1280-h4-g2-d256-w1024-bf16",
        "gemma4-31b-global-s768-h16-g2-d512-nowin-bf16",
    ]


def test_a_windowed_kind_at_the_smoke_scale_is_its_window_and_some_more(gemma_recipe, gemma):
    sliding = attention_shape(gemma_recipe, gemma, "sliding", SMOKE_SCALE)
    assert sliding.seq_len == sliding.window[0] + 1 + SMOKE_SCALE.past_window
    assert attention_shape(gemma_recipe, gemma, "global", SMOKE_SCALE).seq_len == SMOKE_SCALE.seq_len


def test_case_ids_are_stable_across_loads(gemma):
    first = attention_shape(load_recipe(recipe_path(GEMMA_RECIPE)), gemma, "sliding", SMOKE_SCALE)
    again = attention_shape(load_recipe(recipe_path(GEMMA_RECIPE)), load_model("Gemma-4-31B"), "sliding", SMOKE_SCALE)
    assert first.id == again.id and first == again


def test_a_scale_whose_sequence_is_not_longer_than_the_window_is_refused(gemma_recipe, gemma):
    short = Scale(name="short", kv_groups=2, seq_len=1024, rows=1)
    with pytest.raises(ShapeError, match="^short scale: sequence 1024 is not longer than the sliding window 1024"):
        attention_shape(gemma_recipe, gemma, "sliding", short)


@pytest.mark.parametrize("rank", [2, -1])
def test_a_tp_rank_outside_the_recipe_is_refused(gemma_recipe, gemma, rank):
    with pytest.raises(ShapeError, match=rf"^recipe {GEMMA_RECIPE}: TP rank {rank} outside 0\.\.1$"):
        attention_shape(gemma_recipe, gemma, "sliding", tp_rank=rank)


def test_nemotron_at_tp4_gives_each_rank_one_group(nemotron_recipe, nemotron):
    """2 key-value heads over TP 4: Megatron gives every rank one group and its 8 query heads."""
    shape = attention_shape(nemotron_recipe, nemotron, "attention")
    assert (shape.heads, shape.groups, shape.head_dim, shape.window) == (8, 1, 128, None)
    assert shape.softmax_scale == pytest.approx(128 ** -0.5)
    assert (shape.qkv_format, shape.batch, shape.cu_seqlens) == ("thd", 2, (0, 8192, 16384))


def test_heads_that_do_not_split_over_tp_are_refused(nemotron_recipe, nemotron):
    three_groups = dataclasses.replace(nemotron, data={
        **nemotron.data,
        "attention": {**nemotron.data["attention"],
                      "kinds": {"attention": {**nemotron.data["attention"]["kinds"]["attention"], "kv_heads": 3}}},
    })
    with pytest.raises(ShapeError, match="32 query heads and 3 key-value heads do not split over TP 4"):
        attention_shape(nemotron_recipe, three_groups, "attention")


def test_a_recipe_and_model_that_do_not_match_are_refused(gemma_recipe, nemotron):
    with pytest.raises(ShapeError, match=f"^recipe {GEMMA_RECIPE} is for Gemma-4-31B, not Nemotron"):
        attention_shape(gemma_recipe, nemotron, "attention")
