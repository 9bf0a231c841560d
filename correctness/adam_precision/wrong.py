"""Wrong implementations of TE FusedAdam's lowered-precision state in the candidate's own format,
each a small declaration built on the lever's honest CPU path (correctness.adam_precision.paths.
EmulatedFusedAdam with a `mistake`), to show what the format bound catches: run as candidates through
the lever's CPU tier, each must come out `fail` where the honest one is `format-limited` (or passes
the rule), tests/test_adam_precision_lever.py; the lead adds the tuple to
correctness.wrong_implementations.CATALOGUE.

- Truncation (TRUNCATED): every lowered state (BF16, FP16 and FP8 moments, FP16 masters) stored by
  rounding toward zero instead of to nearest even. Each store shrinks the moments by half a unit in
  the last place on average, so their scale slope against the floor is about -2^-9 (BF16), -2^-5
  (E4M3) or -2^-12 x the stores (FP16 masters), where the floor's rounding is unbiased: biased beyond
  the floor's rounding (the systematic diagnostic against the floor). FP32 states are exact either
  way: not applied where every state is FP32.
- Rounded twice per step (THROUGH_FP8): each moment rounded through FP8 E4M3 (with TE's per-tensor
  scale) before its own BF16 or FP16 format, as a kernel that stages the state in the narrower
  format would: E4M3's error, about 15 x BF16's, outside the format bound. Not applied where the
  moments are FP8 already (nothing changes) or FP32.
- A step lost (STEP_LOST): the third of the five steps never applied (a kernel launch lost: its
  gradient, its moments and its update missing, the step count going on), outside the format bound
  on the moments and the update on every case.
"""

from collections.abc import Callable
from dataclasses import replace

from correctness.adam_precision.lever import NAME, ByCase
from correctness.adam_precision.paths import STEP_LOST, THROUGH_FP8, TRUNCATED, EmulatedFusedAdam, StateDtypes
from correctness.lever import Case, Implementation, WrongImplementation


def _with_mistake(mistake: str) -> Callable[[Implementation], Implementation]:
    def build(honest: Implementation) -> Implementation:
        if not isinstance(honest, ByCase):
            raise TypeError(f"{mistake}: built on the lever's CPU candidate (ByCase of EmulatedFusedAdam),"
                            f" got {honest.name}")

        def make(dtypes: StateDtypes) -> EmulatedFusedAdam:
            path = honest.make(dtypes)
            if not isinstance(path, EmulatedFusedAdam):
                raise TypeError(f"{mistake}: built on EmulatedFusedAdam (the CPU tier), got {path.name}")
            return replace(path, mistake=mistake)

        return ByCase(make=make, label=f"{honest.label} ({mistake})")

    return build


def _lowered_state(case: Case) -> bool:
    shape = case.shape
    return any(dtype != "fp32" for dtype in (shape.master_dtype, shape.exp_avg_dtype, shape.exp_avg_sq_dtype))


def _moments_wider_than_fp8(case: Case) -> bool:
    return bool({case.shape.exp_avg_dtype, case.shape.exp_avg_sq_dtype} & {"bf16", "fp16"})


WRONG_IMPLEMENTATIONS = (
    WrongImplementation(name=TRUNCATED, lever=NAME, build=_with_mistake(TRUNCATED),
                        changes=_lowered_state, caught_on=_lowered_state),
    WrongImplementation(name=THROUGH_FP8, lever=NAME, build=_with_mistake(THROUGH_FP8),
                        changes=_moments_wider_than_fp8, caught_on=_moments_wider_than_fp8),
    WrongImplementation(name=STEP_LOST, lever=NAME, build=_with_mistake(STEP_LOST)),
)
