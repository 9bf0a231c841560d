"""`correctness classify`: classing a tuned recipe's training arguments against its reference's."""

import json
from importlib import resources
from pathlib import Path

import pytest
import yaml

from correctness import cli
from correctness.registry import KNOWN_LEVERS
from correctness.classify import (
    CLASSES,
    RulesError,
    classify,
    classify_recipe,
    default_rules,
    load_reference,
    load_rules,
    parse_rules,
    reference_path,
)
from correctness.errors import RecipeError
from correctness.fixtures import recipe_path
from correctness.recipes import Recipe, load_recipe, training_arguments

GEMMA = "gemma-4-31b/h100/attune-tp2-pp4-split13"
NEMOTRON = "nemotron-3-super-120b-a12b/h200/attune-tp4-pp2-ep8-mt16k"
SEEDS = (GEMMA, NEMOTRON)


def changes_by_flag(classification):
    return {change.flag: change for change in classification.changes}


def copy_recipe(tmp_path, recipe_id, edit_run=None, edit_data=None, name="candidate.yaml"):
    """A copy of a seed recipe in tmp_path, its run script and data edited."""
    data = yaml.safe_load(recipe_path(recipe_id).read_text())
    if edit_run is not None:
        data["run"] = edit_run(data["run"])
    if edit_data is not None:
        edit_data(data)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def classify_copy(path, recipe_id):
    return classify(load_recipe(path), load_reference(reference_path(load_recipe(recipe_path(recipe_id)))))


def replace_once(old, new):
    def edit(run):
        assert run.count(old) == 1, old
        return run.replace(old, new)
    return edit


@pytest.fixture
def run_cli(monkeypatch, capsys):
    """cli.main with only this command registered (the others are separate modules)."""
    monkeypatch.setattr(cli, "COMMANDS", {"classify": cli.COMMANDS["classify"]})

    def run(*argv):
        code = cli.main(["classify", *map(str, argv)])
        out, err = capsys.readouterr()
        return code, out, err
    return run


# --- the seeds -------------------------------------------------------------------------------------

def test_gemma_seed_passes_with_both_levers_covered():
    result = classify_recipe(load_recipe(recipe_path(GEMMA)))
    changes = changes_by_flag(result)
    assert set(changes) == {
        "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--decoder-first-pipeline-num-layers",
        "--decoder-last-pipeline-num-layers", "--attention-backend", "--optimizer-offload-fraction",
    }
    attention, offload = changes["--attention-backend"], changes["--optimizer-offload-fraction"]
    assert (attention.reference_values, attention.candidate_values) == (("unfused",), ("auto",))
    assert (attention.klass, attention.levers, attention.result_of("attention-backend")) == (
        "numerics", ("attention-backend",), "pass")
    assert (offload.reference_values, offload.default, offload.candidate_values) == (None, ("1.0",), ("0.8",))
    assert (offload.klass, offload.levers, offload.result_of("optimizer-offload")) == (
        "numerics", ("optimizer-offload",), "pass")
    assert offload.kind == "added"
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                 "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"):
        assert changes[flag].klass == "placement"
    assert changes["--tensor-model-parallel-size"].reference_values == ("4",)
    assert result.verdict == "pass"


def test_nemotron_seed_is_incomplete_for_want_of_an_offload_result():
    result = classify_recipe(load_recipe(recipe_path(NEMOTRON)))
    changes = changes_by_flag(result)
    assert set(changes) == {
        "--recompute-granularity", "--recompute-modules", "--recompute-method", "--recompute-num-layers",
        "--max-tokens-per-gpu", "--optimizer-offload-fraction",
    }
    for flag in ("--recompute-granularity", "--recompute-modules", "--recompute-method", "--recompute-num-layers"):
        assert changes[flag].klass == "placement"
    assert changes["--recompute-method"].kind == "removed"
    packing = changes["--max-tokens-per-gpu"]
    assert (packing.klass, packing.levers, packing.outcome) == ("numerics", ("thd-packing", "packed-loss"), "missing")
    assert packing.reference_values == ("1024",)
    offload = changes["--optimizer-offload-fraction"]
    assert (offload.klass, offload.levers, offload.result_of("optimizer-offload"), offload.outcome) == (
        "numerics", ("optimizer-offload",), None, "missing")
    assert result.verdict == "incomplete"


