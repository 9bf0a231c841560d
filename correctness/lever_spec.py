"""A lever's one declaration (`LeverSpec`), in the lever's own module.

A spec says what the lever is (name, version, the description a recipe's component_tests entry
carries, the title patterns that entry is recognised by), what the suite claims for it (its
evidence), what of a recipe it reads, how its entry is worded, and its component tests: one
`TierTest` per tier, a factory run at the fixture recipes it names. The registry
(`correctness.registry`) is the list of specs. A lever's component tests are generated from its spec
(`correctness.spec_tests`, in its module of component_tests/), and so is the catalogue the recipe commands read
(`correctness/rules/levers.yaml`, `correctness.catalogue`)."""

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from correctness.catalogue import DEFAULT_READS
from correctness.evidence import Evidence
from correctness.lever import Lever, LeverOptions
from correctness.recipe_sets import SEEDS

RECIPE_GPU = "recipe-gpu"  # a tier: the recipe's own GPU's (h100, h200: correctness.tiers)

# The recipe's fields a lever's case shapes come from: one row of tokens, rows per microbatch (and
# whether dynamic batching packs them), and the training precision.
SHAPE_READS = (*DEFAULT_READS, "layout.rows_per_microbatch", "--use-dynamic-batch-size", "workload.precision",
               "workload.row_tokens")
EXPERT_LAYOUT = ("layout.ep", "layout.etp")
DATA_PARALLEL = ("layout.dp", *EXPERT_LAYOUT)
OPTIMIZER_READS = (
    *DEFAULT_READS, *EXPERT_LAYOUT, "--optimizer", "--optimizer-cpu-offload", "--optimizer-offload-fraction",
    "--overlap-cpu-optimizer-d2h-h2d", "--adam-beta1", "--adam-beta2", "--adam-eps", "--weight-decay", "--clip-grad",
    "--lr", "--min-lr", "--lr-decay-style", "--lr-warmup-fraction", "--global-batch-size", "--num-rollout",
)
GRADIENT_SYNC = ("--grad-reduce-in-bf16", "--ddp-average-in-collective", "--calculate-per-token-loss",
                 "--use-distributed-optimizer", "--use-precision-aware-optimizer", "--optimizer-cpu-offload")

TierFactory = Callable[[str, LeverOptions], list[Lever]]


@dataclass(frozen=True, kw_only=True)
class TierTest:
    """One component test: the tier's factory at each of `recipes` (fixture recipe ids; with --recipe
    the user's recipe stands for each)."""

    test: str  # the test function's name
    tier: str  # a correctness.tiers name, or RECIPE_GPU
    factory: TierFactory
    recipes: tuple[str, ...] = SEEDS
    doc: str = ""


@dataclass(frozen=True, kw_only=True)
class LeverSpec:
    name: str
    version: int  # a record of another version is refused
    # The component_tests entry's `test:` words, and the patterns (regular expressions, searched
    # case-insensitively) an entry's title is recognised by as this lever's (correctness.classify).
    description: str
    titles: tuple[str, ...]
    tests: tuple[TierTest, ...]
    # The strongest evidence its tiers give without a GPU record (correctness.evidence), and where an
    # argument of it has other evidence (a flag no CPU tier reaches), that argument's.
    evidence: Evidence
    argument_evidence: Mapping[str, Evidence] = field(default_factory=dict)
    # The recipe's arguments its factories read (run-script flags, "--name", and dotted recipe
    # fields): a record carries their values, and attaches only to a recipe with the same ones.
    # tests/test_recipe_binding.py holds every factory's reads within these.
    reads: tuple[str, ...] = DEFAULT_READS
    # entry_text(record) -> {shape, detail, note}, from a module of correctness.wording; None: the
    # generic wording of correctness.entries
    entry_text: Callable[[Any], dict[str, str]] | None = None

    @property
    def tiers(self) -> tuple[str, ...]:
        """The tiers its component tests run in, in its tests' order; a test holds them equal to the
        tiers the factories build (tests/test_levers_command.py)."""
        return tuple(dict.fromkeys(test.tier for test in self.tests))
