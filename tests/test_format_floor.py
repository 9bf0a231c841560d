"""The format floor and the `format-limited` verdict (correctness.lever.FormatFloor), on a toy
gradient reduction: eight ranks' FP32 gradients summed, the default in FP32, the candidate in
BF16 (each rank's gradient rounded to BF16, the sum rounded to BF16), against the FP64 sum.

One correct rounding to BF16 is a relative error of about 1.7e-3, above the rule's 1e-3 slack,
so no BF16 reduction can pass the rule against an FP32 default: the honest candidate must come
out `format-limited`, and wrong BF16 implementations (truncation, a dropped rank) `fail`."""

import json
from dataclasses import dataclass, replace

import pytest
import torch

from correctness import (Case, Control, ImplementationOutput, Lever, RecipeRef, read_record, run_case, run_lever,
                         write_record)
from correctness.lever import FormatFloor
from correctness.results import FAIL, FORMAT_LIMITED, PASS, LeverRecord, record_to_json, stated_fields_disagree
from correctness.tiers import CPU

RECIPE = RecipeRef(id="toy/cpu/bf16-reduction", model="Toy", gpu="none", sha256="0" * 64)
RANKS = 8


def to_bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


def truncate_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """BF16 by dropping the low 16 bits of FP32 (rounding toward zero): a wrong conversion."""
    bits = x.to(torch.float32).view(torch.int32) & ~0xFFFF
    return bits.view(torch.float32).to(x.dtype)


@dataclass(frozen=True)
class Reduce:
    """The ranks' sum: `rounding` applied to each rank's gradient and to the result; `ranks`
    summed (all of them by default); FP32 arithmetic, an FP32 result."""

    name: str
    rounding: object = None
    ranks: int = RANKS
    flip_rank: int | None = None

    def run(self, gradients: torch.Tensor) -> ImplementationOutput:
        parts = [g if self.rounding is None else self.rounding(g) for g in gradients[: self.ranks]]
        if self.flip_rank is not None:
            parts[self.flip_rank] = -parts[self.flip_rank]
        total = torch.stack(parts).sum(0)
        total = total if self.rounding is None else self.rounding(total)
        return ImplementationOutput(tensors={"grad": total.to(torch.float32)}, backend=self.name)


@dataclass(frozen=True)
class Fp64Sum:
    """The reference (`rounding` None) and the format floor: the FP64 sum of the gradients through
    `rounding`, otherwise exact, in the candidate's FP32."""

    name: str
    rounding: object = None

    def run(self, gradients: torch.Tensor) -> ImplementationOutput:
        parts = gradients.double() if self.rounding is None else self.rounding(gradients).double()
        total = parts.sum(0)
        if self.rounding is None:
            return ImplementationOutput(tensors={"grad": total}, backend=self.name)
        return ImplementationOutput(tensors={"grad": self.rounding(total).to(torch.float32)}, backend=self.name)


HONEST = Reduce("bf16 reduction", rounding=to_bf16)
DEFAULT = Reduce("fp32 reduction")
BF16_FLOOR = FormatFloor(format="BF16", roundings=("each rank's gradient to BF16 before the sum", "the sum to BF16"),
                         implementation=Fp64Sum("fp64 sum through bf16", rounding=to_bf16))
DROPPED = Control(name="one rank dropped",
                  implementation=Reduce("bf16 reduction, rank dropped", rounding=to_bf16, ranks=RANKS - 1))


def case(seed: int) -> Case:
    def make(device):
        generator = torch.Generator().manual_seed(seed)
        return torch.randn(RANKS, 4096, generator=generator)

    return Case(id=f"reduce-{RANKS}x4096-seed{seed}", shape={"ranks": RANKS}, seed=seed, source="synthetic",
                variant="noise", make_inputs=make)


def lever(candidate=HONEST, controls=(DROPPED,), floor=BF16_FLOOR) -> Lever:
    return Lever(name="toy-reduction", version=1, tier=CPU, description="a toy BF16 reduction", recipe=RECIPE,
                 cases=(case(0), case(1)), candidate=candidate, default=DEFAULT, reference=Fp64Sum("fp64 sum"),
                 controls=controls, format_floor=floor)