@pytest.mark.parametrize("recipe_id, code, verdict", [(GEMMA, 0, "PASS"), (NEMOTRON, 1, "INCOMPLETE")])
def test_cli_on_the_seeds(run_cli, recipe_id, code, verdict):
    status, out, err = run_cli(recipe_path(recipe_id))
    assert status == code and err == ""
    assert f"configuration {verdict}" in out.splitlines()[0]
    assert "--optimizer-offload-fraction" in out and "(default 1.0)" in out


def test_cli_json(run_cli):
    status, out, _ = run_cli("--json", recipe_path(NEMOTRON))
    data = json.loads(out)
    assert status == 1 and data["verdict"] == "incomplete" and data["recipe"] == NEMOTRON
    offload = next(c for c in data["changes"] if c["flag"] == "--optimizer-offload-fraction")
    assert offload == {
        "flag": "--optimizer-offload-fraction", "kind": "added", "reference": None, "candidate": ["0.55"],
        "default": ["1.0"], "class": "numerics", "reason": offload["reason"], "levers": ["optimizer-offload"],
        "lever_results": {"optimizer-offload": None}, "convergence_passes": True, "outcome": "missing",
        "notes": [],
    }
    assert data["counts"] == {"placement": 4, "numerics": 2, "batching": 0, "must-match": 0, "inert": 0, "unknown": 0}


@pytest.mark.parametrize("recipe_id", SEEDS)
def test_reference_files_are_the_candidate_but_for_the_classified_flags(recipe_id):
    """Each reference file parses to a train.py command with the seed's model-args expansion and data."""
    arguments = load_reference(reference_path(load_recipe(recipe_path(recipe_id))))
    assert arguments["--global-batch-size"] == [["128"]] and arguments["--lr"] == [["1e-5"]]
    assert "--optimizer-offload-fraction" not in arguments and arguments["--optimizer-cpu-offload"] == [[]]


# --- argument parsing and comparison ---------------------------------------------------------------

def test_repeated_flag_counts_by_its_last_occurrence(tmp_path):
    same = copy_recipe(tmp_path, GEMMA, replace_once("--attention-backend auto", "--attention-backend auto "
                                                     "--attention-backend unfused"), name="same.yaml")
    result = classify_copy(same, GEMMA)
    assert "--attention-backend" not in changes_by_flag(result)
    changed = copy_recipe(tmp_path, GEMMA, replace_once("--lr 1e-5", "--lr 1e-5 --lr 2e-5"))
    lr = changes_by_flag(classify_copy(changed, GEMMA))["--lr"]
    assert (lr.reference_values, lr.candidate_values) == (("1e-5",), ("2e-5",))
    assert lr.notes == ("given 2 times in the candidate (1e-5; 2e-5): the last counts",)


def test_multi_value_flags(tmp_path):
    reordered = copy_recipe(tmp_path, GEMMA, replace_once("core_attn mlp", "mlp core_attn"), name="reordered.yaml")
    assert "--recompute-modules" not in changes_by_flag(classify_copy(reordered, GEMMA))  # a set of modules
    fewer = copy_recipe(tmp_path, GEMMA, replace_once("core_attn mlp", "core_attn"), name="fewer.yaml")
    modules = changes_by_flag(classify_copy(fewer, GEMMA))["--recompute-modules"]
    assert (modules.reference_values, modules.candidate_values, modules.klass) == (
        ("core_attn", "mlp"), ("core_attn",), "placement")


def test_ordered_multi_value_flag_compares_in_order():
    run = "python3 train.py --lr 1e-5 --custom-list a b \\\n  --other"
    candidate_run = "python3 train.py --lr 0.00001 --custom-list b a --other"
    assert training_arguments(run)["--custom-list"] == [["a", "b"]]
    recipe = _recipe_with_run(candidate_run)
    changes = changes_by_flag(classify(recipe, training_arguments(run)))
    assert set(changes) == {"--custom-list"}  # 0.00001 == 1e-5; the switch --other is on in both
    assert changes["--custom-list"].candidate_values == ("b", "a")


def test_explicit_default_is_no_change(tmp_path):
    path = copy_recipe(tmp_path, GEMMA, replace_once("--optimizer-offload-fraction 0.8",
                                                     "--optimizer-offload-fraction 1"))
    assert "--optimizer-offload-fraction" not in changes_by_flag(classify_copy(path, GEMMA))


def test_added_and_removed_flags(tmp_path):
    path = copy_recipe(tmp_path, GEMMA, replace_once("--distributed-timeout-minutes 30", "--use-distributed-optimizer"))
    changes = changes_by_flag(classify_copy(path, GEMMA))
    added, removed = changes["--use-distributed-optimizer"], changes["--distributed-timeout-minutes"]
    assert (added.kind, added.reference_values, added.candidate_values, added.klass) == ("added", None, (), "placement")
    assert (removed.kind, removed.reference_values, removed.candidate_values, removed.klass) == (
        "removed", ("30",), None, "inert")


