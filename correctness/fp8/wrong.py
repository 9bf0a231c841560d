"""Wrong FP8 implementations in the same format as the honest one, each a small declaration built
on the lever's honest CPU path (correctness.fp8.paths.EmulatedFp8Linear with a quantisation
mistake, its GEMMs the honest path's: Hopper's on per-tensor recipes, the stand-in on block-scaled
ones), to show what the format bound catches: run as candidates through the lever's CPU tier, each
must come out `fail` where the honest one is `format-limited` (tests/test_fp8_lever.py; the
lead adds the tuple to correctness.wrong_implementations.CATALOGUE).

- Truncation: the cast to E4M3/E5M2 rounds toward zero instead of to nearest even. Every element
  shrinks by half an FP8 unit in the last place on average, so each GEMM's output is scaled down
  by several percent: biased beyond the floor's rounding (the systematic diagnostic against the
  floor), and outside the format bound besides.
- A block scale rounded toward saturation: blockwise's power-of-two scale rounded up instead of
  down, MXFP8's E8M0 scale rounded down instead of up. A block's largest elements then land beyond
  the format's largest value and are clamped: outside the format bound. Per-tensor recipes have no
  power-of-two block scale (the mistake does not change them).
"""

from collections.abc import Callable
from dataclasses import replace

from correctness.fp8.lever import NAME
from correctness.fp8.paths import BLOCK_SCALE_TOWARD_SATURATION, TRUNCATED_CAST, EmulatedFp8Linear
from correctness.lever import Case, Implementation, WrongImplementation


def _with_mistake(mistake: str) -> Callable[[Implementation], Implementation]:
    def build(honest: Implementation) -> Implementation:
        if not isinstance(honest, EmulatedFp8Linear):
            raise TypeError(f"{mistake}: built on the FP8 lever's CPU path (EmulatedFp8Linear), got {honest.name}")
        return replace(honest, mistake=mistake, probe_scaled_mm=False)

    return build


def _block_scaled(case: Case) -> bool:
    return case.shape.config.block("input") is not None


WRONG_IMPLEMENTATIONS = (
    WrongImplementation(name=TRUNCATED_CAST, lever=NAME, build=_with_mistake(TRUNCATED_CAST)),
    WrongImplementation(name=BLOCK_SCALE_TOWARD_SATURATION, lever=NAME,
                        build=_with_mistake(BLOCK_SCALE_TOWARD_SATURATION), changes=_block_scaled,
                        caught_on=_block_scaled),
)
