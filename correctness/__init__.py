"""Numerical-correctness component tests for tuned training recipes.

The public API for declaring and running a lever:

    Lever, Tier, Case, Control, Invariant, Mutated, ImplementationOutput, LeverOptions, RecipeRef,
    Slicing  (declarations)
    LeverSpec, TierTest: a lever's one declaration; correctness.spec_tests.component_tests makes its tests
    Rule, DEFAULT_RULE                                                  (the pass rule)
    correctness.tiers: CPU, GPU, MEGATRON_CPU, TE_CPU, MEGATRON_GPU, recipe_gpu_tier  (the suite's tiers)
    run_case, run_candidates, run_lever, write_record, read_record      (running, records)

pytest users load `correctness.pytest_plugin` from their conftest.py.
"""

import importlib

# Each name's module, imported when the name is first used (PEP 562): `import correctness.cli` (the
# command line's --help) imports no torch.
_HOMES = {
    "CorrectnessError": "correctness.errors", "ImplementationUnavailable": "correctness.errors",
    "Slicing": "correctness.compare",
    "run_candidates": "correctness.harness", "run_case": "correctness.harness", "run_lever": "correctness.harness",
    "Case": "correctness.lever", "Control": "correctness.lever", "Invariant": "correctness.lever",
    "Lever": "correctness.lever", "LeverOptions": "correctness.lever", "Mutated": "correctness.lever",
    "ImplementationOutput": "correctness.lever", "Tier": "correctness.lever",
    "LeverSpec": "correctness.lever_spec", "TierTest": "correctness.lever_spec",
    "RecipeRef": "correctness.results", "read_record": "correctness.results", "write_record": "correctness.results",
    "DEFAULT_RULE": "correctness.rule", "Rule": "correctness.rule",
}


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'correctness' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])


__all__ = [
    "DEFAULT_RULE",
    "Case",
    "Control",
    "CorrectnessError",
    "Invariant",
    "Lever",
    "LeverOptions",
    "LeverSpec",
    "Mutated",
    "ImplementationOutput",
    "ImplementationUnavailable",
    "RecipeRef",
    "Rule",
    "Slicing",
    "Tier",
    "TierTest",
    "read_record",
    "run_candidates",
    "run_case",
    "run_lever",
    "write_record",
]
