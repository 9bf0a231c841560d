"""A recipe agrees with itself (correctness.recipe_arguments): each structured field that its run
script also gives (layout.tp and --tensor-model-parallel-size, ...) holds the same value, its GPUs
are the script's, and no flag is given twice with different values. A disagreement is refused in
one line, exit 2, by run, check and attach (the recipe untouched) and by pytest's --recipe."""

import subprocess
import sys

import pytest

from correctness import cli
from correctness.errors import RecipeError
from correctness.fixtures import COMPONENT_TESTS_DIR, RECIPES_DIR, recipe_path
from correctness.recipe_arguments import AGREEMENTS, first_disagreement
from correctness.recipes import load_recipe, training_arguments, validate_recipe

LLAMA = "llama-3.1-8b/h100/example-tp2-pp1-offload05"
MOONLIGHT = "moonlight-16b-a3b/h100/example-tp2-ep4-offload07"
FIXTURE_RECIPES = sorted(str(path.relative_to(RECIPES_DIR).with_suffix("")) for path in RECIPES_DIR.glob("*/*/*.yaml"))


def edited(tmp_path, source: str, *replacements: tuple[str, str], name: str = "edited.yaml"):
    """The fixture recipe's text with each (old, new) replaced once, written to tmp_path/name."""
    text = recipe_path(source).read_text()
    for old, new in replacements:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    path = tmp_path / name
    path.write_text(text)
    return path


def refusal(path) -> str:
    recipe = load_recipe(path)
    with pytest.raises(RecipeError) as refused:
        validate_recipe(recipe.data, recipe.id)
    return str(refused.value)


@pytest.mark.parametrize("recipe_id", FIXTURE_RECIPES)
def test_every_fixture_recipe_agrees_with_its_run_script(recipe_id):
    recipe = load_recipe(recipe_path(recipe_id))
    validate_recipe(recipe.data, recipe.id)
    assert first_disagreement(recipe.data, recipe.arguments, recipe.id) is None


def test_the_table_pairs_each_flag_once_and_says_its_default():
    flags = [pair.flag for pair in AGREEMENTS]
    assert len(flags) == len(set(flags))
    assert all(pair.default for pair in AGREEMENTS)


ID = "llama-3-1-8b/h100/edited"  # name_key of the model: outside the fixtures tree
DISAGREEMENTS = [
    (LLAMA, [("  --tensor-model-parallel-size 2 \\", "  --tensor-model-parallel-size 4 \\")],
     f"recipe {ID}: layout.tp is 2, but its run script gives --tensor-model-parallel-size 4"),
    (LLAMA, [("  --pipeline-model-parallel-size 1 \\", "  --pipeline-model-parallel-size 2 \\")],
     f"recipe {ID}: layout.pp is 1, but its run script gives --pipeline-model-parallel-size 2"),
    (LLAMA, [("  --context-parallel-size 1 \\", "  --context-parallel-size 2 \\")],
     f"recipe {ID}: layout.cp is 1, but its run script gives --context-parallel-size 2"),
    (LLAMA, [("  sequence_parallel: true", "  sequence_parallel: false")],
     f"recipe {ID}: layout.sequence_parallel is false, but its run script gives --sequence-parallel"),
    (LLAMA, [("  --optimizer-offload-fraction 0.5 \\", "  --optimizer-offload-fraction 0.9 \\")],
     f"recipe {ID}: layout.offload.optimizer_fraction is 0.5, but its run script gives"
     " --optimizer-offload-fraction 0.9"),
    (LLAMA, [("  precision: bf16", "  precision: fp16")],
     f"recipe {ID}: workload.precision is fp16, but its run script gives --bf16"),
    (LLAMA, [("  --micro-batch-size 1 \\", "  --micro-batch-size 1 --seq-length 4096 \\")],
     f"recipe {ID}: workload.row_tokens is 8192, but its run script gives --seq-length 4096, shorter than a row"),
    (LLAMA, [("  --global-batch-size 128 \\", "  --global-batch-size 256 \\")],
     f"recipe {ID}: workload.global_batch is 128, but its run script gives --global-batch-size 256"),
    (LLAMA, [("  --micro-batch-size 1 \\", "  --micro-batch-size 2 \\")],
     f"recipe {ID}: layout.rows_per_microbatch is 1, but its run script gives --micro-batch-size 2"),
    (LLAMA, [("  --micro-batch-size 1 \\", "  --micro-batch-size 1 --decoder-first-pipeline-num-layers 8 \\")],
     f"recipe {ID}: layout.layer_split.first is null (Megatron's even split), but its run script gives"
     " --decoder-first-pipeline-num-layers 8"),
    (LLAMA, [("  --micro-batch-size 1 \\", "  --micro-batch-size 1 --recompute-granularity full \\")],
     f"recipe {ID}: layout.recompute.granularity is null (no recompute), but its run script gives"
     " --recompute-granularity full"),
    (LLAMA, [("  dp: 4\n", "  dp: 2\n")],
     f"recipe {ID}: layout.tp x pp x cp x dp is 4 GPUs, but its run script gives --actor-num-nodes 1"
     " --actor-num-gpus-per-node 8 (8 GPUs)"),
    (LLAMA, [("  count: 8\n", "  count: 4\n")],
     f"recipe {ID}: layout.tp x pp x cp x dp is 8 GPUs, more than its gpu.count 4"),
    (LLAMA, [("  --tensor-model-parallel-size 2 \\", "  --tensor-model-parallel-size two \\")],
     f"recipe {ID}: --tensor-model-parallel-size two in its run script is malformed: it takes one integer"
     " (as layout.tp)"),
    (LLAMA, [("  --sequence-parallel \\", "  --sequence-parallel \\\n    --tensor-model-parallel-size 4 \\")],
     f"recipe {ID}: its run script gives --tensor-model-parallel-size 2 times with different values ('2', then"
     " '4'); Megatron's parser would take the last one silently: give it once"),
    (MOONLIGHT, [("  --expert-model-parallel-size 4 \\", "  --expert-model-parallel-size 8 \\")],
     "recipe moonlight-16b-a3b/h100/edited: layout.ep is 4, but its run script gives --expert-model-parallel-size 8"),
    (MOONLIGHT, [("  --expert-tensor-parallel-size 1 \\", "  --expert-tensor-parallel-size 2 \\")],
     "recipe moonlight-16b-a3b/h100/edited: layout.etp is 1, but its run script gives --expert-tensor-parallel-size 2"),
    (MOONLIGHT, [("  dispatcher: alltoall", "  dispatcher: allgather")],
     "recipe moonlight-16b-a3b/h100/edited: layout.dispatcher is allgather, but its run script gives"
     " --moe-token-dispatcher-type alltoall"),
]


