"""The per-tensor comparison (correctness.compare) and the pass rule (correctness.rule)."""

import math

import pytest
import torch

from correctness.compare import OutputsAccumulator, compare_tensor
from numerics import relative_l2_error
from correctness.errors import ComparisonError
from correctness.rule import DEFAULT_FACTOR, DEFAULT_SLACK, Rule

RULE = Rule()


def reference_2x3() -> torch.Tensor:
    """A float64 reference of norm 1 (one unit entry), so relative errors equal absolute ones."""
    ref = torch.zeros(2, 3, dtype=torch.float64)
    ref[0, 0] = 1.0
    return ref


def with_value(tensor: torch.Tensor, index: tuple[int, ...], value: float) -> torch.Tensor:
    changed = tensor.clone()
    changed[index] = value
    return changed


# relative errors and the bias field


def test_relative_l2_error_of_a_hand_computed_example():
    reference = torch.tensor([3.0, 4.0])  # norm 5
    judged = torch.tensor([3.0, 5.0])  # difference norm 1
    assert relative_l2_error(judged, reference) == (0.2, "relative")


def test_relative_l2_error_against_a_zero_reference_is_the_absolute_norm():
    assert relative_l2_error(torch.tensor([3.0, 4.0]), torch.zeros(2)) == (5.0, "absolute")


def test_relative_l2_error_is_computed_in_fp64():
    # In BF16 arithmetic 256 + 1 rounds back to 256 and the error would read 0.
    reference = torch.tensor([256.0], dtype=torch.bfloat16)
    judged = torch.tensor([257.0], dtype=torch.float64)
    assert relative_l2_error(judged, reference) == (1 / 256, "relative")


def test_the_bias_field_is_the_signed_mean_error_in_units_of_the_references_rms():
    reference = torch.tensor([3.0, 4.0], dtype=torch.float64)  # rms sqrt(12.5)
    above = compare_tensor("x", (reference + 0.5).float(), reference.float(), reference, RULE)
    below = compare_tensor("x", (reference - 0.5).float(), reference.float(), reference, RULE)
    exact = compare_tensor("x", reference.float(), (reference + 0.5).float(), reference, RULE)
    assert above.bias == pytest.approx(0.5 / math.sqrt(12.5)) and below.bias == pytest.approx(-0.5 / math.sqrt(12.5))
    assert exact.bias == 0.0 and exact.default_bias == pytest.approx(0.5 / math.sqrt(12.5))


def test_the_bias_against_a_zero_reference_is_the_plain_mean():
    zeros = torch.zeros(2, dtype=torch.float64)
    assert compare_tensor("x", torch.tensor([-1.0, -3.0]), torch.zeros(2), zeros, RULE).bias == -2.0


# compare_tensor: the rule's edge


def test_error_exactly_at_the_bound_passes_and_one_ulp_over_fails():
    reference = reference_2x3()
    default = with_value(reference, (0, 1), 3e-3)
    bound = RULE.bound(3e-3)
    at_bound = compare_tensor("out", with_value(reference, (1, 2), bound), default, reference, RULE)
    over = compare_tensor(
        "out", with_value(reference, (1, 2), math.nextafter(bound, math.inf)), default, reference, RULE
    )
    assert at_bound.error == bound and at_bound.passes
    assert at_bound.margin == 0.0 and at_bound.error_over_bound == 1.0
    assert not over.passes and over.margin < 0.0 and over.error_over_bound > 1.0
    assert over.nonfinite is None


def test_bound_is_factor_times_default_error_plus_slack():
    reference = reference_2x3()
    default = with_value(reference, (0, 1), 3e-3)
    result = compare_tensor("out", default.clone(), default, reference, RULE)
    assert result.default_error == 3e-3
    assert result.bound == DEFAULT_FACTOR * 3e-3 + DEFAULT_SLACK


