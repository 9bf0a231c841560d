"""The levers this project defines: the version their records must carry, and how their entries
for a recipe's correctness.component_tests are worded (levers defined elsewhere get the generic
wording of correctness.entries)."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from correctness.attention import entry as attention_entry
from correctness.attention import lever as attention
from correctness.attention import packing
from correctness.loss import packing as packed_loss
from correctness.optimizer import entry as offload_entry
from correctness.optimizer import lever as offload


@dataclass(frozen=True, kw_only=True)
class KnownLever:
    name: str
    version: int
    # entry_text(record) -> {shape, detail, note}; None: the generic wording
    entry_text: Callable[[Any], dict[str, str]] | None = None


KNOWN_LEVERS = {
    lever.name: lever
    for lever in (
        KnownLever(name=attention.NAME, version=attention.VERSION, entry_text=attention_entry.entry_text),
        KnownLever(name=offload.NAME, version=offload.VERSION, entry_text=offload_entry.entry_text),
        KnownLever(name=packing.NAME, version=packing.VERSION),
        KnownLever(name=packed_loss.NAME, version=packed_loss.VERSION),
    )
}


def known_lever(name: str) -> KnownLever | None:
    """The lever of this project of that name, or None for a lever defined elsewhere."""
    return KNOWN_LEVERS.get(name)