def test_unknown_flag_needs_review(tmp_path, run_cli):
    path = copy_recipe(tmp_path, GEMMA, replace_once("--qkv-format bshd", "--qkv-format bshd --new-kernel-knob 3"))
    result = classify_copy(path, GEMMA)
    unknown = changes_by_flag(result)["--new-kernel-knob"]
    assert (unknown.klass, unknown.outcome) == ("unknown", "review")
    assert result.verdict == "incomplete"
    status, out, _ = run_cli(path, "--reference", reference_path(load_recipe(recipe_path(GEMMA))))
    assert status == 1 and "--new-kernel-knob: needs review (not classed by the rules file)" in out


@pytest.mark.parametrize("converged", [True, False])
def test_numerics_change_without_a_lever_needs_a_passing_convergence_block(tmp_path, converged):
    """Its evidence is a convergence run: covered with the recipe's passing block, else for review."""
    def convergence(data):
        data["correctness"]["convergence"]["result"] = "pass" if converged else "fail"

    path = copy_recipe(tmp_path, GEMMA, replace_once("--attention-softmax-in-fp32 ", ""), edit_data=convergence)
    data = yaml.safe_load(resources.files("correctness.rules").joinpath("arguments.yaml").read_text())
    del data["arguments"]["--attention-softmax-in-fp32"]["lever"]  # as for an argument no lever covers yet
    rules = parse_rules(data, "rules without the softmax lever's argument")
    recipe = load_recipe(path)
    assert recipe.data["correctness"]["convergence"]["result"] == ("pass" if converged else "fail")
    result = classify(recipe, load_reference(reference_path(load_recipe(recipe_path(GEMMA)))), rules)
    change = changes_by_flag(result)["--attention-softmax-in-fp32"]
    assert (change.klass, change.levers, change.outcome) == ("numerics", (), "covered" if converged else "review")


def test_numerics_change_whose_lever_has_no_result_is_missing(tmp_path):
    path = copy_recipe(tmp_path, GEMMA, replace_once("--attention-softmax-in-fp32 ", ""))
    change = changes_by_flag(classify_copy(path, GEMMA))["--attention-softmax-in-fp32"]
    assert (change.klass, change.levers, change.outcome) == ("numerics", ("attention-softmax-precision",), "missing")


def test_must_match_change_fails(tmp_path, run_cli):
    path = copy_recipe(tmp_path, GEMMA, replace_once("--lr 1e-5", "--lr 2e-5"))
    result = classify_copy(path, GEMMA)
    lr = changes_by_flag(result)["--lr"]
    assert (lr.klass, lr.outcome) == ("must-match", "error")
    assert result.verdict == "fail"
    status, out, _ = run_cli(path, "--reference", reference_path(load_recipe(recipe_path(GEMMA))))
    assert status == 1 and "configuration FAIL" in out and "--lr: must match the reference" in out


# --- lever results -------------------------------------------------------------------------------

def _set_component_tests(entries):
    def edit(data):
        data["correctness"]["component_tests"] = entries
    return edit


def _entry(test, result, lever=None):
    entry = {"test": test, "shape": "s", "gpu": "H200", "date": "2026-10-22", "result": result, "detail": "d"}
    return entry | ({"lever": lever} if lever else {})


@pytest.mark.parametrize("entry, verdict", [
    (_entry("a run of the suite", "pass", lever="optimizer-offload"), "pass"),
    (_entry("a run of the suite", "fail", lever="optimizer-offload"), "fail"),
    (_entry("CPU optimizer offload fraction 0.55 against fraction 1.0 and an FP64 reference", "pass"), "pass"),
    (_entry("CPU optimizer offload fraction 0.55 against fraction 1.0 and an FP64 reference", "fail"), "fail"),
    # a lever: key is authoritative: this title mentions the offload but the entry is the attention lever's
    (_entry("optimizer offload next to attention", "pass", lever="attention-backend"), "incomplete"),
    (_entry("TE's auto attention backend against its unfused attention", "pass"), "incomplete"),
])
def test_lever_result_by_key_or_title(tmp_path, entry, verdict):
    packing = _entry("eager attention over two packed rows (THD) against the same rows one at a time", "pass")
    loss = _entry("the per-token loss summed over packed rows against the same sum row by row", "pass")
    path = copy_recipe(tmp_path, NEMOTRON, edit_data=_set_component_tests([entry, packing, loss]))
    result = classify_copy(path, NEMOTRON)
    assert result.verdict == verdict
    expected = entry["result"] if verdict != "incomplete" else None
    assert changes_by_flag(result)["--optimizer-offload-fraction"].result_of("optimizer-offload") == expected


