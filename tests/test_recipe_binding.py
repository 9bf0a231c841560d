"""A record is for one recipe: it carries the values of the recipe arguments its lever reads, attaches
only to a recipe with the same ones, and lies in a folder of its recipe's own."""

import importlib
import json
import shutil
from pathlib import Path

import pytest

from correctness import recipes
from correctness.attach import attach
from correctness.errors import CorrectnessError
from correctness.fixtures import COMPONENT_TESTS_DIR, RECIPES_DIR, recipe_path
from correctness.harness import run_lever
from correctness.lever import LeverOptions, NotApplicable
from correctness.results import RecipeRef
from correctness.optimizer import lever as offload
from correctness.recheck import arguments_sha256
from correctness.recipes import load_recipe
from correctness.registry import KNOWN_LEVERS
from correctness.results import read_record, record_path, write_record

GEMMA = "gemma-4-31b/h100/attune-tp2-pp4-split13"
FIXTURE_RECIPES = sorted(str(path.relative_to(RECIPES_DIR).with_suffix("")) for path in RECIPES_DIR.glob("*/*/*.yaml"))
# Read by every factory through the model facts' check of the recipe's model arguments: they reach a
# record through its model facts' sha256, not through its lever's reads.
MODEL_ARGUMENTS = "correctness.model_arguments"


def component_test_factories():
    """(lever name, factory) of every component test's `levers` marker."""
    factories = []
    for path in sorted(COMPONENT_TESTS_DIR.glob("test_*.py")):
        module = importlib.import_module(f"component_tests.{path.stem}")
        for function in vars(module).values():
            for marker in getattr(function, "pytestmark", []):
                if marker.name == "levers":
                    names = marker.kwargs["lever"]
                    factories.append(((names,) if isinstance(names, str) else tuple(names), marker.kwargs["factory"]))
    return factories


def model_argument_flags() -> set[str]:
    try:
        module = importlib.import_module(MODEL_ARGUMENTS)
    except ImportError:
        return set()
    return set(getattr(module, "CHECKED_FLAGS", ()))


@pytest.mark.parametrize("recipe_id", [None, *FIXTURE_RECIPES])
def test_every_factory_reads_only_what_its_lever_declares(recipe_id, monkeypatch):
    """Each factory is run with Recipe.field and Recipe.argument watched, on its own fixture recipes
    and on each fixture recipe given as --recipe."""
    read: set[str] = set()
    field, argument = recipes.Recipe.field, recipes.Recipe.argument
    monkeypatch.setattr(recipes.Recipe, "field", lambda self, dotted: read.add(dotted) or field(self, dotted))
    monkeypatch.setattr(recipes.Recipe, "argument", lambda self, flag: read.add(flag) or argument(self, flag))
    options = LeverOptions(recipe=load_recipe(recipe_path(recipe_id))) if recipe_id else LeverOptions()
    ignored = {"run"} | model_argument_flags()  # `run` is what every flag is read from
    checked = 0
    for names, factory in component_test_factories():
        read.clear()
        try:
            factory(options)
        except NotApplicable:
            pass
        declared = set().union(*(KNOWN_LEVERS[name].reads for name in names))
        assert read - ignored <= declared, f"{names} read {sorted(read - ignored - declared)}, undeclared"
        checked += 1
    assert checked >= 17


@pytest.fixture(scope="module")
def offload_record(tmp_path_factory):
    """The offload lever's CPU record on the Gemma seed (fraction 0.8)."""
    (lever,) = offload.cpu_tier(GEMMA, LeverOptions())
    return write_record(run_lever(lever), tmp_path_factory.mktemp("records"))


# A flag whose recipe field must say the same (correctness.recipe_arguments): edited with it.
FIELDS_OF = {"--optimizer-offload-fraction 0.8": "optimizer_fraction: 0.8"}


def recipe_variant(tmp_path: Path, old: str, new: str) -> Path:
    path = tmp_path / "attune-tp2-pp4-split13.yaml"
    text = recipe_path(GEMMA).read_text()
    assert old in text
    text = text.replace(old, new)
    if old in FIELDS_OF:
        field = FIELDS_OF[old]
        text = text.replace(field, field.replace(old.split()[-1], new.split()[-1]))
    path.write_text(text)
    return path


