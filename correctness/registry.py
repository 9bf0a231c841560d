"""The levers this project defines: the list of their specs (correctness.lever_spec), each in its
lever's own module. The component tests (component_tests/, a module per lever made from its spec) and the catalogue the recipe
commands read (correctness/rules/levers.yaml, correctness.catalogue) are generated from it:

    python -m correctness.registry     # rewrites the catalogue after a spec changed

tests/test_catalogue.py holds the catalogue equal to the specs."""

import sys
from pathlib import Path

from correctness.adam_precision import lever as adam_precision
from correctness.attention import backend_lever as attention
from correctness.attention import softmax_precision_lever as softmax_precision
from correctness.attention import thd_packing_lever as packing
from correctness.catalogue import CATALOGUE, catalogue_text
from correctness.composites.determinism import lever as determinism
from correctness.cross_entropy import lever as cross_entropy
from correctness.fp8 import lever as fp8
from correctness.grad_accumulation import lever as grad_accumulation
from correctness.grad_reduction import lever as reduction
from correctness.lever_spec import LeverSpec
from correctness.loss import lever as packed_loss
from correctness.moe import grouped_gemm_lever as grouped_gemm
from correctness.moe import permute_lever as permute
from correctness.optimizer import lever as offload
from correctness.rope import lever as rope
from correctness.router import lever as router
from correctness.swiglu import lever as swiglu

LEVER_SPECS: tuple[LeverSpec, ...] = (
    attention.SPEC, offload.SPEC, packing.SPEC, packed_loss.SPEC, softmax_precision.SPEC, reduction.SPEC,
    cross_entropy.SPEC, determinism.SPEC, swiglu.SPEC, router.SPEC, grouped_gemm.SPEC, permute.EXACT_SPEC,
    permute.SUMS_SPEC, rope.SPEC, fp8.SPEC, adam_precision.SPEC, grad_accumulation.SPEC,
)
KNOWN_LEVERS = {spec.name: spec for spec in LEVER_SPECS}


def known_lever(name: str) -> LeverSpec | None:
    """The lever of this project of that name, or None for a lever defined elsewhere."""
    return KNOWN_LEVERS.get(name)


def write_catalogue(path: Path = CATALOGUE) -> Path:
    path.write_text(catalogue_text(LEVER_SPECS))
    return path


if __name__ == "__main__":
    print(f"wrote {write_catalogue(Path(sys.argv[1]) if len(sys.argv) > 1 else CATALOGUE)}")
