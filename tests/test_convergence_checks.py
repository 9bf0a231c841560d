"""The convergence checks (correctness.convergence.checks) on hand-built curves.

The curves are built so that each of Megatron-Bridge's checks is, in turn, the only one that fails;
then the cases that function lets through (NaN, a constant curve), step coverage, the drift check,
and the recipe's block.
"""

import json
import math
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from correctness import cli
from correctness.convergence.checks import (
    FUNCTION,
    NOT_APPLIED,
    PIPELINE,
    check_convergence,
    convergence_block,
    format_report,
    round_correlation,
    round_difference,
)
from correctness.errors import CorrectnessError
from correctness.fixtures import recipe_path
from toy_curves import BLOCK_FIELDS, curve, decaying, upward_drift


def failing(result) -> set[str]:
    return {check.name for check in result.checks if check.status == "fail"}


def compare(candidate, reference, thresholds=PIPELINE):
    return check_convergence(curve(candidate), curve(reference, source="reference"), thresholds)


# Megatron-Bridge's five checks, each the deciding one


def test_identical_curves_pass_every_check():
    reference = decaying(20)
    result = compare(reference.copy(), reference)
    assert result.passed and failing(result) == set()
    assert result.skipped == 4 and len(result.steps) == 20  # 16 compared, as in the recipes' 20-step check
    assert result.check("drift").status == NOT_APPLIED
    assert convergence_block(result) == {"steps": 20, "result": "pass", "correlation": 1.0,
                                         "final_loss_difference": 0.0, "pointwise_failures": 0}


def test_correlation_decides_a_curve_that_wiggles_against_a_flat_reference():
    reference = 2.5 - 0.005 * np.arange(20)
    candidate = reference + 0.03 * (-1.0) ** np.arange(20)  # 1.2%: inside every point-wise tolerance
    result = compare(candidate, reference)
    assert failing(result) == {"correlation"}
    assert result.correlation < PIPELINE.correlation


def test_pointwise_tolerance_decides_and_the_tier_follows_the_golden_loss():
    reference = 1.9 - 0.05 * np.arange(20)  # 1.9 down to 0.95: the 5% tier
    candidate = reference.copy()
    candidate[[8, 12]] *= 1.06  # two of the 16 compared points 6% off
    result = compare(candidate, reference)
    assert failing(result) == {"point-wise tolerance"}
    assert result.pointwise_failure_steps == (9, 13)
    assert "step 9" in result.check("point-wise tolerance").detail
    # The same 6% above a golden loss of 2.0 is inside the 10% tier.
    assert compare(candidate + 1.5 * 1.06, reference + 1.5).passed


def test_pointwise_tolerance_allows_one_failure_in_sixteen_not_two():
    reference = 1.9 - 0.05 * np.arange(20)
    one = reference.copy()
    one[8] *= 1.06
    result = compare(one, reference)
    assert result.passed and result.pointwise_failures == 1  # 1/16 <= 10%
    two = one.copy()
    two[12] *= 1.06
    assert not compare(two, reference).passed  # 2/16 > 10%


@pytest.mark.parametrize("factor", [1.06, 0.94], ids=["above", "below"])
def test_final_loss_decides_in_either_direction(factor):
    reference = decaying(20)
    candidate = reference.copy()
    candidate[-1] *= factor  # 6%: inside the 10% point-wise tier, one outlier of 16 allowed
    result = compare(candidate, reference)
    assert failing(result) == {"final loss"}
    assert result.final_loss_difference == pytest.approx(0.06)
    assert convergence_block(result)["final_loss_difference"] == 0.06


def test_final_loss_at_the_tolerance_passes_and_function_thresholds_are_stricter():
    reference = 3.45 - 0.05 * np.arange(20)
    reference[-1] = 2.5
    candidate = reference.copy()
    candidate[-1] = 2.625  # exactly 5% above
    result = compare(candidate, reference)
    assert result.final_loss_difference == PIPELINE.final_loss_tolerance and result.passed
    assert failing(compare(candidate, reference, FUNCTION)) == {"final loss"}


