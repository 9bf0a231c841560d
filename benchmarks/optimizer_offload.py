"""Time and peak memory of the optimizer-offload lever at the recipe's scale on this machine.

Runs the lever's CPU tier (every path on the CPU, the GPU share on the eager AdamW with TE
FusedAdam's arithmetic) on the Gemma-4-31B recipe's full slices: 21 tensors, 556,051,968
parameters, three steps, the FP64 reference and the FP32-hyperparameter reference, streamed one
block of rows at a time. Goal: peak memory under 12 GB and the run under 10 minutes on 2 cores.

    python benchmarks/optimizer_offload.py [--scale recipe|smoke] [--results-dir DIR]
"""

import argparse
import json
import resource
import sys
import time
from dataclasses import replace
from pathlib import Path

from correctness.harness import run_lever
from correctness.lever import LeverOptions
from correctness.optimizer import lever as offload
from correctness.megatron.layout import PARAM_SCALES
from correctness.report import verdict_table
from correctness.results import write_record

RECIPE = "gemma-4-31b/h100/attune-tp2-pp4-split13"
GOALS = {"peak_gb": 12.0, "seconds": 600.0}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", choices=sorted(PARAM_SCALES), default="recipe")
    parser.add_argument("--results-dir", type=Path, default=None, help="also write the lever record there")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()

    (lever,) = offload.cpu_tier(RECIPE, LeverOptions(), scale=PARAM_SCALES[args.scale])
    synthetic = tuple(case for case in lever.cases if case.source == "synthetic")
    lever = replace(lever, cases=synthetic)
    start = time.perf_counter()
    record = run_lever(lever)
    seconds = time.perf_counter() - start
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is in KiB on Linux
    (case,) = record.cases
    figures = {
        "scale": args.scale,
        "tensors": case.shape["tensors"],
        "parameters": case.shape["parameters"],
        "gpu_share": case.shape["gpu_share"],
        "verdict": record.verdict,
        "seconds": round(seconds, 1),
        "peak_gb": round(peak_gb, 2),
        "path_seconds": {
            "reference": round(case.reference.seconds, 1),
            "default": round(case.default.seconds, 1),
            "candidate": round(case.candidate.run.seconds, 1),
            "secondary_reference": round(case.secondary[0].run.seconds, 1),
        },
        "goals_met": {"peak_gb": peak_gb <= GOALS["peak_gb"], "seconds": seconds <= GOALS["seconds"]},
    }
    if args.results_dir:
        figures["record"] = str(write_record(record, args.results_dir))
    if args.json:
        print(json.dumps(figures, indent=1))
    else:
        print("\n".join(verdict_table(record)))
        for key, value in figures.items():
            print(f"{key}: {value}")
    return 0 if record.verdict == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
