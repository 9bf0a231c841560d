"""The levers this project defines: the version their records must carry, and the module that words
their entries for a recipe's correctness.component_tests (levers defined elsewhere get the
generic wording of correctness.entries)."""

from dataclasses import dataclass

from correctness.attention import lever as attention
from correctness.attention import packing
from correctness.loss import packing as packed_loss
from correctness.optimizer import lever as offload


@dataclass(frozen=True, kw_only=True)
class KnownLever:
    name: str
    version: int
    wording: str | None = None  # module with entry_text(record) -> {shape, detail, note}; None: generic


KNOWN_LEVERS = {
    lever.name: lever
    for lever in (
        KnownLever(name=attention.NAME, version=attention.VERSION, wording="correctness.attention.entry"),
        KnownLever(name=offload.NAME, version=offload.VERSION, wording="correctness.optimizer.entry"),
        KnownLever(name=packing.NAME, version=packing.VERSION),
        KnownLever(name=packed_loss.NAME, version=packed_loss.VERSION),
    )
}