def test_the_honest_bf16_reduction_is_format_limited():
    result = run_case(lever(), case(0))
    assert result.status == FORMAT_LIMITED, result.failures
    assert result.failures == ()
    grad = result.candidate.tensors[0]
    assert grad.error > grad.bound, "the candidate fails the rule: one BF16 rounding is above the 1e-3 slack"
    floor = result.format.floor.tensors[0]
    assert not floor.passes and floor.error > 1.5e-3, "the floor alone fails the rule too"
    against_floor = result.format.candidate.tensors[0]
    assert against_floor.passes and against_floor.default_error == pytest.approx(floor.error)
    assert result.format.outside_rule and result.format.findings == ()
    assert all(control.fails for control in result.format.controls)
    assert result.format.floor_fails_rule == ("grad",)


def test_a_lever_of_format_limited_cases_has_that_verdict_and_its_record_reads_back(tmp_path):
    record = run_lever(lever())
    assert record.verdict == FORMAT_LIMITED
    path = write_record(record, tmp_path)
    data = read_record(path)
    assert data["lever"]["format_floor"] == {"format": "BF16", "roundings": list(BF16_FLOOR.roundings),
                                             "path": "fp64 sum through bf16"}
    assert stated_fields_disagree(data) is None
    assert record_to_json(LeverRecord.from_json(data)) == data
    edited = json.loads(json.dumps(data))
    edited["cases"][0]["format"]["controls"][0]["fails"] = False
    assert "format.controls.0.fails" in stated_fields_disagree(edited)


def test_truncation_instead_of_round_to_nearest_fails_as_biased_beyond_the_floor():
    result = run_case(lever(candidate=Reduce("bf16 reduction, truncated", rounding=truncate_to_bf16)), case(0))
    assert result.status == FAIL
    assert result.format.systematic == ("grad",)
    assert any("biased beyond the BF16 floor's rounding" in finding for finding in result.format.findings)


def test_a_dropped_rank_fails_as_worse_than_bf16_allows():
    result = run_case(lever(candidate=Reduce("bf16 reduction, rank dropped", rounding=to_bf16, ranks=RANKS - 1)),
                      case(0))
    assert result.status == FAIL
    assert any("worse than BF16 allows" in finding for finding in result.format.findings)


def test_rounding_twice_per_hop_through_a_narrower_format_fails():
    """Each rank's gradient through FP8 E4M3 before BF16: a second, coarser rounding per hop."""
    def through_fp8(x):
        return to_bf16(x.to(torch.float8_e4m3fn).to(x.dtype))

    result = run_case(lever(candidate=Reduce("bf16 reduction via fp8", rounding=through_fp8)), case(0))
    assert result.status == FAIL
    assert any("worse than BF16 allows" in finding for finding in result.format.findings)


def test_a_control_within_the_format_bound_makes_the_case_fail():
    """A "control" that is an honest BF16 reduction fails the rule (its format does) but not the
    format bound, which cannot tell it from the candidate: the case fails naming it."""
    weak = Control(name="another bf16 reduction",
                   implementation=Reduce("bf16, in reverse rank order", rounding=to_bf16))
    result = run_case(lever(controls=(DROPPED, weak)), case(0))
    assert result.status == FAIL
    assert any("'another bf16 reduction' is within the BF16 format bound" in finding
               for finding in result.format.findings)


def test_a_floor_that_meets_the_rule_leaves_the_candidate_failing():
    """A floor declared in FP16 (10 mantissa bits) passes the rule: an FP16 implementation could
    meet it, so the BF16 candidate's failure is not its format's limit."""
    def to_fp16(x):
        return x.to(torch.float16).to(x.dtype)

    fp16 = FormatFloor(format="FP16", roundings=("each rank's gradient to FP16",),
                       implementation=Fp64Sum("fp16", rounding=to_fp16))
    result = run_case(lever(floor=fp16), case(0))
    assert result.status == FAIL
    assert result.format.floor_fails_rule == ()
    assert any("format floor passes the rule on grad" in finding for finding in result.format.findings)


def test_a_candidate_that_passes_the_rule_passes_and_keeps_its_format_figures():
    result = run_case(lever(candidate=Reduce("fp32 reduction again")), case(0))
    assert result.status == PASS
    assert result.format is not None and result.format.outside_rule == () and result.format.findings == ()


