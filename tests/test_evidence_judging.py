"""Evidence beyond the whole-tensor rule: slices (correctness.compare.Slicing), the systematic-error
diagnostic (correctness.rule), invariants, and judging several candidates at once
(correctness.harness.run_candidates)."""

import math
from dataclasses import dataclass

import pytest
import torch

from correctness.attention.judging import single_key_positions, single_key_rows_give_their_value
from correctness.attention.inputs import AttentionInputs
from correctness.compare import Slicing, compare_tensor
from correctness.errors import ComparisonError, ImplementationUnavailable
from correctness.harness import run_candidates, run_case
from correctness.lever import Invariant, Mutated, ImplementationOutput
from correctness.optimizer.lever import bf16_weights_are_rounded_masters
from correctness.rule import Rule
from correctness.tiers import CPU
from correctness.attention.shapes import AttentionShape
from test_harness import CANDIDATE, DEFAULT, toy_case, toy_lever

RULE = Rule()
SLICES = Slicing(block=4)


def noisy(reference: torch.Tensor, size: float, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return reference + size * reference.abs().mean() * torch.randn(reference.shape, generator=generator, dtype=torch.float64)


def attention_like(seed: int = 0) -> torch.Tensor:
    """[batch 2, 32 positions, 4 heads, 16 features] in FP64."""
    return torch.randn(2, 32, 4, 16, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# Slices


def test_an_error_confined_to_one_slice_passes_whole_and_fails_its_slice():
    reference = attention_like()
    default = noisy(reference, 1e-2, seed=1)
    judged = noisy(reference, 1e-2, seed=2)
    judged[1, 8:12, 2] = noisy(reference[1, 8:12, 2], 8e-2, seed=3)  # one slice of 64, eight times as noisy
    whole = compare_tensor("out", judged, default, reference, RULE)
    sliced = compare_tensor("out", judged, default, reference, RULE, slicing=SLICES)
    assert whole.passes and whole.slices is None and whole.error_over_bound == whole.whole_error_over_bound < 1.0
    assert not sliced.passes and sliced.error <= sliced.bound  # the whole is still inside its bound
    assert sliced.slices.count == 2 * 8 * 4 and sliced.slices.failing == 1
    assert sliced.slices.worst_index == (1, 2, 2)
    assert sliced.slices.worst == "batch 1, positions 8-11, head 2"
    assert sliced.error_over_bound == sliced.slices.error_over_bound > 1.0


def test_an_honest_noise_passes_every_slice():
    reference = attention_like()
    sliced = compare_tensor("out", noisy(reference, 1e-2, 2), noisy(reference, 1e-2, 1), reference, RULE, slicing=SLICES)
    assert sliced.passes and sliced.slices.failing == 0 and sliced.slices.error_over_bound < 1.0


def test_a_slice_whose_reference_is_nearly_zero_is_judged_against_a_typical_slice_norm():
    reference = attention_like()
    reference[0, 0:4, 1] *= 1e-30  # dq of queries whose softmax is one-hot
    default = reference.clone()
    default[0, 0:4, 1] = 0.0  # the default computes exactly zero there
    judged = reference.clone()
    judged[0, 0:4, 1] = 1e-9  # rounding noise: huge relative to that slice's own reference
    sliced = compare_tensor("dq", judged, default, reference, RULE, slicing=SLICES)
    assert sliced.passes and sliced.slices.error < 1e-6


def test_a_ragged_last_block_is_its_own_slice():
    reference = torch.randn(10, 2, 3, dtype=torch.float64)  # THD: 10 tokens, blocks of 4, 4, 2
    judged = reference.clone()
    judged[9, 1] += 1.0
    sliced = compare_tensor("out", judged, reference.clone(), reference, RULE, slicing=SLICES)
    assert sliced.slices.count == 3 * 2 and sliced.slices.worst == "positions 8-9, head 1"


def test_a_tensor_sliced_along_its_first_dimension_cannot_arrive_in_pieces():
    from correctness.compare import TensorAccumulator

    accumulator = TensorAccumulator(name="out", rule=RULE, slicing=SLICES)
    piece = torch.randn(8, 2, 3, dtype=torch.float64)
    accumulator.add(piece, piece.clone(), piece)
    with pytest.raises(ComparisonError, match="sliced by positions along its first dimension"):
        accumulator.add(piece, piece.clone(), piece)


def test_pieces_along_a_leading_dimension_keep_their_slices():
    from correctness.compare import TensorAccumulator

    reference = attention_like()
    judged = noisy(reference, 1e-2, 2)
    judged[1, 8:12, 2] += 1.0
    accumulator = TensorAccumulator(name="out", rule=RULE, slicing=SLICES)
    for row in range(2):
        accumulator.add(judged[row : row + 1], reference[row : row + 1].clone(), reference[row : row + 1])
    whole = compare_tensor("out", judged, reference.clone(), reference, RULE, slicing=SLICES)
    pieces = accumulator.result()
    assert pieces.slices.worst == whole.slices.worst == "batch 1, positions 8-11, head 2"
    assert math.isclose(pieces.slices.error_over_bound, whole.slices.error_over_bound, rel_tol=1e-12)


def test_nan_in_a_slice_fails_and_reads_as_infinitely_far():
    reference = attention_like()
    judged = reference.clone()
    judged[0, 3, 0, 0] = math.nan
    sliced = compare_tensor("out", judged, reference.clone(), reference, RULE, slicing=SLICES)
    assert not sliced.passes and sliced.nonfinite and sliced.error_over_bound == math.inf


# The systematic diagnostic


def test_a_scale_error_inside_the_bound_is_flagged_systematic():
    reference = attention_like().to(torch.bfloat16).double()
    default = noisy(reference, 2e-2, 1).to(torch.bfloat16)
    honest = noisy(reference, 2e-3, 2).to(torch.bfloat16)
    scaled = (honest.double() * (1 + 2**-8)).to(torch.bfloat16)
    judged_honest = compare_tensor("out", honest, default, reference, RULE, slicing=SLICES)
    judged_scaled = compare_tensor("out", scaled, default, reference, RULE, slicing=SLICES)
    assert judged_scaled.passes  # the rule alone does not see it
    assert not judged_honest.systematic_flagged
    assert judged_scaled.systematic.flagged and judged_scaled.systematic_flagged
    assert judged_scaled.systematic.slope > judged_scaled.systematic.slope_threshold
    # 2^-8 of scale, and BF16's rounding of x (1 + 2^-8) upward from half an ulp: 5.6e-3 (the issue: 5.7e-3)
    assert 2**-8 < judged_scaled.systematic.slope < 2**-7


def test_the_threshold_is_twice_the_default_plus_a_floor_plus_the_noise_allowance():
    rule = Rule()
    floor = 0.25 * torch.finfo(torch.bfloat16).eps
    assert rule.systematic_floor(torch.bfloat16) == floor == 2.0**-9
    assert rule.systematic_threshold(-1e-3, torch.bfloat16, rest=0.0, count=100) == pytest.approx(2e-3 + floor)
    assert rule.systematic_threshold(0.0, torch.float32, rest=1e-4, count=10_000) == pytest.approx(
        2.0**-25 + 6 * 1e-4 / 100)


def test_an_offset_is_flagged_as_a_slope_is():
    reference = attention_like()
    default = noisy(reference, 1e-3, 1)
    shifted = noisy(reference, 1e-3, 2) + 1e-2 * reference.square().mean().sqrt()
    judged = compare_tensor("out", shifted.float(), default.float(), reference, RULE)
    assert judged.systematic.flagged and judged.systematic.offset == pytest.approx(1e-2, rel=0.05)


def test_a_bad_systematic_rule_is_refused():
    with pytest.raises(ValueError, match="systematic_factor must be >= 1"):
        Rule(systematic_factor=0.5)


# Invariants


def tiny_attention(qkv_format: str = "bshd", window=None, batch: int = 1, dtype: str = "bf16") -> AttentionShape:
    return AttentionShape(model="toy", layer_kind="sliding", scale="test", tp_size=1, tp_rank=0, batch=batch,
                          seq_len=6, heads=4, groups=2, head_dim=8, window=window, causal=True, softmax_scale=1.0,
                          dtype=dtype, qkv_format=qkv_format)


def test_single_key_positions_are_each_rows_first_token_or_every_token_under_a_window_of_one():
    assert single_key_positions(tiny_attention()) == [0]
    assert single_key_positions(tiny_attention("thd", batch=3)) == [0, 6, 12]
    assert single_key_positions(tiny_attention(window=(0, 0))) == list(range(6))
    assert single_key_positions(tiny_attention(window=(2, 1))) is None  # keys to the right are visible


def attention_inputs(shape: AttentionShape) -> AttentionInputs:
    generator = torch.Generator().manual_seed(0)
    lead = (shape.batch * shape.seq_len,) if shape.qkv_format == "thd" else (shape.batch, shape.seq_len)

    def tensor(heads):
        return torch.randn(*lead, heads, shape.head_dim, generator=generator).to(shape.torch_dtype)

    return AttentionInputs(shape=shape, q=tensor(shape.heads), k=tensor(shape.groups), v=tensor(shape.groups),
                           grad_out=tensor(shape.heads))


@pytest.mark.parametrize("qkv_format", ["bshd", "thd"])
def test_a_single_visible_key_must_give_its_value_under_the_right_group(qkv_format):
    shape = tiny_attention(qkv_format, batch=2)
    inputs = attention_inputs(shape)
    right = inputs.v.repeat_interleave(shape.gqa_ratio, dim=-2)  # head h reads group h // ratio
    interleaved = inputs.v.repeat(*([1] * (inputs.v.dim() - 2)), shape.gqa_ratio, 1)  # head h reads group h % groups
    assert single_key_rows_give_their_value(inputs, {"out": right}) is None
    problem = single_key_rows_give_their_value(inputs, {"out": interleaved})
    assert problem is not None and "is not that key's value" in problem and "head 1" in problem
    assert single_key_rows_give_their_value(
        AttentionInputs(**{**vars(inputs), "shape": shape.with_changes(dtype="fp32")}), {"out": interleaved}) is None


@dataclass(frozen=True)
class Unit:
    weights: torch.Tensor


def optimizer_outputs(master: torch.Tensor, bf16: torch.Tensor) -> dict:
    return {"w:master": master, "w:bf16": bf16, "w:update": master - 1}


def test_bf16_weights_must_be_the_masters_rounded_to_nearest():
    master = 1 + torch.rand(1000, generator=torch.Generator().manual_seed(0)) * 1e-2
    rounded = master.to(torch.bfloat16)
    truncated = (master.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
    stale = torch.ones(1000, dtype=torch.bfloat16)
    assert bf16_weights_are_rounded_masters(None, optimizer_outputs(master, rounded)) is None
    for wrong in (truncated, stale):
        problem = bf16_weights_are_rounded_masters(None, optimizer_outputs(master, wrong))
        assert problem.startswith("1 of 1 parameters' BF16 weights are not their FP32 masters rounded: w (")


def rows_are_sorted(inputs, tensors):
    rows = tensors["rows"]
    return None if bool((rows[1:] >= rows[:-1]).all()) else "rows are not sorted"


def test_an_invariant_a_path_breaks_fails_the_case_and_names_the_path():
    always_broken = Invariant(name="never", check=lambda inputs, tensors: "it never holds")
    result = run_case(toy_lever(invariants=(always_broken,)), toy_case(0))
    assert result.status == "fail" and result.invariants == ("never",)
    assert "candidate breaks the invariant 'never': it never holds" in result.failures
    assert "candidate (repeat) breaks the invariant 'never': it never holds" in result.failures
    assert "the default breaks the invariant 'never': it never holds" in result.failures


def test_an_invariant_that_holds_adds_no_failure():
    holds = Invariant(name="finite", check=lambda inputs, tensors: None)
    result = run_case(toy_lever(invariants=(holds,)), toy_case(0))
    assert result.status == "pass" and result.invariants == ("finite",)


# Several candidates on one case


@dataclass
class Counting:
    base: object
    calls: int = 0

    @property
    def name(self) -> str:
        return self.base.name

    def run(self, inputs):
        self.calls += 1
        return self.base.run(inputs)


@dataclass(frozen=True)
class Raises:
    name: str = "raises"

    def run(self, inputs):
        raise RuntimeError("boom")


@dataclass(frozen=True)
class Refuses:
    name: str = "refuses"

    def run(self, inputs):
        raise ImplementationUnavailable("not this shape")


def test_several_candidates_share_one_reference_default_and_control_run():
    default = Counting(DEFAULT)
    lever = toy_lever()
    lever = type(lever)(**{**vars(lever), "default": default})
    wrong = Mutated(base=CANDIDATE, mutation="doubled", mutate=lambda x: 2 * x)
    results = run_candidates(lever, toy_case(0), [CANDIDATE, wrong, Raises(), Refuses()])
    assert [r.status for r in results] == ["pass", "fail", "fail", "skip"]
    assert default.calls == 2  # the default and its repeat, once for all four candidates
    assert results[0].controls == results[1].controls
    assert results[2].failures == ("candidate (raises) raised RuntimeError: boom",)
    assert results[3].skip_reason == "not this shape"
    alone = run_case(lever, toy_case(0))
    assert [t.error for t in alone.candidate.tensors] == [t.error for t in results[0].candidate.tensors]


def test_without_repeats_each_candidate_runs_once():
    counted = Counting(CANDIDATE)
    result, = run_candidates(toy_lever(), toy_case(0), [counted], repeat=False)
    assert counted.calls == 1 and result.candidate_repeat is None and result.deterministic is None
    assert result.status == "pass"


def test_a_single_candidate_that_raises_fails_the_case_as_before():
    result = run_case(toy_lever(candidate=Raises()), toy_case(0))
    assert result.status == "fail" and result.failures == ("candidate (raises) raised RuntimeError: boom",)


# The systematic diagnostic in a case


@dataclass(frozen=True)
class Scaled:
    """Row sums of BF16 values in `dtype`, times `factor`: a scale error where factor is not 1."""

    name: str
    dtype: torch.dtype
    factor: float = 1.0

    def run(self, inputs):
        total = inputs.to(self.dtype).sum(-1) * self.factor
        return ImplementationOutput(
            tensors={"sums": total.to(torch.float64 if self.dtype == torch.float64 else torch.float32)},
                          backend=self.name)


def scaled_lever(**changes):
    from correctness.lever import Case, Control, Lever

    def make_inputs(device):
        return torch.rand(4096, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)

    candidate = Scaled("fp32 x (1 + 1e-4)", torch.float32, 1 + 1e-4)
    declaration = dict(
        name="scaled-sums", version=1, tier=CPU, description="sums", recipe=toy_lever().recipe,
        cases=(Case(id="sums", shape="4096 x 64", seed=0, source="synthetic", variant="uniform",
                    make_inputs=make_inputs),),
        candidate=candidate, default=Scaled("fp32", torch.float32), reference=Scaled("fp64", torch.float64),
        controls=(Control(name="doubled",
                          implementation=Mutated(base=candidate, mutation="x2", mutate=lambda x: 2 * x)),),
    )
    return Lever(**{**declaration, **changes})


def test_a_scale_error_is_flagged_unless_a_secondary_reference_explains_it():
    lever = scaled_lever()
    flagged = run_case(lever, lever.cases[0])
    assert flagged.status == "pass" and flagged.systematic == ("sums",)
    explained = scaled_lever(secondary_references=(Scaled("fp64 x (1 + 1e-4)", torch.float64, 1 + 1e-4),))
    cleared = run_case(explained, explained.cases[0])
    assert cleared.systematic == () and cleared.candidate.tensors[0].systematic_flagged
    strict = run_case(lever, lever.cases[0], strict_systematic=True)
    assert strict.status == "fail"
    assert any(f.startswith("candidate sums: systematic error (whole): slope +1.0") for f in strict.failures)
    assert strict.resolution["slope_tensor"] == "sums" and strict.resolution["slope"] < 1e-4