def test_a_record_carries_the_arguments_its_lever_read(offload_record):
    data = read_record(offload_record)
    arguments = data["recipe"]["arguments"]
    assert set(arguments) == set(KNOWN_LEVERS[offload.NAME].reads)
    assert arguments["--optimizer-offload-fraction"] == ["0.8"] and arguments["--optimizer-cpu-offload"] == []
    assert arguments["layout.tp"] == 2 and arguments["--clip-grad"] is None
    assert data["recipe"]["arguments_sha256"] == arguments_sha256(arguments)
    assert data["recipe"]["path"] == str(recipe_path(GEMMA).resolve())


@pytest.mark.parametrize(("old", "new", "message"), [
    ("--optimizer-offload-fraction 0.8", "--optimizer-offload-fraction 0.5",
     "--optimizer-offload-fraction 0.8, the recipe has 0.5"),
    ("  --optimizer-cpu-offload \\\n", "",
     "--optimizer-cpu-offload \\(switch\\), the recipe has \\(not set\\)"),
    ("--adam-beta2 0.98", "--adam-beta2 0.95", "--adam-beta2 0.98, the recipe has 0.95"),
])
def test_a_record_of_other_arguments_is_refused_naming_them(offload_record, tmp_path, old, new, message):
    target = recipe_variant(tmp_path, old, new)
    before = target.read_bytes()
    with pytest.raises(CorrectnessError, match=f"with other arguments than this recipe's: .*{message}"):
        attach(target, [offload_record])
    assert target.read_bytes() == before


def test_a_record_with_the_same_arguments_attaches_to_a_copy_of_its_recipe(offload_record, tmp_path):
    copy = tmp_path / "copy.yaml"
    shutil.copy(recipe_path(GEMMA), copy)
    assert [done.result for done in attach(copy, [offload_record])] == ["pass"]


def test_arguments_edited_to_match_another_recipe_contradict_their_sha256(offload_record, tmp_path):
    data = json.loads(offload_record.read_text())
    data["recipe"]["arguments"]["--optimizer-offload-fraction"] = ["0.5"]
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(data))
    target = recipe_variant(tmp_path, "--optimizer-offload-fraction 0.8", "--optimizer-offload-fraction 0.5")
    with pytest.raises(CorrectnessError, match="field recipe.arguments_sha256 says"):
        attach(target, [edited])


def test_two_recipes_with_one_file_name_never_share_a_folder(tmp_path):
    def folder(path):
        ref = RecipeRef(id="llama-3-1-8b/h100/my-recipe", model="Llama-3.1-8B", gpu="H100", sha256="0" * 64,
                        path=str(path))
        data = {"recipe": {**ref.__dict__}, "lever": {"record_id": "x--cpu--y"}}
        return record_path(data, tmp_path / "results").parent

    first, second = folder(tmp_path / "a" / "my-recipe.yaml"), folder(tmp_path / "b" / "my-recipe.yaml")
    assert first != second and first.parent == second.parent
    assert first.name.startswith("my-recipe.") and len(first.name) == len("my-recipe.") + 8


def test_a_fixture_recipes_folder_is_the_same_on_every_clone():
    """Keyed by its path below the checkout, not where the checkout lies."""
    ref = load_recipe(recipe_path(GEMMA)).ref
    data = {"recipe": {**ref.__dict__}, "lever": {"record_id": "x--cpu--y"}}
    folder = record_path(data, Path("results")).parent
    assert folder.as_posix().startswith("results/gemma-4-31b/h100/attune-tp2-pp4-split13.")
    import hashlib
    expected = hashlib.sha256(f"fixtures/recipes/{GEMMA}.yaml".encode()).hexdigest()[:8]
    assert folder.name.endswith(f".{expected}")


def test_attach_takes_the_recipes_own_records_from_any_folder(offload_record, tmp_path, monkeypatch, capsys):
    from correctness.cli import main

    results = tmp_path / "results"
    written = write_record(read_record(offload_record), results)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    code = main(["attach", str(recipe_path(GEMMA)), "--results-dir", str(results), "--dry-run", "--json"])
    assert code == 0
    assert [entry["result"] for entry in json.loads(capsys.readouterr().out)["entries"]] == ["pass"]
    written.rename(written.with_name("elsewhere.json.bak"))
    assert main(["attach", str(recipe_path(GEMMA)), "--results-dir", str(results), "--dry-run"]) == 2
    assert "no records in" in capsys.readouterr().err
