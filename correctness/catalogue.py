"""The catalogue of this suite's levers: what the recipe commands (classify, check, attach, the
pytest plugin's --levers) need of each lever's spec, as data, so that none of them imports a lever
kind. It is generated from the specs (`python -m correctness.registry`) into
correctness/rules/levers.yaml, and tests/test_catalogue.py holds it equal to them."""

from collections.abc import Iterable
from typing import TYPE_CHECKING
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import yaml

from correctness.errors import CorrectnessError

if TYPE_CHECKING:  # the specs import torch; reading the catalogue must not (correctness levers, classify)
    from correctness.lever_spec import LeverSpec

# What a lever of another project reads, as far as this suite can tell: the model, the GPU and the TP
# size its shapes are usually split by.
DEFAULT_READS = ("model", "gpu.type", "layout.tp")

CATALOGUE = Path(__file__).resolve().parent / "rules" / "levers.yaml"
HEADER = ("# Generated from the levers' specs by `python -m correctness.registry`: do not edit; edit the spec\n"
          "# (SPEC in the lever's module) and run it again.\n")


@dataclass(frozen=True, kw_only=True)
class CataloguedLever:
    name: str
    version: int
    description: str
    titles: tuple[str, ...]  # regular expressions a component_tests entry's title is recognised by
    reads: tuple[str, ...]
    wording: str | None  # the correctness.wording module with its entry_text, or None: the generic wording


def catalogue_entry(spec: "LeverSpec") -> dict:
    return {"version": spec.version, "description": spec.description, "titles": list(spec.titles),
            "reads": list(spec.reads), "wording": spec.entry_text.__module__ if spec.entry_text else None}


def catalogue_text(specs: Iterable["LeverSpec"]) -> str:
    data = {"levers": {spec.name: catalogue_entry(spec) for spec in specs}}
    return HEADER + yaml.safe_dump(data, sort_keys=False, width=120, allow_unicode=True)


@cache
def lever_catalogue() -> dict[str, CataloguedLever]:
    try:
        data = yaml.safe_load(CATALOGUE.read_text(encoding="utf-8"))
        return {name: CataloguedLever(name=name, version=entry["version"], description=entry["description"],
                                      titles=tuple(entry["titles"]), reads=tuple(entry["reads"]),
                                      wording=entry["wording"])
                for name, entry in data["levers"].items()}
    except (OSError, yaml.YAMLError, KeyError, TypeError, AttributeError) as error:
        raise CorrectnessError(f"the lever catalogue {CATALOGUE} cannot be read ({error}): reinstall the package or"
                               " run `python -m correctness.registry`") from None


def catalogued(name: str) -> CataloguedLever | None:
    """The lever of this suite of that name, or None for a lever defined elsewhere."""
    return lever_catalogue().get(name)


def lever_reads(name: str) -> tuple[str, ...]:
    """The recipe arguments a lever reads: its spec's, DEFAULT_READS for another project's lever."""
    lever = catalogued(name)
    return lever.reads if lever is not None else DEFAULT_READS
