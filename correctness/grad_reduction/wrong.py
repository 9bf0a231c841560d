"""Wrong BF16 gradient reductions, in the candidate's own format: each is Megatron's BF16 sync on the
same gloo ranks with one thing done wrong (correctness.grad_reduction.megatron_sync runs the variant),
to show what the BF16 format floor catches. Each must come out `fail` where the honest reduction
is `format-limited` (tests/test_reduction_lever.py; the lead adds the tuple to
correctness.wrong_implementations.CATALOGUE). A wrong path is not in the case's plan: it gets a
distributed run of its own when the harness first asks for it.

- The gradients converted into the BF16 buffer by truncation (the low 16 bits of FP32 dropped)
  instead of to nearest even: each element moves toward zero by half a BF16 unit on average, a
  scale slope of about -2^-8.5 that the floor's unbiased rounding does not have; the systematic
  diagnostic against the floor flags it (its error, about 1.3-1.7 x the floor's, stays within the
  format bound).
- One rank's gradient dropped (the rank with the smallest gradients; at DP 1 the only one): the
  lever's negative control run as a candidate, outside the format bound.
- Each hop's partial sum through FP8 E4M3 (scaled by a power of two to its largest value) before
  BF16, as a reduction compressing its traffic would: a second, coarser rounding per hop, outside
  the format bound at every DP size of 2 or more (at DP 1 there is no hop).
"""

from collections.abc import Callable

from correctness.lever import Implementation, WrongImplementation
from correctness.grad_reduction.lever import NAME, GradSync
from correctness.grad_reduction.plan import HOPS_THROUGH_FP8, RANK_DROPPED, TRUNCATED, RankPath


def _with_variant(variant: str) -> Callable[[Implementation], Implementation]:
    def build(honest: Implementation) -> Implementation:
        if not isinstance(honest, GradSync) or honest.dtype != "bf16":
            raise TypeError(f"{variant}: built on the reduction lever's BF16 sync (GradSync), got {honest.name}")
        path = f"wrong: {variant}"
        return GradSync(f"{honest.name} ({variant})", path, "bf16",
                        rank_path=RankPath(name=path, dtype="bf16", runs=2, variant=variant))

    return build


WRONG_IMPLEMENTATIONS = tuple(
    WrongImplementation(name=variant, lever=NAME, build=_with_variant(variant))
    for variant in (TRUNCATED, RANK_DROPPED, HOPS_THROUGH_FP8)
)