def test_final_loss_against_a_zero_golden_loss_is_the_candidate_loss():
    reference = np.linspace(0.4, 0.0, 20)
    candidate = reference.copy()
    candidate[-1] = 0.01
    result = compare(candidate, reference)
    assert result.final_loss_difference == 0.01 and result.check("final loss").status == "pass"
    candidate[-1] = 0.06
    assert "final loss" in failing(compare(candidate, reference))


def test_residual_outliers_decide_two_opposite_spikes_in_nineteen_points():
    # 23 steps: 4 skipped, 19 compared. Residuals +a and -a, zero elsewhere: each is sqrt(9.5) = 3.08
    # standard deviations from the mean; 2/19 > 10%.
    reference = 4.0 - 0.05 * np.arange(23)
    candidate = reference.copy()
    candidate[9] += 0.05
    candidate[16] -= 0.05
    result = compare(candidate, reference)
    assert result.skipped == 4
    assert failing(result) == {"residual outliers"}
    assert "steps 10, 17" in result.check("residual outliers").detail


@settings(max_examples=200, deadline=None)
@given(arrays(np.float64, 16, elements=st.floats(-1.0, 1.0)))
def test_at_sixteen_points_at_most_one_residual_is_an_outlier(residuals):
    # With ddof 0 the squared z-scores sum to 16, and two beyond 3 would need more than 18: at the
    # recipes' 20 steps the outlier check cannot fail.
    reference = decaying(20)
    candidate = reference.copy()
    candidate[4:] += residuals
    assert compare(candidate, reference).check("residual outliers").value <= 1 / 16


# What validate_convergence lets through


@pytest.mark.parametrize("index", [6, 1], ids=["compared-step", "skipped-step"])
def test_a_nan_loss_fails_naming_its_step(index):
    reference = decaying(20)
    candidate = reference.copy()
    candidate[index] = math.nan
    result = compare(candidate, reference)
    assert not result.passed
    finite = result.check("finite losses")
    assert finite.status == "fail" and f"candidate loss is nan at step {index + 1}" in finite.detail
    assert any(f"step {index + 1}" in failure for failure in result.failures)
    json.dumps(result.to_dict(), allow_nan=False)  # undefined figures are None, never NaN


def test_an_infinite_reference_loss_fails():
    reference = decaying(20)
    candidate = reference.copy()
    reference[11] = math.inf
    result = compare(candidate, reference)
    assert "reference loss is inf at step 12" in result.check("finite losses").detail
    assert {"finite losses", "correlation", "residual outliers"} <= failing(result)


def test_a_constant_candidate_fails_where_megatron_bridge_would_pass_it():
    reference = 2.5 + 0.01 * np.sin(np.arange(20))  # within 0.4% of 2.5: every other check passes
    result = compare(np.full(20, 2.5), reference)
    assert failing(result) == {"correlation"}
    assert result.correlation is None and "candidate curve is constant" in result.check("correlation").detail
    assert "correlation" not in convergence_block(result) and result.to_dict()["correlation"] is None


def test_two_identical_constant_curves_fail():
    result = compare(np.full(20, 2.5), np.full(20, 2.5))
    assert failing(result) == {"correlation"}
    assert "candidate and the reference curves are constant" in result.check("correlation").detail


# Step coverage


def test_a_gap_in_both_curves_fails_naming_the_missing_step():
    steps = [s for s in range(1, 22) if s != 7]
    losses = decaying(20)
    result = check_convergence(curve(losses, steps), curve(losses, steps, "reference"))
    assert failing(result) == {"step coverage"}
    assert "missing from both curves (logging every 1): 7" in result.check("step coverage").detail


def test_curves_over_different_steps_fail():
    losses = decaying(20)
    result = check_convergence(curve(losses, range(1, 21)), curve(losses, range(2, 22), "reference"))
    detail = result.check("step coverage").detail
    assert "step coverage" in failing(result)
    assert "only in the candidate: 1" in detail and "only in the reference: 21" in detail
    assert len(result.steps) == 19  # the other checks compare the common steps


def test_logging_every_ten_steps_is_no_gap():
    steps = np.arange(10, 210, 10)
    result = check_convergence(curve(decaying(20), steps), curve(decaying(20), steps, "reference"))
    assert result.passed and result.check("step coverage").shown == "10-200 every 10"


