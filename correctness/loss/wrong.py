"""Wrong packed losses for the packed-loss lever, each the lever's honest packed sum run on inputs with
one thing done wrong, to show what its evidence catches (tests/test_evidence_power.py,
benchmarks/evidence_power.py, docs/evidence-power.md). The lever's controls (a per-row mean, the
mask ignored) are the classic mistakes; these are two more.

- The loss mask one token off: the mask applied to the token after the one it was made for (the
  labels shifted for next-token prediction and the mask not shifted with them), so a supervised
  token's loss is dropped and its neighbour's counted. It changes every case.
- The boundary token supervised: the last token of each packed row but the last counted, as packing
  that shifts the labels across the whole packed sequence and masks only its final token would: that
  token is scored on the next row's first token, a target it cannot see. With two rows per
  microbatch one token of the 1,024 changes; it changes every case that packs two rows or more.
"""

from dataclasses import replace

from correctness.lever import Case, Mutated, WrongImplementation
from correctness.loss.lever import NAME, LossInputs

MASK_ONE_OFF = "the loss mask one token off"
BOUNDARY_SUPERVISED = "the row boundary's token supervised"


def _mask_one_off(inputs: LossInputs) -> LossInputs:
    return replace(inputs, mask=inputs.mask.roll(1))


def _boundary_supervised(inputs: LossInputs) -> LossInputs:
    mask = inputs.mask.clone()
    row = inputs.shape.seq_len
    mask[row - 1: mask.numel() - 1: row] = 1.0
    return replace(inputs, mask=mask)


def _two_rows(case: Case) -> bool:
    return case.shape.rows >= 2


WRONG_IMPLEMENTATIONS = (
    WrongImplementation(name=MASK_ONE_OFF, lever=NAME,
                        build=lambda honest: Mutated(base=honest, mutation=MASK_ONE_OFF, mutate=_mask_one_off)),
    WrongImplementation(name=BOUNDARY_SUPERVISED, lever=NAME, changes=_two_rows, caught_on=_two_rows,
                        build=lambda honest: Mutated(base=honest, mutation=BOUNDARY_SUPERVISED,
                                                     mutate=_boundary_supervised)),
)
