"""What the evidence catches: every wrong implementation of the catalogue
(correctness/wrong_implementations.py), run as a candidate through the levers' CPU tiers with
run_candidates, fails (or, for a scale error, is flagged systematic) on every case the catalogue
claims it on, while the honest path beside it passes with nothing flagged. Built on the eager
path here (the default's numerics, cheap on any CPU); benchmarks/evidence_power.py measures the
same catalogue on the flash kernel for docs/evidence-power.md."""

import pytest

from correctness import LeverOptions
from correctness.attention import backend_lever as attention
from correctness.attention.eager import EagerUnfused
from correctness.harness import run_candidates
from correctness.optimizer import lever as offload
from correctness.wrong_implementations import CATALOGUE

GEMMA = "gemma-4-31b/h100/attune-tp2-pp4-split13"
NEMOTRON = "nemotron-3-super-120b-a12b/h200/attune-tp4-pp2-ep8-mt16k"


def attention_lever():
    return attention.cpu_tier(GEMMA, LeverOptions(), candidate=EagerUnfused())[0]


def offload_levers():
    return [offload.cpu_tier(recipe, LeverOptions())[0] for recipe in (GEMMA, NEMOTRON)]


def judged_cases():
    cases = [("attention-backend", attention_lever, case.id) for case in attention_lever().cases if not case.skip_reason]
    for index, lever in enumerate(offload_levers()):
        cases += [("optimizer-offload", lambda index=index: offload_levers()[index], case.id)
                  for case in lever.cases if not case.skip_reason]
    return cases


@pytest.mark.parametrize("lever_name, make_lever, case_id", judged_cases(), ids=[c[2] for c in judged_cases()])
def test_each_wrong_implementation_is_caught_where_the_catalogue_claims_it(lever_name, make_lever, case_id):
    lever = make_lever()
    case = next(case for case in lever.cases if case.id == case_id)
    wrong = [entry for entry in CATALOGUE if entry.lever == lever_name and entry.changes(case)]
    honest = lever.candidate
    results = run_candidates(lever, case, [honest] + [entry.build(honest) for entry in wrong], repeat=False)
    assert results[0].status in ("pass", "no kernel change"), results[0].failures
    assert results[0].systematic == ()
    missed = []
    for entry, result in zip(wrong, results[1:]):
        if not entry.caught_on(case):
            continue
        caught = result.status == "fail" or (entry.expected == "systematic" and result.systematic)
        if not caught:
            worst = max(t.error_over_bound for t in result.candidate.tensors)
            missed.append(f"{entry.name}: {result.status}, largest error/bound {worst:.2f}")
    assert not missed, f"{case_id}: missed {missed}"


def test_the_scale_error_is_flagged_systematic_and_fails_only_when_strict():
    lever = attention_lever()
    case = next(case for case in lever.cases if case.variant == "model-like")
    entry = next(entry for entry in CATALOGUE if entry.expected == "systematic")
    plain, = run_candidates(lever, case, [entry.build(lever.candidate)], repeat=False)
    strict, = run_candidates(lever, case, [entry.build(lever.candidate)], repeat=False, strict_systematic=True)
    assert plain.systematic == ("out",) == strict.systematic
    out = next(t for t in plain.candidate.tensors if t.tensor == "out")
    assert out.whole_error_over_bound < 1.0  # the rule alone does not see it
    assert out.systematic.flagged and out.systematic.slope > out.systematic.slope_threshold
    assert not any("systematic error" in failure for failure in plain.failures)
    assert any("candidate out: systematic error (whole): slope +" in failure for failure in strict.failures)
