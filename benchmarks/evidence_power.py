"""What the evidence catches, measured: every wrong implementation of the catalogue
(correctness/wrong_implementations.py) run as a candidate through the CPU tiers, built on the
real candidate (torch SDPA's flash CPU kernel for attention, the offload split for the optimizer),
with run_candidates (the reference, the default and the controls computed once per case).

Prints, per wrong implementation and case: the verdict, the largest error/bound of the whole
tensors, of the slices, the systematic diagnostic's largest |slope| or |offset| over its threshold,
and whether an invariant broke. The honest candidate is judged beside them: it must pass with
nothing flagged. docs/evidence-power.md ("What the bound cannot see") holds these figures.

    python benchmarks/evidence_power.py [--json]
"""

import argparse
import json
import sys
import time

from correctness import LeverOptions
from correctness.attention import backend_lever as attention
from correctness.attention.sdpa import Sdpa
from correctness.harness import run_candidates
from correctness.optimizer import lever as offload
from correctness.wrong_implementations import CATALOGUE

GEMMA = "gemma-4-31b/h100/attune-tp2-pp4-split13"
NEMOTRON = "nemotron-3-super-120b-a12b/h200/attune-tp4-pp2-ep8-mt16k"


def levers():
    yield "attention-backend", attention.cpu_tier(GEMMA, LeverOptions(), candidate=Sdpa("flash"))[0]
    for recipe in (GEMMA, NEMOTRON):
        yield "optimizer-offload", offload.cpu_tier(recipe, LeverOptions())[0]


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
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows, honest_ok = [], True
    for name, lever in levers():
        for case in lever.cases:
            if case.skip_reason:
                continue
            wrong = [entry for entry in CATALOGUE if entry.lever == name and entry.changes(case)]
            start = time.perf_counter()
            results = run_candidates(lever, case, [lever.candidate] + [e.build(lever.candidate) for e in wrong],
                                     repeat=False)
            seconds = time.perf_counter() - start
            honest = figures(results[0])
            honest_ok &= honest["status"] == "pass" and not honest["flagged"]
            rows.append({"case": case.id, "implementation": f"honest ({lever.candidate.name})", **honest,
                         "claimed": False, "seconds": seconds})
            for entry, result in zip(wrong, results[1:]):
                rows.append({"case": case.id, "implementation": entry.name, **figures(result),
                             "claimed": entry.caught_on(case)})
    if args.json:
        print(json.dumps({"rows": rows, "honest_pass": honest_ok}, indent=1))
    else:
        for row in rows:
            flags = ",".join(row["flagged"]) or "-"
            print(f"{row['implementation'][:48]:48}  {row['case'][:58]:58}  {row['status']:5}  whole {row['whole']:8.2f}"
                  f"  slices {row['slices']:9.2f}  systematic {row['systematic']:6.2f} ({flags})"
                  f"  invariant {'BROKEN' if row['invariant_broken'] else 'held'}{'  claimed' if row['claimed'] else ''}")
        print(f"honest candidates pass with nothing flagged: {'yes' if honest_ok else 'NO'}")
    return 0 if honest_ok else 1


if __name__ == "__main__":
    sys.exit(main())