def test_a_failing_entry_wins_over_a_passing_one(tmp_path):
    entries = [_entry("optimizer offload fraction 0.55", "pass"), _entry("x", "fail", lever="optimizer-offload")]
    path = copy_recipe(tmp_path, NEMOTRON, edit_data=_set_component_tests(entries))
    assert classify_copy(path, NEMOTRON).lever_results == {"optimizer-offload": "fail"}


@pytest.mark.parametrize("result, outcome, verdict", [
    ("incomplete", "missing", "incomplete"),  # a required case did not run: not covered
    ("no kernel change", "covered", "pass"),  # the reference's own kernel ran, bitwise identical
])
def test_incomplete_is_not_covered_and_no_kernel_change_is(tmp_path, result, outcome, verdict):
    entries = [_entry("x", result, lever="optimizer-offload"),
               _entry("eager attention over two packed rows (THD) against the same rows one at a time", "pass"),
               _entry("the per-token loss summed over packed rows against the same sum row by row", "pass")]
    path = copy_recipe(tmp_path, NEMOTRON, edit_data=_set_component_tests(entries))
    classified = classify_copy(path, NEMOTRON)
    offload = changes_by_flag(classified)["--optimizer-offload-fraction"]
    assert (offload.result_of("optimizer-offload"), offload.outcome, classified.verdict) == (result, outcome, verdict)


def test_an_incomplete_entry_wins_over_a_passing_one_and_a_failing_one_over_both(tmp_path):
    entries = [_entry("x", "pass", lever="optimizer-offload"), _entry("y", "incomplete", lever="optimizer-offload")]
    path = copy_recipe(tmp_path, NEMOTRON, edit_data=_set_component_tests(entries))
    assert classify_copy(path, NEMOTRON).lever_results == {"optimizer-offload": "incomplete"}
    path = copy_recipe(tmp_path, NEMOTRON, edit_data=_set_component_tests(entries + [_entry("z", "fail", lever="optimizer-offload")]))
    assert classify_copy(path, NEMOTRON).lever_results == {"optimizer-offload": "fail"}


def test_gemma_prose_entries_match_by_title():
    recipe = load_recipe(recipe_path(GEMMA))
    rules = default_rules()
    titles = [entry["test"] for entry in recipe.field("correctness.component_tests")]
    assert [[name for name, lever in rules.levers.items() if lever.matches(t)] for t in titles] == [
        ["attention-backend"], ["optimizer-offload"]]


# --- the rules file ------------------------------------------------------------------------------

def test_rules_file_ships_and_names_the_known_levers():
    rules = default_rules()
    assert set(rules.classes) == set(CLASSES)
    assert set(rules.levers) == set(KNOWN_LEVERS)  # the levers the rules name are the suite's own
    assert rules.rule("--max-tokens-per-gpu").levers == ("thd-packing", "packed-loss")
    assert rules.rule("--attention-backend").levers == ("attention-backend",)
    assert rules.rule("--optimizer-offload-fraction").levers == ("optimizer-offload",)
    assert rules.rule("--wandb-project").klass == "inert"  # by a pattern
    assert rules.rule("--no-such-flag") is None
    for klass in CLASSES:
        assert any(rule.klass == klass for rule in rules.arguments.values()), klass


@pytest.mark.parametrize("text, message", [
    ("classes: [", "malformed YAML"),
    ("[]", "expected a mapping"),
    ("classes: {placement: a}\narguments: {}", "classes must describe exactly"),
])
def test_bad_rules_file(tmp_path, text, message):
    path = tmp_path / "rules.yaml"
    path.write_text(text)
    with pytest.raises(RulesError, match=message):
        load_rules(path)


def test_rules_entry_with_unknown_class_or_lever(tmp_path):
    base = {"classes": {name: "x" for name in CLASSES}, "levers": {"l": {"description": "d", "tests": ["t"]}}}
    for entry, message in [({"class": "layout", "reason": "r"}, "has class 'layout'"),
                           ({"class": "placement", "reason": "r", "lever": "l"}, "only numerics arguments"),
                           ({"class": "numerics", "reason": "r", "lever": "m"}, "names lever 'm'"),
                           ({"class": "inert"}, "--x reason must be")]:
        path = tmp_path / "rules.yaml"
        path.write_text(yaml.safe_dump(base | {"arguments": {"--x": entry}}))
        with pytest.raises(RulesError, match=message):
            load_rules(path)


