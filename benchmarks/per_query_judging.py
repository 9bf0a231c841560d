"""Per-query judging of attention, measured (issue 29): the attention levers' honest candidates
judged with a slice per query row (Slicing(block=1): one row of one head, keys for dk and dv, with
the floor the slices already use: a slice's errors are relative to the larger of its reference's
norm and the average norm of a slice of its size) or per small block of rows, in place of the
levers' 128-position blocks; and the model-like window mistakes judged the same way.

Levers (their CPU tiers, at every fixture recipe each applies to; NotApplicable ones left out):
attention-backend (cpu: SDPA's flash CPU kernel against the eager path), thd-packing (cpu: flash
and eager, each packed against itself row by row), attention-softmax-precision (megatron-cpu:
Megatron's softmax in BF16 against FP32) and deterministic-mode's attention lever (cpu: flash in
deterministic mode, three runs each as its rule asks). Every synthetic case is rebuilt at seeds
0..4 (its variant kept: model-like, window-edge, ...); the levers' negative controls are not run
(they judge the bound's power, not its false alarms), so a case's status is not read: only the
honest candidate's tensors, whole and per slice. A false alarm: a case where some slice of the
honest candidate is over its bound.

The window mistakes (correctness/wrong_implementations.py: one key too wide, one too narrow) run on
the attention-backend lever's candidate, on its model-like windowed cases (Gemma's sliding layer,
gpt-oss's), seeds 0..4, judged per query and with the lever's own 128-position slices.

Prints per block size, lever, candidate and recipe: cases x seeds, slices judged, cases with a
false alarm, and per tensor the cases with one and the largest slice error/bound; the overall
false-alarm rate; then each window mistake per case and seed: the largest error/bound per tensor,
per query and per 128-block, and whether it is caught. docs/evidence-power.md ("Per-query
judging") holds these figures.

    python benchmarks/per_query_judging.py [--json] [--blocks 1,16] [--seeds N] [--levers NAME,...]
"""

import argparse
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from correctness import LeverOptions
from correctness.attention import backend_lever as attention
from correctness.attention import softmax_precision_lever as softmax_precision
from correctness.attention import thd_packing_lever as thd_packing
from correctness.attention.inputs import synthetic_inputs
from correctness.attention.judging import SLICING
from correctness.compare import Slicing
from correctness.composites.determinism import lever as deterministic_mode
from correctness.harness import run_candidates
from correctness.lever import Case, Control, Lever, NotApplicable
from correctness.recipe_sets import GEMMA, GPT_OSS, LLAMA, MOONLIGHT, NEMOTRON, QWEN3_MOE
from correctness.wrong_implementations import CATALOGUE

RECIPES = (GEMMA, NEMOTRON, LLAMA, QWEN3_MOE, GPT_OSS, MOONLIGHT)
SEEDS = 5
BLOCKS = (1, 16)
WINDOW_MISTAKES = ("window one key too narrow", "window one key too wide")

TIERS = {
    attention.NAME: attention.cpu_tier,
    thd_packing.NAME: thd_packing.cpu_tier,
    softmax_precision.NAME: softmax_precision.cpu_tier,
    deterministic_mode.NAME: lambda recipe, options: deterministic_mode.cpu_tier(recipe, options)[:1],  # attention
}


def levers(chosen: set[str] | None) -> Iterator[tuple[str, Lever]]:
    """(recipe, lever) for each attention lever's CPU tier at every fixture recipe it applies to."""
    options = LeverOptions()
    for name, tier in TIERS.items():
        if chosen is not None and name not in chosen:
            continue
        for recipe in RECIPES:
            try:
                built = tier(recipe, options)
            except NotApplicable:
                continue
            for lever in built:
                yield recipe, lever


def reseeded(case: Case, seed: int) -> Case:
    """The synthetic case rebuilt at another seed, its variant and everything else kept."""
    shape, variant = case.shape, case.variant
    return replace(case, id=f"{case.id.rsplit('-seed', 1)[0]}-seed{seed}", seed=seed,
                   make_inputs=lambda device: synthetic_inputs(shape, seed, device, variant))


def honest_cases(lever: Lever, seeds: int) -> list[Case]:
    """Every synthetic case of the lever, one per shape and variant, at seeds 0..seeds-1."""
    distinct = {}
    for case in lever.cases:
        if case.source == "synthetic" and not case.skip_reason:
            distinct.setdefault((case.shape, case.variant), case)
    return [reseeded(case, seed) for case in distinct.values() for seed in range(seeds)]


