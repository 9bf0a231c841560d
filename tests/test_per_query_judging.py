"""Per-query judging (issue 29; docs/evidence-power.md, "Per-query judging", measured by
benchmarks/per_query_judging.py): a slice per query row, under the rule and the floor the slices
already use, is not adopted. These tests pin what the decision rests on: a row slice sees a one-row
error that a 128-position slice dilutes, passes a candidate with the default's numerics, and never
passes NaN; but on SDPA's flash CPU kernel against the eager path, dq rows whose softmax is nearly
one-hot fail per query although the candidate is honest (a false alarm), while `out` stays within
its bound; there a window one key too narrow fails per query on `out` and passes the 128-position
slices. The attention levers' slicing stays per head and 128 positions."""

import math
from dataclasses import replace

import torch

from correctness import LeverOptions
from correctness.attention import backend_lever as attention
from correctness.attention.judging import SLICING
from correctness.compare import Slicing, compare_tensor
from correctness.harness import run_candidates
from correctness.lever import Control
from correctness.recipe_sets import GEMMA
from correctness.rule import Rule
from correctness.wrong_implementations import CATALOGUE

PER_QUERY = Slicing(block=1)
ROW, HEAD = 300, 1


def outputs(one_row_error: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A reference [1, 512 positions, 2 heads, 64], a default 1e-3 off it (relative), and a judged
    output as far off in other draws, with one row of one head `one_row_error` off."""
    generator = torch.Generator().manual_seed(0)
    reference = torch.randn(1, 512, 2, 64, generator=generator, dtype=torch.float64)
    default = reference + 1e-3 * torch.randn(reference.shape, generator=generator, dtype=torch.float64)
    judged = reference + 1e-3 * torch.randn(reference.shape, generator=generator, dtype=torch.float64)
    judged[0, ROW, HEAD] = reference[0, ROW, HEAD] * (1.0 + one_row_error)
    return judged.float(), default.float(), reference


def test_a_query_row_slice_catches_a_one_row_error_the_128_position_slice_misses():
    judged, default, reference = outputs(one_row_error=1.5e-2)
    per_block = compare_tensor("out", judged, default, reference, Rule(), slicing=SLICING)
    per_query = compare_tensor("out", judged, default, reference, Rule(), slicing=PER_QUERY)
    assert per_block.passes and per_block.slices.failing == 0
    assert not per_query.passes
    assert per_query.slices.failing == 1 and per_query.slices.count == 512 * 2
    assert per_query.slices.worst == f"batch 0, positions {ROW}-{ROW}, head {HEAD}"
    assert per_query.slices.error_over_bound > 3.0


def test_a_candidate_with_the_defaults_numerics_passes_per_query():
    judged, default, reference = outputs()
    per_query = compare_tensor("out", judged, default, reference, Rule(), slicing=PER_QUERY)
    assert per_query.passes and per_query.slices.failing == 0
    assert per_query.slices.error_over_bound < 0.5


def test_nan_never_passes_per_query():
    judged, default, reference = outputs()
    judged[0, 7, 0, 3] = math.nan
    per_query = compare_tensor("out", judged, default, reference, Rule(), slicing=PER_QUERY)
    assert not per_query.passes
    assert per_query.nonfinite is not None and per_query.error_over_bound == math.inf


def test_per_query_judging_false_alarms_on_the_flash_kernels_dq_and_sees_a_narrow_window_on_out():
    lever = attention.cpu_tier(GEMMA, LeverOptions())[0]
    assert lever.slicing == SLICING == Slicing(block=128)  # the decision: not per query
    case = next(case for case in lever.cases if case.variant == "model-like" and case.shape.window and case.seed == 0)
    narrow = next(entry for entry in CATALOGUE if entry.name == "window one key too narrow")
    candidates = [lever.candidate, narrow.build(lever.candidate)]
    # The controls measure the bound's power, not what these tests pin: one that never applies.
    idle = Control(name="not run", implementation=lever.candidate, why_inapplicable=lambda case: "not run here")
    by_block = run_candidates(replace(lever, controls=(idle,)), case, candidates, repeat=False)
    by_query = run_candidates(replace(lever, slicing=PER_QUERY, controls=(idle,)), case, candidates, repeat=False)

    def over(result) -> dict[str, float]:
        return {t.tensor: t.error_over_bound for t in result.candidate.tensors}

    honest_block, narrow_block = over(by_block[0]), over(by_block[1])
    honest_query, narrow_query = over(by_query[0]), over(by_query[1])
    assert all(t.passes for t in by_block[0].candidate.tensors) and max(honest_block.values()) < 0.5
    assert honest_query["dq"] > 5.0 and honest_query["out"] < 0.6  # the honest flash kernel's dq rows: a false alarm
    assert max(narrow_block.values()) < 0.5  # the 128-position slices miss the narrow window on seed 0
    assert narrow_query["out"] > 3.0  # one query row of out sees it
