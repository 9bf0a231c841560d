"""What the evidence catches: every wrong implementation of the catalogue
(correctness/wrong_implementations.py), run as a candidate through the levers' CPU tiers with
run_candidates, fails (or, for a scale error, is flagged systematic) on every case the catalogue
claims it on, while the honest path beside it passes with nothing flagged. The attention backend's
are built on the eager path here (the default's numerics, cheap on any CPU); benchmarks/evidence_power.py
measures the same catalogue on the flash kernel for docs/evidence-power.md. The fused kernels'
mistakes run on each lever's own candidate, at one recipe per lever and layout (the benchmark runs
every recipe of the document's table), and so do the packing levers', the grouped GEMM's and
deterministic mode's (whose candidates run three times, as its rule asks)."""

import pytest

from correctness import LeverOptions
from correctness.attention import backend_lever as attention
from correctness.attention import softmax_precision_lever as softmax_precision
from correctness.attention import thd_packing_lever as thd_packing
from correctness.attention.eager import EagerUnfused
from correctness.composites.determinism import lever as deterministic_mode
from correctness.cross_entropy import lever as cross_entropy
from correctness.harness import run_candidates
from correctness.loss import lever as packed_loss
from correctness.moe import grouped_gemm_lever as grouped_gemm
from correctness.moe import permute_lever
from correctness.optimizer import lever as offload
from correctness.recipe_sets import GEMMA, LLAMA, NEMOTRON, QWEN3_MOE
from correctness.rope import lever as rope
from correctness.swiglu import lever as swiglu
from correctness.swiglu.wrong import with_bias
from correctness.wrong_implementations import CATALOGUE


def attention_lever():
    return attention.cpu_tier(GEMMA, LeverOptions(), candidate=EagerUnfused())[0]


def offload_levers():
    return [offload.cpu_tier(recipe, LeverOptions())[0] for recipe in (GEMMA, NEMOTRON)]


def judged_cases():
    cases = [("attention-backend", attention_lever, case.id)
             for case in attention_lever().cases if not case.skip_reason]
    for index, lever in enumerate(offload_levers()):
        cases += [("optimizer-offload", lambda index=index: offload_levers()[index], case.id)
                  for case in lever.cases if not case.skip_reason]
    return cases


@pytest.mark.parametrize("lever_name, make_lever, case_id", judged_cases(), ids=[c[2] for c in judged_cases()])
def test_each_wrong_implementation_is_caught_where_the_catalogue_claims_it(lever_name, make_lever, case_id):
    lever = make_lever()
    case = next(case for case in lever.cases if case.id == case_id)
    missed = missed_on(lever, case)
    assert not missed, f"{case_id}: missed {missed}"


def missed_on(lever, case) -> list[str]:
    """The catalogue's mistakes of the lever that the case claims and does not catch; the honest
    candidate, judged beside them, must pass with nothing flagged. A lever whose rule asks for bitwise
    repeatability runs each candidate that often (its mistakes are caught there)."""
    wrong = [entry for entry in CATALOGUE if entry.lever == lever.name and entry.changes(case)]
    honest = lever.candidate
    results = run_candidates(lever, case, [honest] + [entry.build(honest) for entry in wrong],
                             repeat=lever.rule.bitwise_repeatable)
    assert results[0].status in ("pass", "no kernel change"), (case.id, results[0].failures)
    assert results[0].systematic == (), case.id
    missed = []
    for entry, result in zip(wrong, results[1:]):
        if not entry.caught_on(case):
            continue
        caught = result.status == "fail" or (entry.expected == "systematic" and result.systematic)
        if not caught:
            worst = max(t.error_over_bound for t in result.candidate.tensors) if result.candidate else float("nan")
            missed.append(f"{entry.name}: {result.status}, largest error/bound {worst:.2f} {result.failures[:1]}")
    return missed


FUSED_KERNEL_LEVERS = {
    "cross-entropy-fusion": lambda: cross_entropy.cpu_tier(GEMMA, LeverOptions()),  # TP 1 and 2
    "rope-fusion": lambda: rope.cpu_tier(GEMMA, LeverOptions()) + rope.cpu_tier(QWEN3_MOE, LeverOptions()),  # BSHD, THD
    "bias-swiglu-fusion": lambda: [lever for plain in swiglu.cpu_tier(LLAMA, LeverOptions())
                                   for lever in (plain, with_bias(plain))],
    "moe-permute-fusion": lambda: permute_lever.cpu_tier(QWEN3_MOE, LeverOptions()),  # both levers
    # Llama's smaller attention changes what every mistake changes (Gemma's: 13 s, Llama's 3 s).
    "attention-softmax-precision": lambda: softmax_precision.cpu_tier(LLAMA, LeverOptions()),
}


@pytest.mark.slow(reason="every catalogue mistake of a fused kernel's lever, on each seed case it changes")
@pytest.mark.parametrize("levers", FUSED_KERNEL_LEVERS.values(), ids=FUSED_KERNEL_LEVERS.keys())
def test_each_fused_kernels_mistake_is_caught_on_every_case_it_changes(levers):
    assert_caught_on_every_case_it_changes(levers())


# The packing levers, the grouped GEMM and deterministic mode (its attention lever, on Llama's one
# small case, which changes what each mistake changes: about 6 s with oneDNN limited to AVX2, where
# Gemma's took 70 s; the reduction's mistakes are its controls); the offload's mistakes run case by
# case in the first test above.
OTHER_LEVERS = {
    "thd-packing": lambda: thd_packing.cpu_tier(NEMOTRON, LeverOptions()),  # flash and eager
    "packed-loss": lambda: packed_loss.cpu_tier(NEMOTRON, LeverOptions()),
    "moe-grouped-gemm": lambda: grouped_gemm.cpu_tier(QWEN3_MOE, LeverOptions()),
    "deterministic-mode": lambda: deterministic_mode.cpu_tier(LLAMA, LeverOptions())[:1],
}


@pytest.mark.parametrize("levers", OTHER_LEVERS.values(), ids=OTHER_LEVERS.keys())
def test_each_packing_grouped_gemm_and_determinism_mistake_is_caught_on_every_case_it_changes(levers):
    assert_caught_on_every_case_it_changes(levers())


def assert_caught_on_every_case_it_changes(levers) -> None:
    missed, declared, changed = [], set(), set()
    for lever in levers:
        declared |= {(entry.lever, entry.name) for entry in CATALOGUE if entry.lever == lever.name}
        for case in lever.cases:
            if case.skip_reason:
                continue
            changed |= {(entry.lever, entry.name) for entry in CATALOGUE
                        if entry.lever == lever.name and entry.changes(case)}
            missed += [f"{case.id}: {miss}" for miss in missed_on(lever, case)]
    assert declared and declared == changed, f"mistakes no case here changes: {sorted(declared - changed)}"
    assert not missed, missed


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


def test_the_readmes_levers_table_counts_each_levers_wrong_implementations_as_the_catalogue_declares():
    from collections import Counter
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    table = readme[readme.index("| lever | flags | evidence | CPU verdict | wrong implementations caught |"):]
    rows = [line.split(" | ") for line in table[:table.index("\n\n")].splitlines()[2:]]
    shown = {row[0].removeprefix("| "): int(row[4].split()[0]) for row in rows}
    declared = Counter(wrong.lever for wrong in CATALOGUE)
    assert shown == dict(declared) and min(declared.values()) >= 2
