"""The recipe's own model arguments (its run script's --num-layers, --rotary-base, ...) held equal to
the model facts its levers build shapes from (correctness.model_arguments): a mismatch is refused in
one line naming the flag, both values and where the facts came from; arguments the script hides are
named as unchecked, with the reason."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from correctness.errors import RecipeError
from correctness.fixtures import CONFIGS_DIR, RECIPES_DIR
from correctness.model_arguments import check_model_arguments
from correctness.models import facts_for, load_facts, load_model
from correctness.recipes import load_recipe

LLAMA = RECIPES_DIR / "llama-3.1-8b/h100/example-tp2-pp1-offload05.yaml"
GPT_OSS = RECIPES_DIR / "gpt-oss-20b/h100/example-tp2-ep4-offload06.yaml"
GEMMA = RECIPES_DIR / "gemma-4-31b/h100/attune-tp2-pp4-split13.yaml"
FIXTURE_RECIPES = sorted(RECIPES_DIR.glob("*/*/*.yaml"))
HIDDEN = {"gemma-4-31b", "nemotron-3-super-120b-a12b"}  # their run scripts pass "${MODEL_ARGS[@]}"
MISMATCH = ("recipe mistral-7b/h100/mistral: --rotary-base 10000 in its run script, but the model facts"
            " ({config}) say rope_theta 500000")


def rewritten(source: Path, folder: Path, name: str, *, model: str | None = None, run=lambda run: run) -> Path:
    """A copy of a fixture recipe, its `model:` and run script changed, written as folder/name.yaml."""
    data = yaml.safe_load(source.read_text())
    data["model"] = model or data["model"]
    data["run"] = run(data["run"])
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def mistral_with_llama_config(tmp_path: Path) -> tuple[Path, Path]:
    """Llama-3.1-8B's config in a folder named after Mistral-7B, and a recipe of Mistral-7B whose
    run script says Mistral's --rotary-base 10000 (Llama's example recipe otherwise)."""
    config = tmp_path / "Mistral-7B" / "config.json"
    config.parent.mkdir()
    shutil.copy(CONFIGS_DIR / "Llama-3.1-8B" / "config.json", config)
    recipe = rewritten(LLAMA, tmp_path, "mistral", model="Mistral-7B",
                       run=lambda run: run.replace("--rotary-base 500000", "--rotary-base 10000"))
    return recipe, config


def test_a_rotary_base_the_facts_contradict_is_refused_naming_both(tmp_path):
    recipe_file, config = mistral_with_llama_config(tmp_path)
    recipe = load_recipe(recipe_file)
    with pytest.raises(RecipeError) as refused:
        facts_for(recipe, load_facts(config))
    assert str(refused.value) == MISMATCH.format(config=config)


def test_correctness_run_refuses_the_mismatch_before_any_test(tmp_path):
    recipe_file, config = mistral_with_llama_config(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "correctness.cli", "run", str(recipe_file), "--tier", "cpu", "--model-config",
         str(config.parent), "--results-dir", str(tmp_path / "results")],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and MISMATCH.format(config=config) in done.stderr
    assert not (tmp_path / "results").exists() or not any((tmp_path / "results").rglob("*.json"))


@pytest.mark.parametrize(("flag", "value", "fact"), [
    ("--num-layers 24", "--num-layers 36", "layers 24"),
    ("--window-size 127,0", "--window-size 128,0", "window (127, 0) (Hugging Face's sliding_window 128)"),
    ("--window-attn-skip-freq 2", "--window-attn-skip-freq 3", "window_attn_skip_freq 2"),
    ("--num-query-groups 8", "--num-query-groups 4", "kv_heads 8"),
    ("--kv-channels 64", "--kv-channels 128", "head_dim 64"),
    ("--num-experts 32", "--num-experts 64", "moe.experts 32"),
    ("--moe-router-topk 4", "--moe-router-topk 2", "moe.top_k 4"),
    ("--softmax-type learnable", "--softmax-type vanilla", "attention.sinks learnable"),
    ("--vocab-size 201088", "--vocab-size 201089", "vocab_size 201088"),
])
def test_each_model_argument_is_compared(tmp_path, flag, value, fact):
    recipe = load_recipe(rewritten(GPT_OSS, tmp_path, "changed", run=lambda run: run.replace(flag, value)))
    with pytest.raises(RecipeError, match=f"^recipe .*: {value} in its run script, but the model facts .* say"):
        facts_for(recipe, None)
    with pytest.raises(RecipeError) as refused:
        check_model_arguments(recipe, load_model(recipe.model))
    assert str(refused.value).endswith(f"say {fact}") and "\n" not in str(refused.value)


@pytest.mark.parametrize("path", FIXTURE_RECIPES, ids=lambda path: path.parent.parent.name)
def test_every_fixture_recipe_agrees_with_its_facts_and_names_what_it_checked(path):
    recipe = load_recipe(path)
    model = facts_for(recipe, None)
    ref = recipe.ref_for(model)
    if path.parent.parent.name in HIDDEN:
        assert ref.model_arguments_checked == ()
        assert "${MODEL_ARGS[@]}" in ref.model_arguments_unchecked
    else:
        assert {"--num-layers", "--hidden-size", "--num-attention-heads", "--vocab-size"} <= set(ref.model_arguments_checked)
        assert ref.model_arguments_unchecked is None


def test_the_gemma_seed_says_its_model_arguments_are_unchecked_and_why():
    recipe = load_recipe(GEMMA)
    ref = recipe.ref_for(facts_for(recipe, None))
    assert ref.model_arguments_unchecked == (
        "the run script passes \"${MODEL_ARGS[@]}\", whose arguments it does not show")


def test_a_bridge_recipe_without_model_flags_says_the_bridge_builds_the_model(tmp_path):
    def without_model_flags(run: str) -> str:
        kept = [line for line in run.splitlines() if "MODEL_ARGS" not in line]
        return "\n".join(kept)

    recipe = load_recipe(rewritten(GEMMA, tmp_path, "bridge", run=without_model_flags))
    ref = recipe.ref_for(facts_for(recipe, None))
    assert ref.model_arguments_checked == ()
    assert "--megatron-to-hf-mode bridge" in ref.model_arguments_unchecked


def test_the_check_runs_once_per_recipe_and_facts(monkeypatch):
    import correctness.model_arguments as model_arguments

    calls = []
    original = model_arguments.compared_arguments
    monkeypatch.setattr(model_arguments, "compared_arguments", lambda *a: calls.append(a) or original(*a))
    recipe = load_recipe(LLAMA)
    model = facts_for(recipe, None)
    recipe.ref_for(model), recipe.ref_for(model), facts_for(recipe, model)
    assert len(calls) == 1