@pytest.mark.parametrize("source, replacements, message", DISAGREEMENTS,
                         ids=[message.split(": ", 1)[1][:40] for _, _, message in DISAGREEMENTS])
def test_a_field_its_run_script_contradicts_is_refused_in_one_line(tmp_path, source, replacements, message):
    assert refusal(edited(tmp_path, source, *replacements)) == message


@pytest.mark.parametrize("replacements", [
    [("  --context-parallel-size 1 \\\n", "")],  # a flag not given is not compared with its field
    [("  --sequence-parallel \\", "  --sequence-parallel --sequence-parallel \\")],  # the same switch twice
    [("  --tensor-model-parallel-size 2 \\", "  --tensor-model-parallel-size 2 --tensor-model-parallel-size 2 \\")],
    [("  --micro-batch-size 1 \\", "  --micro-batch-size 1 --seq-length 16384 \\")],  # longer than a row fits it
    [("  --bf16 \\", "  --bf16 --fp8-format hybrid \\"), ("  precision: bf16", "  precision: fp8")],
])
def test_what_the_script_leaves_unsaid_or_says_alike_is_accepted(tmp_path, replacements):
    recipe = load_recipe(edited(tmp_path, LLAMA, *replacements))
    validate_recipe(recipe.data, recipe.id)


def test_miles_max_tokens_per_gpu_is_compared_only_with_dynamic_batching():
    """The Gemma seed gives --max-tokens-per-gpu 512 without dynamic batching (where miles does not
    read it) beside layout.max_tokens_per_gpu null; Nemotron's 16,384 with it agrees."""
    gemma = load_recipe(recipe_path("gemma-4-31b/h100/attune-tp2-pp4-split13"))
    assert gemma.argument("--max-tokens-per-gpu") == ["512"] and gemma.field("layout.max_tokens_per_gpu") is None
    data = {"layout": {"max_tokens_per_gpu": 8192}}
    arguments = training_arguments("python3 train.py --use-dynamic-batch-size --max-tokens-per-gpu 16384\n")
    assert first_disagreement(data, arguments, "r") == ("recipe r: layout.max_tokens_per_gpu is 8192, but its run"
                                                        " script gives --max-tokens-per-gpu 16384")


# The commands: exit 2, one line, nothing written


def call(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main([str(arg) for arg in argv])
    out, err = capsys.readouterr()
    return code, out, err


TP4 = [("  --tensor-model-parallel-size 2 \\", "  --tensor-model-parallel-size 4 \\")]
TP_MESSAGE = "layout.tp is 2, but its run script gives --tensor-model-parallel-size 4"


def test_check_refuses_a_recipe_that_contradicts_itself(tmp_path, capsys):
    path = edited(tmp_path, LLAMA, *TP4)
    code, out, err = call(capsys, "check", path)
    assert (code, out) == (2, "") and err.count("\n") == 1 and TP_MESSAGE in err, err


def test_run_refuses_it_before_any_test(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(pytest, "main", lambda *args, **kwargs: pytest.fail("pytest started"))
    path = edited(tmp_path, LLAMA, *TP4)
    code, out, err = call(capsys, "run", path, "--tier", "cpu", "--results-dir", tmp_path / "results")
    assert (code, out) == (2, "") and err.count("\n") == 1 and TP_MESSAGE in err, err
    assert not (tmp_path / "results").exists()


def test_attach_refuses_it_and_leaves_the_recipe_untouched(tmp_path, capsys):
    path = edited(tmp_path, LLAMA, *TP4)
    before = path.read_bytes()
    code, out, err = call(capsys, "attach", tmp_path / "record.json", path)
    assert (code, out) == (2, "") and err.count("\n") == 1 and TP_MESSAGE in err, err
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["edited.yaml"]


def test_pytests_recipe_option_refuses_it(tmp_path):
    path = edited(tmp_path, LLAMA, *TP4)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--collect-only",
         str(COMPONENT_TESTS_DIR / "test_rope_fusion.py"), "--recipe", str(path)],
        capture_output=True, text=True, timeout=300, cwd=COMPONENT_TESTS_DIR.parent)
    assert done.returncode != 0 and TP_MESSAGE in done.stderr + done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
