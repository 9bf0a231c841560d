"""Wrong implementations of gradient accumulation without the fusion, in the candidate's own format:
each is Megatron's unfused path (correctness.grad_accumulation.megatron_wgrad.MegatronWgrad) with
one mistake, to show what the format floor catches. Each must come out `fail` where the honest path
is `format-limited` (tests/test_grad_accumulation_lever.py; the lead adds the tuple to
correctness.wrong_implementations.CATALOGUE).

- Each microbatch's weight gradient truncated to BF16 (the FP32 GEMM sum's low 16 bits dropped)
  instead of rounded to nearest even: every term shrinks by half a BF16 unit on average, a scale
  slope of about -2^-8.5 that the floor's unbiased rounding does not have; the systematic
  diagnostic against the floor flags it (its error, about twice the floor's, is within the
  format bound).
- One microbatch's gradient dropped (the smallest, the hardest to miss): the lever's negative
  control run as a candidate, outside the format bound after the step's microbatches.
"""

from dataclasses import replace

from correctness.grad_accumulation.lever import NAME
from correctness.grad_accumulation.megatron_wgrad import DROPPED, TRUNCATED, MegatronWgrad
from correctness.lever import Case, Implementation, WrongImplementation


def _with_mutation(mutation: str):
    def build(honest: Implementation) -> Implementation:
        if not isinstance(honest, MegatronWgrad) or honest.fused:
            raise TypeError(f"{mutation}: built on the lever's unfused Megatron path, got {honest.name}")
        return replace(honest, mutation=mutation)

    return build


def _several_microbatches(case: Case) -> bool:
    return case.shape.microbatches > 1


def _bf16(case: Case) -> bool:
    return case.shape.dtype == "bf16"


WRONG_IMPLEMENTATIONS = (
    WrongImplementation(name=TRUNCATED, lever=NAME, build=_with_mutation(TRUNCATED), changes=_bf16, caught_on=_bf16),
    WrongImplementation(name=DROPPED, lever=NAME, build=_with_mutation(DROPPED), changes=_several_microbatches,
                        caught_on=_several_microbatches),
)