def test_ratio_is_none_where_the_default_is_exact():
    reference = reference_2x3()
    judged = with_value(reference, (1, 1), DEFAULT_SLACK / 2)
    result = compare_tensor("out", judged, reference.clone(), reference, RULE)
    assert result.default_error == 0.0
    assert result.ratio is None


def test_slack_only_when_passing_only_thanks_to_the_slack():
    reference = reference_2x3()
    judged = with_value(reference, (1, 1), DEFAULT_SLACK / 2)
    result = compare_tensor("out", judged, reference.clone(), reference, RULE)
    assert result.passes and result.slack_only


def test_not_slack_only_when_within_factor_times_the_default_error():
    reference = reference_2x3()
    default = with_value(reference, (0, 1), 4e-3)
    judged = with_value(reference, (0, 1), 6e-3)  # 1.5 x the default's error
    result = compare_tensor("out", judged, default, reference, RULE)
    assert result.passes and not result.slack_only
    assert result.ratio == 6e-3 / 4e-3


def test_candidate_over_the_bound_fails_without_slack_only():
    reference = reference_2x3()
    default = with_value(reference, (0, 1), 4e-3)
    judged = with_value(reference, (0, 1), 1.0)
    result = compare_tensor("out", judged, default, reference, RULE)
    assert not result.passes and not result.slack_only


def test_bitwise_identical_only_where_judged_and_default_agree_bit_for_bit():
    reference = reference_2x3()
    default = with_value(reference, (0, 1), 4e-3)
    same = compare_tensor("out", default.clone(), default, reference, RULE)
    other = compare_tensor("out", with_value(default, (1, 1), 1e-9), default, reference, RULE)
    signed_zero = compare_tensor("out", with_value(default, (1, 1), -0.0), default, reference, RULE)
    assert same.bitwise_identical and same.ratio == 1.0
    assert not other.bitwise_identical
    assert not signed_zero.bitwise_identical  # -0.0 == 0.0 as values, not as bits


def test_worst_element_is_where_judged_is_farthest_from_the_reference_with_all_three_values():
    reference = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    default = with_value(reference, (1, 2), 5.25)
    judged = with_value(with_value(reference, (0, 1), 1.5), (1, 2), 7.0)
    worst = compare_tensor("out", judged, default, reference, RULE).worst
    assert worst.index == (1, 2)
    assert (worst.judged, worst.default, worst.reference) == (7.0, 5.25, 5.0)


def test_comparison_records_the_tensor_name_shape_and_dtype():
    reference = reference_2x3()
    result = compare_tensor("dq", reference.float(), reference.float(), reference, RULE)
    assert (result.tensor, result.shape, result.dtype) == ("dq", (2, 3), "float32")
    assert result.error_kind == "relative"


def test_zero_reference_gives_an_absolute_error_kind():
    zeros = torch.zeros(2, 3, dtype=torch.float64)
    result = compare_tensor("out", with_value(zeros, (0, 0), 1e-4), zeros.clone(), zeros, RULE)
    assert result.error_kind == "absolute" and result.error == 1e-4


# compare_tensor: NaN and Inf never pass


@pytest.mark.parametrize("role", ["judged", "default", "reference"])
@pytest.mark.parametrize(("value", "nans", "infs"), [(math.nan, 2, 0), (math.inf, 0, 2), (-math.inf, 0, 2)])
def test_nonfinite_values_fail_with_role_tensor_counts_and_first_index(role, value, nans, infs):
    tensors = {"judged": reference_2x3(), "default": reference_2x3(), "reference": reference_2x3()}
    tensors[role] = with_value(with_value(tensors[role], (1, 0), value), (1, 2), value)
    result = compare_tensor("dk", tensors["judged"], tensors["default"], tensors["reference"], RULE)
    assert not result.passes
    assert result.nonfinite is not None and "\n" not in result.nonfinite
    assert result.nonfinite.startswith(f"{role} dk:")
    assert f"{nans} NaN and {infs} Inf of 6 elements" in result.nonfinite
    assert result.nonfinite.endswith("first at [1, 0]")


