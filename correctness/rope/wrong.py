"""Wrong RoPEs, each Megatron's unfused `apply_rotary_pos_emb` (the lever's candidate) given the
wrong frequencies or pairing, to show what the lever's evidence catches (tests/test_evidence_power.py,
benchmarks/evidence_power.py, docs/evidence-power.md).

- Rotate-half where the model pairs adjacent dims (interleaved), or the reverse: the frequencies
  laid out and the dims paired the other way, as a port that takes one convention for the other
  would. It computes what the lever's "other pairing" control does: a realistic mistake that the
  lever already holds a control for.
- Positions offset by a packed row's start: in THD, each token rotated by its index in the packed
  buffer instead of its position in its own row (the rows after the first start past 0), as a
  kernel given the buffer's positions rather than `cu_seqlens` would. It computes what the "positions
  run across packed rows" control does; it changes nothing in BSHD or on a single packed row.
- Theta from another layer kind: the frequencies made with the rotary base of another of the
  model's RoPE kinds (Gemma 4: the global layers' 1,000,000 on the sliding layers, whose base is
  10,000, and the reverse), as an implementation that reads one `rope_theta` for every layer would.
  It changes only the kinds of a model whose RoPE kinds differ in base; the other bases are the
  suite's own facts of the shape's model (correctness.models: fixtures/models, fixtures/configs).
"""

import functools

from correctness.lever import Case, Implementation, Mutated, WrongImplementation
from correctness.models import CONFIGS_DIR, MODELS_DIR, load_facts
from correctness.rope.lever import NAME, other_pairing, rows_as_one
from correctness.rope.paths import RopeInputs, megatron_freqs
from correctness.rope.shapes import RopeShape

OTHER_PAIRING = "rotate-half and interleaved pairing exchanged"
ROW_START_OFFSET = "positions offset by a packed row's start"
OTHER_KIND_THETA = "theta from another layer kind"


@functools.cache
def _rope_bases_of_models() -> dict[str, dict[str, float]]:
    """{model short name: {RoPE kind: its rotary base}} of every model the suite has facts for."""
    configs = (folder / "config.json" for folder in CONFIGS_DIR.iterdir())
    sources = [*sorted(MODELS_DIR.glob("*.yaml")), *sorted(config for config in configs if config.is_file())]
    bases: dict[str, dict[str, float]] = {}
    for source in sources:
        facts = load_facts(source)
        kinds = (facts.data.get("attention") or {}).get("kinds") or {}
        bases.setdefault(facts.short_name, {}).update(
            (kind, float(kind_facts["rope_theta"])) for kind, kind_facts in kinds.items()
            if kind_facts.get("rope_theta") is not None)
    return bases


def other_kind_base(shape: RopeShape) -> float | None:
    """The rotary base of another RoPE kind of the shape's model that differs from the shape's own
    (the first such kind in the facts), or None where there is none."""
    bases = _rope_bases_of_models().get(shape.model, {})
    return next((base for kind, base in bases.items() if kind != shape.layer_kind and base != shape.rotary_base), None)


def _other_kind_theta(inputs: RopeInputs) -> RopeInputs:
    base = other_kind_base(inputs.shape)
    if base is None:
        raise ValueError(f"{inputs.shape.id}: the model has no other RoPE kind with another base")
    return inputs.with_freqs(megatron_freqs(inputs.shape.with_changes(rotary_base=base), inputs.q.device))


def _mutated(mutation: str, mutate):
    def build(honest: Implementation) -> Implementation:
        return Mutated(base=honest, mutation=mutation, mutate=mutate)

    return build


def _packed_rows(case: Case) -> bool:
    bounds = case.shape.cu_seqlens
    return bounds is not None and len(bounds) > 2


def _another_kind_base(case: Case) -> bool:
    return other_kind_base(case.shape) is not None


WRONG_IMPLEMENTATIONS = (
    WrongImplementation(name=OTHER_PAIRING, lever=NAME, build=_mutated(OTHER_PAIRING, other_pairing)),
    WrongImplementation(name=ROW_START_OFFSET, lever=NAME, build=_mutated(ROW_START_OFFSET, rows_as_one),
                        changes=_packed_rows, caught_on=_packed_rows),
    WrongImplementation(name=OTHER_KIND_THETA, lever=NAME, build=_mutated(OTHER_KIND_THETA, _other_kind_theta),
                        changes=_another_kind_base, caught_on=_another_kind_base),
)
