"""A recipe's verdict (correctness.recipe_verdict): judged on what it changed against its reference,
on the records of the levers those changes need; the other levers' records a catalogue apart.
Records here are toy levers named as the suite's levers, on the Gemma seed recipe."""

from dataclasses import replace

import pytest
import torch
import yaml

from correctness import Control, Lever, Mutated, run_lever
from correctness.classify import MEGATRON_DEFAULTS
from correctness.fixtures import recipe_path
from correctness.lever import FormatFloor
from correctness.recipe_verdict import NOT_RUN, judge_recipe, recipe_changes, verdict_lines
from correctness.recipes import load_recipe
from correctness.report import LINE_WIDTH, TABLE_WIDTH
from correctness.results import FORMAT_LIMITED
from correctness.tiers import CPU
from toy_records import GEMMA, Sum, toy_case

CANDIDATE = Sum("fp32 sums", torch.float32)


def record(lever: str, candidate=CANDIDATE, recipe=None, format_floor=None, default=Sum("bf16 sums", torch.bfloat16),
           recipe_runs="candidate"):
    """A toy lever's record under a lever name of the suite, for the Gemma recipe (or `recipe`)."""
    return run_lever(Lever(
        name=lever, version=1, tier=CPU, description=f"toy {lever}", recipe=(recipe or load_recipe(recipe_path(GEMMA))).ref,
        cases=(toy_case(0, recipe_runs=recipe_runs),), candidate=candidate, default=default,
        reference=Sum("fp64 sums", torch.float64), format_floor=format_floor,
        controls=(Control(name="doubled",
                          implementation=Mutated(base=candidate, mutation="x2", mutate=lambda x: 2 * x)),),
    ))


@pytest.fixture(scope="module")
def gemma():
    return load_recipe(recipe_path(GEMMA))


def verdict_of(recipe, *records):
    return judge_recipe(recipe, recipe_changes(recipe), records)


def test_the_seed_is_judged_on_the_levers_its_changes_need(gemma):
    verdict = verdict_of(gemma, record("attention-backend"), record("optimizer-offload"))
    assert verdict.verdict == "pass"
    assert [lever.lever for lever in verdict.levers] == ["attention-backend", "optimizer-offload"]
    assert verdict.basis.endswith(f"references/{GEMMA}.yaml")
    assert verdict.other_changes == {"placement": 4}


def test_a_lever_the_recipe_did_not_change_is_a_catalogue_apart_and_never_its_verdict(gemma):
    """The Gemma seed runs --no-gradient-accumulation-fusion, as its reference does: a failing
    record of that lever is evidence about the flag, not about the recipe."""
    broken = Sum("drops nothing, doubles", torch.float32)
    failing = record("gradient-accumulation-fusion", candidate=Mutated(base=broken, mutation="x3", mutate=lambda x: 3 * x))
    assert failing.verdict == "fail"
    verdict = verdict_of(gemma, record("attention-backend"), record("optimizer-offload"), failing)
    assert verdict.verdict == "pass"
    assert [(lever.lever, lever.verdict) for lever in verdict.catalogue] == [("gradient-accumulation-fusion", "fail")]


def test_a_needed_lever_that_fails_fails_the_recipe(gemma):
    failing = record("optimizer-offload", candidate=Mutated(base=CANDIDATE, mutation="x3", mutate=lambda x: 3 * x))
    assert verdict_of(gemma, record("attention-backend"), failing).verdict == "fail"


def test_a_needed_lever_without_a_record_leaves_the_recipe_incomplete_with_the_reason(gemma):
    verdict = judge_recipe(gemma, recipe_changes(gemma), [record("attention-backend")],
                           {"optimizer-offload": ["recipe does not offload"]})
    assert verdict.verdict == "incomplete"
    offload = next(lever for lever in verdict.levers if lever.lever == "optimizer-offload")
    assert (offload.verdict, offload.reasons) == (NOT_RUN, ("recipe does not offload",))


def test_records_of_another_recipe_are_left_out(gemma):
    nemotron = load_recipe(recipe_path("nemotron-3-super-120b-a12b/h200/attune-tp4-pp2-ep8-mt16k"))
    verdict = verdict_of(gemma, record("attention-backend", recipe=nemotron), record("optimizer-offload"))
    assert verdict.verdict == "incomplete"
    assert {lever.lever: lever.verdict for lever in verdict.levers}["attention-backend"] == NOT_RUN


def bf16_floor():
    return FormatFloor(format="BF16", roundings=("the sums to BF16",),
                       implementation=Sum("fp64 sums through bf16", torch.bfloat16))