def test_different_step_counts_are_bad_input_naming_both():
    with pytest.raises(CorrectnessError) as error:
        check_convergence(curve(decaying(20), source="a.log"), curve(decaying(19), source="b.log"))
    assert "a.log has 20 steps" in str(error.value) and "b.log has 19" in str(error.value)


@pytest.mark.parametrize(("steps", "skipped"), [(20, 4), (23, 4), (24, 4), (25, 5)])
def test_the_skip_truncates_like_megatron_bridge(steps, skipped):
    reference = decaying(steps)
    assert compare(reference, reference).skipped == skipped
    assert compare(reference, reference, FUNCTION).skipped == 0


def test_skipped_points_are_not_compared():
    reference = decaying(20)
    candidate = reference.copy()
    candidate[:4] *= 1.5
    assert compare(candidate, reference).passed
    assert compare(candidate, reference, FUNCTION).pointwise_failures == 4


# Drift


def test_a_slow_upward_drift_inside_every_tolerance_is_caught_by_the_drift_check():
    candidate, reference = upward_drift(100, end=0.04)  # 4%: inside the 10% tier and the 5% final
    result = compare(candidate, reference)
    assert failing(result) == {"drift"}
    assert result.drift.relative > PIPELINE.drift_tolerance
    assert "beyond 2%" in result.check("drift").detail


def test_the_drift_check_does_not_apply_to_short_runs_and_says_so():
    candidate, reference = upward_drift(40, end=0.04)
    result = compare(candidate, reference)
    drift = result.check("drift")
    assert result.passed and drift.status == NOT_APPLIED
    assert "needs at least 50 steps, these curves have 40" in drift.detail
    assert any("not applied" in line for line in format_report(result))


@pytest.mark.parametrize("offset", [0.0, 0.05], ids=["noise-only", "constant-offset"])
def test_noise_and_a_constant_offset_are_not_drift(offset):
    reference = decaying(100)
    candidate = reference + offset + np.random.default_rng(1).normal(0.0, 0.01, 100)
    result = compare(candidate, reference)
    assert result.passed and result.check("drift").status == "pass"
    assert abs(result.drift.relative) < 3 * result.drift.relative_stderr + 1e-12


# The recipe's block


def test_the_block_has_exactly_the_recipe_fields():
    recipes = ("gemma-4-31b/h100/attune-tp2-pp4-split13", "nemotron-3-super-120b-a12b/h200/attune-tp4-pp2-ep8-mt16k")
    for recipe in recipes:
        block = yaml.safe_load(recipe_path(recipe).read_text())["correctness"]["convergence"]
        assert set(block) - {"note"} == set(BLOCK_FIELDS)
    reference = decaying(20)
    assert list(convergence_block(compare(reference, reference))) == BLOCK_FIELDS


def test_the_block_fits_the_recipe_schema_even_when_a_figure_is_undefined():
    schema_path = Path(cli.__file__).parent / "schema" / "recipe.schema.json"
    if not schema_path.exists():
        pytest.skip(f"no recipe schema at {schema_path}")
    schema = json.loads(schema_path.read_text())
    block_schema = {**schema["$defs"]["convergence"], "$defs": schema["$defs"]}
    reference = decaying(20)
    candidate = reference.copy()
    candidate[6] = math.nan
    for result in (compare(reference, reference), compare(candidate, reference), compare(np.full(20, 2.5), reference)):
        jsonschema.validate(convergence_block(result), block_schema)


@pytest.mark.parametrize(("value", "rounded"), [(0.986491234, 0.98649), (0.99999861234, 0.9999986), (1.0, 1.0),
                                                (0.5, 0.5), (-0.98649321, -0.98649)])
def test_correlation_keeps_two_digits_of_its_distance_from_one(value, rounded):
    assert round_correlation(value) == rounded


@pytest.mark.parametrize(("value", "rounded"), [(0.0091, 0.0091), (0.000123987, 0.000124), (0.0, 0.0)])
def test_final_loss_difference_keeps_three_significant_digits(value, rounded):
    assert round_difference(value) == rounded