# --- bad input ------------------------------------------------------------------------------------

def _recipe_with_run(run):
    return Recipe(id="inline", path=Path("inline.yaml"), data={"run": run, "correctness": {"component_tests": []}},
                  sha256="0")


def _one_line_error(run_cli, *argv):
    status, out, err = run_cli(*argv)
    assert status == 2 and out == "" and err.count("\n") == 1
    return err


def test_malformed_recipe(tmp_path, run_cli):
    path = tmp_path / "broken.yaml"
    path.write_text("model: [unclosed\n")
    assert "malformed YAML" in _one_line_error(run_cli, path, "--reference", path)


def test_recipe_without_run_or_train_command(tmp_path, run_cli):
    reference = reference_path(load_recipe(recipe_path(GEMMA)))
    without = copy_recipe(tmp_path, GEMMA, edit_data=lambda data: data.pop("run"), name="norun.yaml")
    assert "missing field run" in _one_line_error(run_cli, without, "--reference", reference)
    no_train = copy_recipe(tmp_path, GEMMA, edit_run=lambda run: "echo hello\n", name="notrain.yaml")
    assert "field run has no train.py command" in _one_line_error(run_cli, no_train, "--reference", reference)


def test_recipe_without_correctness_block_where_a_lever_needs_it(tmp_path, run_cli):
    reference = reference_path(load_recipe(recipe_path(NEMOTRON)))
    path = copy_recipe(tmp_path, NEMOTRON, edit_data=lambda data: data.pop("correctness"))
    assert "missing field correctness.component_tests" in _one_line_error(run_cli, path, "--reference", reference)
    # not needed where no numerics change has a lever: a copy of the reference itself
    same = copy_recipe(tmp_path, NEMOTRON, edit_data=lambda data: (data.pop("correctness"), data.update(
        run=yaml.safe_load(reference.read_text())["run"])), name="same.yaml")
    status, out, _ = run_cli(same, "--reference", reference)
    assert status == 0 and "0 changed arguments" in out


def test_bad_component_tests(tmp_path):
    path = copy_recipe(tmp_path, NEMOTRON, edit_data=_set_component_tests(["a test"]))
    with pytest.raises(RecipeError, match=r"correctness.component_tests\[0\] must be a mapping"):
        classify_copy(path, NEMOTRON)


def test_a_recipe_without_a_reference_is_classed_against_megatrons_defaults(tmp_path, run_cli):
    path = copy_recipe(tmp_path, GEMMA)  # its id is gemma-4-31b/h100/candidate: no default reference
    status, out, err = run_cli("--json", path)
    data = json.loads(out)
    assert status == 1 and data["reference"] == "Megatron's defaults (no reference recipe)"
    assert data["verdict"] == "incomplete"  # the other arguments cannot be judged without one
    assert {change["class"] for change in data["changes"]} == {"numerics"}
    err = _one_line_error(run_cli, path, "--reference", tmp_path / "nowhere.yaml")
    assert "nowhere.yaml: cannot be read (No such file or directory)" in err


@pytest.mark.parametrize("text, message", [
    ("run: [1, 2]", "field run must be a script"),
    ("source: x", "missing field run"),
    ("run: 'echo hi'", "no train.py command"),
    ("run: 'python3 train.py --a \"unbalanced'", "cannot be split into words"),
])
def test_bad_reference_file(tmp_path, text, message):
    path = tmp_path / "reference.yaml"
    path.write_text(text)
    with pytest.raises(RecipeError, match=message):
        load_reference(path)


def test_a_change_that_needs_two_levers_is_covered_only_when_both_pass(tmp_path):
    packing = _entry("eager attention over two packed rows (THD) against the same rows one at a time", "pass")
    loss = _entry("the per-token loss summed over packed rows against the same sum row by row", "pass")
    offload = _entry("x", "pass", lever="optimizer-offload")
    for entries, outcome in (([offload, packing], "missing"), ([offload, packing, loss], "covered"),
                             ([offload, packing, {**loss, "result": "fail"}], "fail")):
        path = copy_recipe(tmp_path, NEMOTRON, edit_data=_set_component_tests(entries))
        assert changes_by_flag(classify_copy(path, NEMOTRON))["--max-tokens-per-gpu"].outcome == outcome
