"""The levers this project defines: the version their records must carry, and how their entries
for a recipe's correctness.component_tests are worded (levers defined elsewhere get the generic
wording of correctness.entries)."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from correctness.adam_precision import lever as adam_precision
from correctness.attention import entry as attention_entry
from correctness.attention import lever as attention
from correctness.attention import packing
from correctness.attention import softmax_precision
from correctness.cross_entropy import lever as cross_entropy
from correctness.determinism import lever as determinism
from correctness.fp8 import lever as fp8
from correctness.grad_accumulation import lever as grad_accumulation
from correctness.loss import packing as packed_loss
from correctness.mlp import lever as swiglu
from correctness.moe import grouped_gemm_lever as grouped_gemm
from correctness.moe import permute_lever as permute
from correctness.optimizer import entry as offload_entry
from correctness.optimizer import lever as offload
from correctness.reduction import lever as reduction
from correctness.rope import lever as rope
from correctness.router import lever as router


RECIPE_GPU = "recipe-gpu"  # in `tiers`: the recipe's own GPU's tier (h100, h200: correctness.tiers)


@dataclass(frozen=True, kw_only=True)
class KnownLever:
    name: str
    version: int
    # The tiers its component tests run in (correctness.tiers names; RECIPE_GPU for the recipe GPU's
    # own); a test holds them equal to what the component tests build.
    tiers: tuple[str, ...]
    # entry_text(record) -> {shape, detail, note}; None: the generic wording
    entry_text: Callable[[Any], dict[str, str]] | None = None


KNOWN_LEVERS = {
    lever.name: lever
    for lever in (
        KnownLever(name=attention.NAME, version=attention.VERSION, tiers=("cpu", "gpu", RECIPE_GPU),
                   entry_text=attention_entry.entry_text),
        KnownLever(name=offload.NAME, version=offload.VERSION, tiers=("cpu", "megatron-cpu", "megatron", RECIPE_GPU),
                   entry_text=offload_entry.entry_text),
        KnownLever(name=packing.NAME, version=packing.VERSION, tiers=("cpu", "gpu", RECIPE_GPU)),
        KnownLever(name=packed_loss.NAME, version=packed_loss.VERSION, tiers=("cpu", "gpu")),
        KnownLever(name=softmax_precision.NAME, version=softmax_precision.VERSION, tiers=("megatron-cpu", "gpu")),
        KnownLever(name=reduction.NAME, version=reduction.VERSION, tiers=("cpu", "gpu")),
        KnownLever(name=cross_entropy.NAME, version=cross_entropy.VERSION,
                   tiers=("megatron-cpu", "megatron", RECIPE_GPU)),
        KnownLever(name=determinism.NAME, version=determinism.VERSION, tiers=("cpu", "gpu", RECIPE_GPU)),
        KnownLever(name=swiglu.NAME, version=swiglu.VERSION, tiers=("megatron-cpu", "megatron")),
        KnownLever(name=router.NAME, version=router.VERSION, tiers=("megatron-cpu", "megatron")),
        KnownLever(name=grouped_gemm.NAME, version=grouped_gemm.VERSION, tiers=("megatron-cpu", RECIPE_GPU)),
        KnownLever(name=permute.EXACT_NAME, version=permute.VERSION, tiers=("megatron-cpu", RECIPE_GPU)),
        KnownLever(name=permute.SUMS_NAME, version=permute.VERSION, tiers=("megatron-cpu", RECIPE_GPU)),
        KnownLever(name=rope.NAME, version=rope.VERSION, tiers=("megatron-cpu", RECIPE_GPU)),
        KnownLever(name=fp8.NAME, version=fp8.VERSION, tiers=("cpu", RECIPE_GPU)),
        KnownLever(name=adam_precision.NAME, version=adam_precision.VERSION, tiers=("cpu", RECIPE_GPU)),
        KnownLever(name=grad_accumulation.NAME, version=grad_accumulation.VERSION, tiers=("megatron-cpu", "megatron")),
    )
}


def known_lever(name: str) -> KnownLever | None:
    """The lever of this project of that name, or None for a lever defined elsewhere."""
    return KNOWN_LEVERS.get(name)
