"""What the evidence catches, measured: every wrong implementation of the catalogue
(correctness/wrong_implementations.py) run as a candidate through the CPU tiers, built on the
real candidate (torch SDPA's flash CPU kernel for attention, the offload split for the optimizer,
each fused kernel's lever's own candidate: cross entropy at Gemma and Nemotron, RoPE at Gemma (BSHD)
and Qwen3-MoE (THD), SwiGLU at Llama without and with fc1's bias, the MoE permutation at Nemotron
and Qwen3-MoE, the softmax's precision at Gemma, THD packing (flash and eager) and the packed loss
at Nemotron, the grouped GEMM at Nemotron and Qwen3-MoE, deterministic mode's attention at Gemma, each
candidate run three times there as its rule asks), with run_candidates (the reference, the default
and the controls computed once per case). `--levers a,b` runs those levers only.

Prints, per wrong implementation and case: the verdict, the largest error/bound of the whole
tensors, of the slices, the systematic diagnostic's largest |slope| or |offset| over its threshold,
and whether an invariant broke. The honest candidate is judged beside them: it must pass with
nothing flagged. docs/evidence-power.md ("What the bound cannot see") holds these figures.

    python benchmarks/evidence_power.py [--json] [--levers NAME,...]
"""

import argparse
import json
import sys
import time

from correctness import LeverOptions
from correctness.attention import backend_lever as attention
from correctness.attention import softmax_precision_lever as softmax_precision
from correctness.attention import thd_packing_lever as thd_packing
from correctness.attention.sdpa import Sdpa
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


def levers():
    options = LeverOptions()
    yield attention.cpu_tier(GEMMA, options, candidate=Sdpa("flash"))[0]
    for recipe in (GEMMA, NEMOTRON):
        yield offload.cpu_tier(recipe, options)[0]
    for recipe in (GEMMA, NEMOTRON):
        yield from cross_entropy.cpu_tier(recipe, options)
    for recipe in (GEMMA, QWEN3_MOE):
        yield from rope.cpu_tier(recipe, options)
    plain = swiglu.cpu_tier(LLAMA, options)[0]
    yield from (plain, with_bias(plain))
    for recipe in (NEMOTRON, QWEN3_MOE):
        yield from permute_lever.cpu_tier(recipe, options)
    yield from softmax_precision.cpu_tier(GEMMA, options)
    yield from thd_packing.cpu_tier(NEMOTRON, options)  # SDPA's flash CPU kernel and the eager path
    yield from packed_loss.cpu_tier(NEMOTRON, options)
    for recipe in (NEMOTRON, QWEN3_MOE):
        yield from grouped_gemm.cpu_tier(recipe, options)
    yield deterministic_mode.cpu_tier(GEMMA, options)[0]  # its attention lever (the reduction's are its controls)


def _over(t) -> float:
    return max(t.systematic.over_threshold, t.slices.systematic.over_threshold if t.slices else 0.0)


def figures(result) -> dict:
    """The figures of one judged candidate; its systematic figure is, per tensor, the smallest over
    the reference and the secondary references (a slope one of them explains is not flagged)."""
    tensors = result.candidate.tensors
    secondary = [{t.tensor: t for t in judgement.tensors} for judgement in result.secondary]
    systematic = max(min([_over(t)] + [_over(other[t.tensor]) for other in secondary]) for t in tensors)
    return {
        "status": result.status,
        "whole": max(t.whole_error_over_bound for t in tensors),
        "slices": max(t.error_over_bound for t in tensors),
        "systematic": systematic,
        "flagged": list(result.systematic),
        "invariant_broken": any("breaks the invariant" in failure for failure in result.failures),
        "not_repeatable": any("not bitwise repeatable" in failure for failure in result.failures),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--levers", help="comma-separated lever names (default: every lever above)")
    args = parser.parse_args()
    chosen = set(args.levers.split(",")) if args.levers else None
    rows, honest_ok = [], True
    for lever in levers():
        if chosen is not None and lever.name not in chosen:
            continue
        for case in lever.cases:
            if case.skip_reason:
                continue
            wrong = [entry for entry in CATALOGUE if entry.lever == lever.name and entry.changes(case)]
            start = time.perf_counter()
            results = run_candidates(lever, case, [lever.candidate] + [e.build(lever.candidate) for e in wrong],
                                     repeat=lever.rule.bitwise_repeatable)
            seconds = time.perf_counter() - start
            honest = figures(results[0])
            honest_ok &= honest["status"] == "pass" and not honest["flagged"]
            rows.append({"lever": lever.name, "case": case.id, "implementation": f"honest ({lever.candidate.name})",
                         **honest, "claimed": False, "seconds": seconds})
            for entry, result in zip(wrong, results[1:]):
                rows.append({"lever": lever.name, "case": case.id, "implementation": entry.name, **figures(result),
                             "claimed": entry.caught_on(case)})
    if args.json:
        print(json.dumps({"rows": rows, "honest_pass": honest_ok}, indent=1))
    else:
        for row in rows:
            flags = ",".join(row["flagged"]) or "-"
            invariant = "BROKEN" if row["invariant_broken"] else "held"
            print(f"{row['implementation'][:48]:48}  {row['case'][:58]:58}  {row['status']:5}"
                  f"  whole {row['whole']:8.2f}  slices {row['slices']:9.2f}"
                  f"  systematic {row['systematic']:6.2f} ({flags})  invariant {invariant}"
                  f"{'  NOT REPEATABLE' if row['not_repeatable'] else ''}{'  claimed' if row['claimed'] else ''}")
        print(f"honest candidates pass with nothing flagged: {'yes' if honest_ok else 'NO'}")
    return 0 if honest_ok else 1


if __name__ == "__main__":
    sys.exit(main())