def test_a_failure_other_than_the_candidates_own_is_never_format_limited():
    """A control that passes the rule itself (here: the default again) fails the case, format or not."""
    useless = Control(name="the default", implementation=DEFAULT)
    result = run_case(lever(controls=(DROPPED, useless)), case(0))
    assert result.status == FAIL
    assert any("negative control 'the default' passes the bound" in failure for failure in result.failures)


def test_nan_is_never_format_limited():
    @dataclass(frozen=True)
    class WithNan:
        name: str = "bf16 with a NaN"

        def run(self, gradients):
            output = HONEST.run(gradients)
            grad = output.tensors["grad"].clone()
            grad[3] = float("nan")
            return ImplementationOutput(tensors={"grad": grad}, backend=output.backend)

    result = run_case(lever(candidate=WithNan()), case(0))
    assert result.status == FAIL


def test_a_floor_must_name_its_roundings():
    with pytest.raises(ValueError, match="declares no roundings"):
        FormatFloor(format="BF16", roundings=(), implementation=Fp64Sum("x"))
    assert replace(BF16_FLOOR, format="BF16").roundings


def test_strict_systematic_judges_a_candidate_with_a_floor_against_the_floors_bias():
    """Under --strict-systematic the honest BF16 reduction stays format-limited (its rounding is the
    floor's), while a candidate that passes the rule but is scaled by 1 + 1e-4 fails."""
    assert run_case(lever(), case(0), strict_systematic=True).status == FORMAT_LIMITED

    @dataclass(frozen=True)
    class Scaled:
        name: str = "fp32 reduction x (1 + 1e-4)"

        def run(self, gradients):
            output = DEFAULT.run(gradients)
            return ImplementationOutput(tensors={"grad": output.tensors["grad"] * (1 + 1e-4)}, backend=self.name)

    assert run_case(lever(candidate=Scaled()), case(0)).status == PASS
    strict = run_case(lever(candidate=Scaled()), case(0), strict_systematic=True)
    assert strict.status == FAIL
    assert any("systematic error" in failure and "floor" in failure for failure in strict.failures), strict.failures


@pytest.fixture(scope="module")
def limited_record():
    """A format-limited record's JSON form, with a second control (both apply)."""
    doubled = Control(name="rank doubled", implementation=Reduce("bf16 reduction, rank flipped", rounding=to_bf16,
                                                                  flip_rank=0))
    data = record_to_json(run_lever(lever(controls=(DROPPED, doubled))))
    assert data["verdict"] == FORMAT_LIMITED and stated_fields_disagree(data) is None
    return data


def _edited(data, edit):
    copy = json.loads(json.dumps(data))
    edit(copy["cases"][0]["format"])
    return copy


def test_the_floors_error_is_read_from_the_floors_own_figures(limited_record):
    """A candidate's bound against the floor raised by raising its copy of the floor's error."""
    def raise_floor_copy(limited):
        for t in limited["candidate"]["tensors"]:
            t["default_error"] *= 1.5
    found = stated_fields_disagree(_edited(limited_record, raise_floor_copy))
    assert found.startswith("field cases.0.format.candidate.tensors.0.default_error says"), found


def test_the_bias_against_the_floor_is_recomputed_from_the_stored_slopes(limited_record):
    """A slope beyond its threshold with the case's list of biased tensors left empty."""
    def biased(limited):
        tensor = limited["candidate"]["tensors"][0]
        systematic = tensor["systematic"]
        systematic |= {"slope": 10 * systematic["slope_threshold"], "flagged": True}
        systematic["over_threshold"] = max(10.0, abs(systematic["offset"]) / systematic["offset_threshold"])
        tensor["systematic_flagged"] = True
    found = stated_fields_disagree(_edited(limited_record, biased))
    assert found == 'field cases.0.format.systematic says [] where its figures give ["grad"]', found


@pytest.mark.parametrize("kept", [1, 0])
def test_deleting_format_controls_is_refused(limited_record, kept):
    from correctness.recheck import case_problems

    def deleted(limited):
        limited["controls"] = limited["controls"][:kept]
    forged = LeverRecord.from_json(_edited(limited_record, deleted))
    problems = case_problems(forged.cases[0], limited_record["lever"])
    assert any("has no format figures for its control" in problem for problem in problems), problems
    honest = LeverRecord.from_json(limited_record)
    assert case_problems(honest.cases[0], limited_record["lever"]) == []