@pytest.mark.parametrize("converged", [True, False])
def test_a_format_limited_lever_covers_a_change_only_with_a_passing_convergence_block(gemma, tmp_path, converged):
    data = yaml.safe_load(recipe_path(GEMMA).read_text())
    data["correctness"]["convergence"]["result"] = "pass" if converged else "fail"
    copy = tmp_path / recipe_path(GEMMA).name
    copy.write_text(yaml.safe_dump(data, sort_keys=False))
    recipe = load_recipe(copy)
    assert recipe.id == GEMMA  # a copy of the fixture outside its tree keeps the fixture's id (and reference)
    offload = record("optimizer-offload", candidate=Sum("bf16 sums again", torch.bfloat16), format_floor=bf16_floor())
    offload = replace(offload, verdict=FORMAT_LIMITED)  # the verdict as the record would carry it
    verdict = verdict_of(recipe, record("attention-backend"), offload)
    assert verdict.verdict == ("pass" if converged else "incomplete")
    lines = verdict_lines(verdict, recipe.gpu)
    assert any("as accurate as" in line for line in lines)


def test_without_a_reference_the_numerics_arguments_are_judged_against_megatrons_defaults(tmp_path):
    data = yaml.safe_load(recipe_path(GEMMA).read_text())
    data["model"], data["gpu"]["type"] = "Gemma-4-31B", "H100"
    copy = tmp_path / "my-recipe.yaml"
    copy.write_text(yaml.safe_dump(data, sort_keys=False))
    recipe = load_recipe(copy)
    changes = recipe_changes(recipe)
    assert changes.reference == MEGATRON_DEFAULTS
    assert {change.klass for change in changes.changes} == {"numerics"}
    flags = {change.flag for change in changes.changes}
    assert "--no-gradient-accumulation-fusion" in flags and "--optimizer-offload-fraction" in flags
    assert "--tensor-model-parallel-size" not in flags  # placement: not judged without a reference
    lines = verdict_lines(judge_recipe(recipe, changes, []), recipe.gpu)
    assert "Megatron's defaults" in lines[1]


def test_the_verdict_fits_a_terminal(gemma):
    verdict = verdict_of(gemma, record("attention-backend"), record("optimizer-offload"),
                         record("gradient-accumulation-fusion"), record("fp8"))
    lines = verdict_lines(verdict, gemma.gpu)
    table = [line for line in lines if line.startswith("    ") or "  " in line.strip()]
    assert max(map(len, lines)) <= LINE_WIDTH and max(map(len, table)) <= TABLE_WIDTH


def test_a_recipe_that_runs_the_levers_default_is_judged_by_the_rule_turned_round(gemma):
    """The lever judges BF16 sums against FP32 and fails; a recipe that runs the FP32 side changed
    toward the default, so the same record judges it the other way round: FP32 within 2 x BF16's
    error + 1e-3, a pass. A case about another setting than the recipe's does not count."""
    lowered = record("optimizer-offload", candidate=Sum("bf16 sums", torch.bfloat16), default=Sum("fp32 sums", torch.float32),
                     recipe_runs="default")
    assert lowered.verdict == "fail"
    verdict = verdict_of(gemma, record("attention-backend"), lowered)
    offload = next(lever for lever in verdict.levers if lever.lever == "optimizer-offload")
    assert (offload.verdict, offload.label()) == ("pass", "pass (runs the default)")
    assert verdict.verdict == "pass"
    other = replace(lowered, cases=tuple(replace(case, recipe_runs="neither") for case in lowered.cases))
    assert next(lever for lever in verdict_of(gemma, record("attention-backend"), other).levers
                if lever.lever == "optimizer-offload").verdict == NOT_RUN
    catalogue = verdict_of(gemma, record("attention-backend"), record("optimizer-offload"),
                           replace(lowered, lever={**lowered.lever, "name": "fp8"})).catalogue
    assert [(lever.lever, lever.verdict) for lever in catalogue] == [("fp8", "fail")]  # the lever's own verdict


def test_a_record_missing_a_declared_case_stays_incomplete_when_the_recipe_runs_the_default(gemma):
    lowered = record("optimizer-offload", candidate=Sum("bf16 sums", torch.bfloat16), default=Sum("fp32 sums", torch.float32),
                     recipe_runs="default")
    interrupted = replace(lowered, lever={**lowered.lever, "cases": [*lowered.lever["cases"], "sums-seed1"]})
    offload = next(lever for lever in verdict_of(gemma, record("attention-backend"), interrupted).levers
                   if lever.lever == "optimizer-offload")
    assert offload.verdict == "incomplete"


def test_a_stand_in_run_is_shown_as_such_in_the_recipe_verdict():
    from correctness.recipe_verdict import tier_label

    assert tier_label({"tier": "h100"}, {"stand_in": {"present": "H200", "recipe": "H100"}}) == "h100 (H200 standing in)"
    assert tier_label({"tier": "h100"}, {"device": {"type": "cuda"}}) == "h100"