def test_nan_in_both_judged_and_default_fails_even_when_they_are_bitwise_identical():
    reference = reference_2x3()
    both = with_value(reference, (0, 2), math.nan)
    result = compare_tensor("out", both, both.clone(), reference, RULE)
    assert result.bitwise_identical
    assert not result.passes


def test_worst_element_of_a_nan_output_is_the_nan():
    reference = reference_2x3()
    judged = with_value(with_value(reference, (0, 0), 5.0), (1, 1), math.nan)
    worst = compare_tensor("out", judged, reference.clone(), reference, RULE).worst
    assert worst.index == (1, 1) and math.isnan(worst.judged)


# compare_tensor: layouts must agree, no broadcasting


def test_shape_mismatch_between_judged_and_default_raises_without_broadcasting():
    with pytest.raises(ComparisonError, match=r"tensor out: .*\(4, 1\).*\(4,\)"):
        compare_tensor("out", torch.zeros(4, 1), torch.zeros(4), torch.zeros(4, 1), RULE)


def test_dtype_mismatch_between_judged_and_default_raises():
    with pytest.raises(ComparisonError, match=r"tensor out: .*torch\.bfloat16.*torch\.float32"):
        compare_tensor("out", torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4), torch.zeros(4), RULE)


def test_reference_shape_mismatch_raises():
    with pytest.raises(ComparisonError, match=r"tensor out: .*the reference is \(1, 4\)"):
        compare_tensor("out", torch.zeros(4), torch.zeros(4), torch.zeros(1, 4, dtype=torch.float64), RULE)


# OutputsAccumulator: the three must name the same tensors


def outputs(*names: str) -> dict[str, torch.Tensor]:
    return {name: reference_2x3() for name in names}


def compare_outputs(judged, default, reference, rule):
    accumulator = OutputsAccumulator(rule=rule)
    accumulator.add(judged, default, reference)
    return accumulator.results()


def test_compare_outputs_compares_every_reference_tensor_in_its_order():
    results = compare_outputs(outputs("dv", "out"), outputs("out", "dv"), outputs("out", "dv"), RULE)
    assert [r.tensor for r in results] == ["out", "dv"]
    assert all(r.passes for r in results)


def test_compare_outputs_raises_naming_a_missing_tensor():
    with pytest.raises(ComparisonError, match=r"^judged output .*missing \['dv'\]"):
        compare_outputs(outputs("out"), outputs("out", "dv"), outputs("out", "dv"), RULE)


def test_compare_outputs_raises_naming_an_extra_tensor():
    with pytest.raises(ComparisonError, match=r"^default output .*unexpected \['lse'\]"):
        compare_outputs(outputs("out"), outputs("out", "lse"), outputs("out"), RULE)


def test_compare_outputs_refuses_a_reference_with_no_tensors():
    with pytest.raises(ComparisonError, match="no tensors"):
        compare_outputs({}, {}, {}, RULE)


# Rule validation


def test_rule_refuses_a_factor_below_one():
    with pytest.raises(ValueError, match="factor must be >= 1"):
        Rule(factor=math.nextafter(1.0, 0.0))


def test_rule_refuses_a_negative_slack():
    with pytest.raises(ValueError, match=r"slack >= 0, got .*slack=-"):
        Rule(slack=-DEFAULT_SLACK)


def test_rule_refuses_nan():
    with pytest.raises(ValueError, match="rule:"):
        Rule(factor=math.nan)


def test_rule_accepts_the_strictest_valid_rule():
    strictest = Rule(factor=1.0, slack=0.0)
    assert strictest.bound(3e-3) == 3e-3
    assert strictest.describe() == "1 x default + 0"


def test_a_scalar_output_compares_with_an_empty_worst_index():
    reference = torch.tensor(2.0, dtype=torch.float64)
    result = compare_tensor("loss", torch.tensor(2.5), torch.tensor(2.25), reference, RULE)
    assert (result.shape, result.error, result.default_error) == ((), 0.25, 0.125)
    assert result.worst.index == () and result.worst.judged == 2.5
