"""A toy lever's records for the tests that attach, read or refuse records: row sums of BF16
values in FP32 (the candidate) against BF16 (the default) and FP64, on the Gemma recipe. Its
wording is the generic one (it is no lever of this suite)."""

from pathlib import Path

import torch
from dataclasses import dataclass

from correctness import Case, Control, Lever, Mutated, ImplementationOutput, run_case
from correctness.lever import Tier
from correctness.fixtures import recipe_path
from correctness.harness import build_record
from correctness.recipes import Recipe, load_recipe
from correctness.results import write_record
from correctness.tiers import CPU

GEMMA = "gemma-4-31b/h100/attune-tp2-pp4-split13"


@dataclass(frozen=True)
class Sum:
    """Row sums of BF16 values accumulated in `dtype`."""

    name: str
    dtype: torch.dtype

    def run(self, inputs):
        return ImplementationOutput(tensors={"sums": inputs.to(self.dtype).sum(-1).float()}, backend=self.name)


def toy_case(seed: int, **changes) -> Case:
    def make_inputs(device):
        return torch.rand(4, 64, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=torch.bfloat16)

    return Case(**{"id": f"sums-seed{seed}", "shape": "4 x 64", "seed": seed, "source": "synthetic",
                   "variant": "uniform", "make_inputs": make_inputs, **changes})


def toy_record(folder: Path, cases=None, *, run=None, name: str = "sums", recipe: Recipe | None = None,
               tier: Tier = CPU) -> Path:
    """Write the record of lever `toy-NAME` (its entry's test: "toy sums NAME") over `cases`
    (default: one seeded case), of the cases `run` (default: all), for `recipe` (default: Gemma's),
    in `tier` (default: the CPU's)."""
    candidate = Sum("fp32 sums", torch.float32)
    lever = Lever(
        name=f"toy-{name}", version=1, tier=tier, description=f"toy sums {name}",
        recipe=(recipe or load_recipe(recipe_path(GEMMA))).ref,
        cases=tuple(cases or (toy_case(0),)), candidate=candidate, default=Sum("bf16 sums", torch.bfloat16),
        reference=Sum("fp64 sums", torch.float64),
        controls=(Control(name="doubled",
                          implementation=Mutated(base=candidate, mutation="x2", mutate=lambda x: 2 * x)),),
    )
    ran = [run_case(lever, case) for case in (lever.cases if run is None else run)]
    return write_record(build_record(lever, ran, started="2026-12-01T00:00:00+00:00", seconds=1.0), folder)
