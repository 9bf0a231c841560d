"""A toy lever's records for the tests that attach, read or refuse records: row sums of BF16
values in FP32 (the candidate) against BF16 (the default) and FP64, on the Gemma recipe. Its
wording is the generic one (it is no lever of this suite). A reader rebuilds a record's
declaration from the lever's spec (correctness.declaration): `toy_spec` is the toy lever's, and the
tests' conftest lets the registry find it (`known_toy`), as the lever built last for its name."""

import contextlib
import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from correctness import Case, Control, Lever, Mutated, ImplementationOutput, run_case
from correctness.evidence import Evidence
from correctness.lever import LeverOptions, NotApplicable, Tier, declaration_only
from correctness.lever_spec import LeverSpec, TierTest
from correctness.fixtures import recipe_path
from correctness.harness import build_record
from correctness.recipes import Recipe, load_recipe
from correctness.results import record_to_json as record_json, write_record
from correctness.tiers import CPU

GEMMA = "gemma-4-31b/h100/attune-tp2-pp4-split13"
NEMOTRON = "nemotron-3-super-120b-a12b/h200/attune-tp4-pp2-ep8-mt16k"


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
    TOY_LEVERS[lever.record_id] = lever
    ran = [run_case(lever, case) for case in (lever.cases if run is None else run)]
    return write_record(build_record(lever, ran, started="2026-12-01T00:00:00+00:00", seconds=1.0), folder)


TOY_LEVERS: dict[str, Lever] = {}  # record id -> the toy lever toy_record built last with it


def toy_spec(levers: list[Lever]) -> LeverSpec:
    """The spec that declares a toy lever (its tiers' levers): one test builds them for the recipe a
    reader gives."""

    def tier(recipe_id, options):
        return [replace(lever, recipe=options.recipe.ref) if options.recipe is not None else lever for lever in levers]

    first = levers[0]
    return LeverSpec(name=first.name, version=first.version, description=first.description, titles=(first.description,),
                     tests=(TierTest(test=f"test_{first.name}", tier=first.tier.name, factory=tier),),
                     evidence=Evidence(klass="stand-in", tier=first.tier.name, what="a toy lever of the tests"))


def known_toy(name: str) -> LeverSpec | None:
    levers = [lever for lever in TOY_LEVERS.values() if lever.name == name]
    return toy_spec(levers) if levers else None


H100 = {"type": "cuda", "name": "NVIDIA H100 80GB HBM3", "gpu_type": "H100", "capability": "9.0", "memory_gb": 79.2,
        "index": 0}


def declared_record(folder: Path, lever: str, tier: str, recipe_id: str = GEMMA, *, description: str | None = None,
                    wrong: bool = False, device: dict | None = None, finished: str = "2026-12-02T10:00:00+00:00") -> Path:
    """A record of this suite's `lever` in `tier` for the fixture recipe, with the declaration the suite
    builds for it (cases, shapes, controls, rule, format floor: what a reader rebuilds) and the toy's
    arithmetic in each of its paths, their names kept; written as the tier's device would write it
    (a CUDA tier's on an H100, `device`). `wrong`: the candidate doubles its sums, and fails. For
    the tests of what readers make of a record (the toy's sums are judged whole; its invariants hold)."""
    from correctness.declaration import tier_levers
    from correctness.recipe_sets import at_recipes
    from correctness.registry import KNOWN_LEVERS

    spec = KNOWN_LEVERS[lever]
    options = LeverOptions(recipe=load_recipe(recipe_path(recipe_id)))
    with declaration_only():
        built = []
        for test in spec.tests:
            with contextlib.suppress(NotApplicable):
                built += [one for one in tier_levers(at_recipes(test.factory, test.recipes), options)
                          if one.tier.name == tier and (description is None or one.description == description)]
        declared = built[0]
        candidate = _DeclaredPath(declared.candidate.name, torch.float32, scale=2.0 if wrong else 1.0,
                                  runs_expected=True, default=declared.default.name)
        toy = replace(
            declared, tier=Tier(name=tier, device="cpu"), candidate=candidate,
            default=_DeclaredPath(declared.default.name, torch.bfloat16),
            reference=_DeclaredPath(declared.reference.name, torch.float64),
            controls=tuple(replace(control, implementation=_DeclaredPath(f"{control.name}", torch.float32, scale=3.0))
                           for control in declared.controls),
            cases=tuple(replace(case, make_inputs=_declared_inputs(case)) for case in declared.cases),
            secondary_references=tuple(_DeclaredPath(path.name, torch.float64) for path in declared.secondary_references),
            format_floor=None if declared.format_floor is None else replace(
                declared.format_floor, implementation=_DeclaredPath(declared.format_floor.implementation.name,
                                                                    torch.bfloat16)),
            invariants=tuple(replace(invariant, check=lambda inputs, tensors: None) for invariant in declared.invariants),
            summarize=None, known_failure=None,
        )
    ran = [run_case(toy, case) for case in toy.cases]
    data = json.loads(json.dumps(record_json(build_record(toy, ran, started=finished, seconds=1.0))))
    data["finished"] = finished
    if declared.tier.device == "cuda":
        data["lever"] |= {"device": "cuda", "scale": None}
        data["provenance"]["device"] = device or H100
    return write_record(data, folder)


@dataclass(frozen=True)
class _DeclaredPath:
    """A declared path's name over the toy's sums (scaled by `scale`); `runs_expected`: it runs the
    backend the recipe says the case runs, as the candidate must (the default's own sums where that
    is the default's kernel)."""

    name: str
    dtype: torch.dtype
    scale: float = 1.0
    runs_expected: bool = False
    default: str | None = None  # the default's name: where the case's backend is the default's, its BF16 sums

    def run(self, inputs):
        values, expected = inputs
        dtype = torch.bfloat16 if self.runs_expected and expected is not None and expected == self.default else self.dtype
        sums = self.scale * values.to(dtype).sum(-1).float()
        return ImplementationOutput(tensors={"sums": sums}, backend=expected if self.runs_expected and expected else self.name)


def _declared_inputs(case: Case):
    toy = toy_case(case.seed or 0).make_inputs
    return lambda device: (toy(device), case.expected_backend)


def partial_record(lever: Lever, variant: str):
    """The lever's record with only its cases of one variant run, the others skipped: a record of
    every case its lever declares, as the suite writes one (`incomplete` where a skipped case is
    required)."""
    from correctness.harness import not_run

    cases = [run_case(lever, case) if case.variant == variant else not_run(case, "left out by this test")
             for case in lever.cases]
    return build_record(lever, cases, started="2026-12-01T00:00:00+00:00", seconds=1.0)