def judged_by(lever: Lever, slicing: Slicing) -> Lever:
    """The lever with `slicing` in place of its own and no control run (one that never applies:
    a lever must declare one)."""
    idle = Control(name="not run", implementation=lever.candidate,
                   why_inapplicable=lambda case: "controls are not run when measuring false alarms")
    return replace(lever, slicing=slicing, controls=(idle,))


def tensor_figures(result) -> dict[str, dict]:
    """Per tensor: the whole tensor's error/bound, the worst slice's, where, slices and failing."""
    return {
        t.tensor: {
            "whole": t.whole_error_over_bound,
            "slice": t.slices.error_over_bound if t.slices else None,
            "worst": t.slices.worst if t.slices else None,
            "slices": t.slices.count if t.slices else 0,
            "failing": t.slices.failing if t.slices else 0,
            "error": t.slices.error if t.slices else None,
            "default_error": t.slices.default_error if t.slices else None,
            "passes": t.passes,
        }
        for t in result.candidate.tensors
    }


@dataclass
class Tally:
    """One (block, lever, candidate, recipe) row: cases run, slices judged, false alarms per tensor."""

    block: int
    lever: str
    candidate: str
    recipe: str
    cases: int = 0
    shapes: set = field(default_factory=set)
    slices: int = 0
    alarms: int = 0  # cases with any slice over its bound
    largest: float = 0.0
    tensors: dict = field(default_factory=dict)  # name -> [cases with an alarm, largest slice over, worst case]
    alarm_cases: list = field(default_factory=list)
    skipped: dict = field(default_factory=dict)  # why a case did not run (the candidate refused it)
    seconds: float = 0.0

    def add(self, case: Case, figures: dict[str, dict]) -> None:
        self.cases += 1
        self.shapes.add((case.shape, case.variant))
        alarm = False
        for name, f in figures.items():
            self.slices += f["slices"]
            over = f["slice"] if f["slice"] is not None else f["whole"]
            entry = self.tensors.setdefault(name, [0, 0.0, None])
            if f["failing"] or not f["passes"]:
                entry[0] += 1
                alarm = True
            if over > entry[1]:
                entry[1], entry[2] = over, f"{case.id}: {f['worst']}"
            self.largest = max(self.largest, over)
        if alarm:
            self.alarms += 1
            self.alarm_cases.append(case.id)

    def as_dict(self) -> dict:
        return {
            "block": self.block, "lever": self.lever, "candidate": self.candidate, "recipe": self.recipe,
            "cases": self.cases, "case_kinds": len(self.shapes), "slices": self.slices, "false_alarms": self.alarms,
            "largest_slice_over_bound": self.largest, "seconds": round(self.seconds, 1),
            "tensors": {name: {"cases_with_alarm": n, "largest": over, "where": where}
                        for name, (n, over, where) in self.tensors.items()},
            "alarm_cases": self.alarm_cases, "skipped": list(self.skipped),
        }


def false_alarms(block: int, seeds: int, chosen: set[str] | None) -> list[Tally]:
    slicing = Slicing(block=block)
    tallies = []
    for recipe, lever in levers(chosen):
        judged = judged_by(lever, slicing)
        tally = Tally(block=block, lever=lever.name, candidate=lever.candidate.name, recipe=recipe.split("/")[0])
        started = time.perf_counter()
        for case in honest_cases(judged, seeds):
            result, = run_candidates(judged, case, [judged.candidate], repeat=judged.rule.bitwise_repeatable)
            if result.candidate is None:  # the candidate refuses the case (Megatron's attention and sinks)
                tally.skipped[result.skip_reason or str(result.failures[:1])] = None
                continue
            tally.add(case, tensor_figures(result))
        tally.seconds = time.perf_counter() - started
        tallies.append(tally)
        print(f"block {block}: {lever.name} {lever.candidate.name} {tally.recipe}: {tally.cases} cases,"
              f" {tally.alarms} with a false alarm, {tally.seconds:.0f} s", file=sys.stderr, flush=True)
    return tallies


