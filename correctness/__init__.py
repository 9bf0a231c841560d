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

from correctness.errors import CorrectnessError, ImplementationUnavailable
from correctness.compare import Slicing
from correctness.harness import run_candidates, run_case, run_lever
from correctness.lever import Case, Control, Invariant, Lever, LeverOptions, Mutated, ImplementationOutput, Tier
from correctness.lever_spec import LeverSpec, TierTest
from correctness.results import RecipeRef, read_record, write_record
from correctness.rule import DEFAULT_RULE, Rule

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