def window_mistakes(blocks: tuple[int, ...], seeds: int) -> list[dict]:
    """Each window mistake on the attention-backend lever's model-like windowed cases, per seed:
    the largest error/bound per tensor judged per query (each block size) and per 128-block."""
    rows = []
    mistakes = [entry for entry in CATALOGUE if entry.lever == attention.NAME and entry.name in WINDOW_MISTAKES]
    for recipe, lever in levers({attention.NAME}):
        windowed = [case for case in honest_cases(lever, seeds)
                    if case.variant == "model-like" and case.shape.window is not None]
        for case in windowed:
            row = {"recipe": recipe.split("/")[0], "case": case.id, "seed": case.seed, "judged": {}}
            for block in (*blocks, SLICING.block):
                judged = judged_by(lever, Slicing(block=block))
                candidates = [judged.candidate] + [entry.build(judged.candidate) for entry in mistakes]
                results = run_candidates(judged, case, candidates, repeat=False)
                per = {"honest": tensor_figures(results[0])}
                per.update({entry.name: tensor_figures(result) for entry, result in zip(mistakes, results[1:])})
                row["judged"][block] = per
            rows.append(row)
    return rows


def _worst(figures: dict[str, dict]) -> tuple[str, float]:
    name = max(figures, key=lambda n: max(figures[n]["whole"], figures[n]["slice"] or 0.0))
    return name, max(figures[name]["whole"], figures[name]["slice"] or 0.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--blocks", default=",".join(map(str, BLOCKS)), help="block sizes to judge by (rows)")
    parser.add_argument("--seeds", type=int, default=SEEDS, help="seeds per case, 0..N-1")
    parser.add_argument("--levers", help="comma-separated lever names (default: all four)")
    parser.add_argument("--no-window", action="store_true", help="leave the window mistakes out")
    args = parser.parse_args()
    blocks = tuple(int(b) for b in args.blocks.split(","))
    chosen = set(args.levers.split(",")) if args.levers else None
    started = time.perf_counter()
    tallies = [tally for block in blocks for tally in false_alarms(block, args.seeds, chosen)]
    windows = [] if args.no_window or (chosen is not None and attention.NAME not in chosen) else \
        window_mistakes(blocks, args.seeds)
    overall = {}
    for block in blocks:
        mine = [t for t in tallies if t.block == block]
        cases, alarms = sum(t.cases for t in mine), sum(t.alarms for t in mine)
        per_tensor = {}
        for t in mine:
            for name, (n, over, _) in t.tensors.items():
                entry = per_tensor.setdefault(name, [0, 0.0])
                entry[0] += n
                entry[1] = max(entry[1], over)
        overall[block] = {"cases": cases, "false_alarms": alarms, "rate": alarms / cases if cases else 0.0,
                          "tensors": {n: {"cases_with_alarm": c, "largest": o} for n, (c, o) in per_tensor.items()}}
    seconds = time.perf_counter() - started
    if args.json:
        print(json.dumps({"blocks": blocks, "seeds": args.seeds, "tallies": [t.as_dict() for t in tallies],
                          "overall": overall, "window_mistakes": windows, "seconds": round(seconds, 1)}, indent=1))
        return 0
    for block in blocks:
        print(f"\nper-query judging, block {block} ({'one query row' if block == 1 else f'{block} rows'} of one head):")
        for t in (t for t in tallies if t.block == block):
            tensors = "  ".join(f"{name} {n}/{t.cases} {over:.2f}" for name, (n, over, _) in t.tensors.items())
            print(f"  {t.lever:28} {t.candidate[:34]:34} {t.recipe:28} cases {len(t.shapes)}x{args.seeds}={t.cases:3}"
                  f"  slices {t.slices:8}  false alarms {t.alarms:3}  largest {t.largest:7.2f}  [{tensors}]"
                  f"  {t.seconds:.0f}s" + (f"  (skipped: {'; '.join(t.skipped)[:120]})" if t.skipped else ""))
        o = overall[block]
        tensors = "  ".join(f"{n} {v['cases_with_alarm']} (up to {v['largest']:.2f})" for n, v in o["tensors"].items())
        print(f"  overall: {o['false_alarms']} of {o['cases']} cases with a false alarm ({100 * o['rate']:.1f}%);"
              f" per tensor: {tensors}")
    if windows:
        print("\nwindow mistakes on model-like windowed cases (largest slice error/bound per tensor, dsink whole):")
        for row in windows:
            for name in ("honest", *WINDOW_MISTAKES):
                cells = []
                for block, per in row["judged"].items():
                    f = per[name]
                    caught = any(not x["passes"] for x in f.values())
                    detail = " ".join(f"{n} {x['slice'] if x['slice'] is not None else x['whole']:.2f}"
                                      for n, x in f.items())
                    cells.append(f"block {block}: {'FAIL' if caught else 'pass'} ({detail})")
                print(f"  {row['case'][:60]:60} {name:26} " + "; ".join(cells))
    print(f"\n{seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
