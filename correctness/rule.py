"""The pass rule, and the threshold of the systematic-error diagnostic beside it.

The rule: the candidate's error may be at most `factor` x the default's error + `slack`, for each
tensor as a whole and for each slice a lever declares (correctness.compare.Slicing). These are the
suite's only tolerance constants. A lever that overrides them must say why (`Lever.rule_reason`).

The diagnostic: the candidate's error e = x - ref splits into a scale slope <e, ref> / <ref, ref>
(the output as a whole too large or too small), the mean offset, and the rest. A random error of a
few percent hides a slope of 0.4% from the rule (an output scaled by 1 + 2^-8 sits at 0.16-0.5 of
the bound), so the slope and the offset are checked on their own: flagged `systematic` where the
candidate's |slope| or |offset| exceeds `systematic_factor` x the default's + a floor of
`systematic_floor_eps` x the output dtype's machine epsilon + `systematic_noise_sigmas` x the
scatter a purely random error gives them. Why those: rounding to nearest even is unbiased, so a
correctly rounded kernel's slope is its arithmetic's (the default's measures that: 1e-4 to 3e-4
for BF16 attention here); a scale error of half a unit roundoff (eps / 4) in every element is one
that no rounding explains; the factor is the rule's own, so the candidate may be as biased as
twice the default, as it may be as noisy. And the slope and the offset of a random error of
relative size `rest` (what is left of the error once its slope and offset are taken out) over n
elements scatter with standard deviation rest / sqrt(n): an optimizer update of 5,000 elements
with a relative error of 1e-4 from its FP32 master's rounding has offsets of 1e-6 by chance, far
above FP32's floor; six such deviations keep thousands of tensors and slices from being flagged by
chance, while a pure scale error, whose rest is nothing, is flagged however few its elements.

Repeatability: each judged path runs `runs` times on the same inputs (the candidate: its first run
and its repeat are both judged; the default: its repeat is the positive control). Bitwise equality
between the runs is reported for the candidate and the default. A lever whose claim is
repeatability itself (deterministic kernels) sets `bitwise_repeatable`: the candidate then fails
where any of its runs differs from its first in any bit, every negative control runs `runs` times
too and fails the rule where it is outside the bound or not repeatable, and the default's spread
is recorded, not judged.
"""

import math
from dataclasses import dataclass

import torch

DEFAULT_FACTOR = 2.0
DEFAULT_SLACK = 1e-3
SYSTEMATIC_FACTOR = DEFAULT_FACTOR
SYSTEMATIC_FLOOR_EPS = 0.25  # of the output dtype's machine epsilon: BF16 2^-9, FP16 2^-12, FP32 2^-25
SYSTEMATIC_NOISE_SIGMAS = 6.0
DEFAULT_RUNS = 2


@dataclass(frozen=True, kw_only=True)
class Rule:
    factor: float = DEFAULT_FACTOR
    slack: float = DEFAULT_SLACK
    systematic_factor: float = SYSTEMATIC_FACTOR
    systematic_floor_eps: float = SYSTEMATIC_FLOOR_EPS
    systematic_noise_sigmas: float = SYSTEMATIC_NOISE_SIGMAS
    runs: int = DEFAULT_RUNS
    bitwise_repeatable: bool = False

    def __post_init__(self):
        if not (isinstance(self.runs, int) and self.runs >= DEFAULT_RUNS):
            raise ValueError(f"rule: runs must be an integer of at least {DEFAULT_RUNS}, got {self.runs!r}")
        if not (self.factor >= 1.0 and self.slack >= 0.0):
            raise ValueError(f"rule: factor must be >= 1 and slack >= 0, got factor={self.factor}, slack={self.slack}")
        if not (self.systematic_factor >= 1.0 and self.systematic_floor_eps > 0.0 and self.systematic_noise_sigmas >= 0.0):
            raise ValueError(
                f"rule: systematic_factor must be >= 1, systematic_floor_eps > 0 and systematic_noise_sigmas >= 0, got"
                f" {self.systematic_factor}, {self.systematic_floor_eps} and {self.systematic_noise_sigmas}"
            )

    def bound(self, default_error: float) -> float:
        return self.factor * default_error + self.slack

    def systematic_floor(self, dtype: torch.dtype) -> float:
        """The smallest slope or offset flagged whatever the default's: a share of dtype's epsilon."""
        return self.systematic_floor_eps * torch.finfo(dtype).eps

    def systematic_threshold(self, default_value, dtype: torch.dtype, rest, count):
        """The largest |slope| (or |offset|) of the candidate not flagged, given the default's and
        the relative size of the rest of the candidate's error over `count` elements: numbers, or
        tensors of them (one per slice)."""
        root = count.clamp(min=1).sqrt() if isinstance(count, torch.Tensor) else math.sqrt(max(count, 1))
        noise = self.systematic_noise_sigmas * rest / root
        return self.systematic_factor * abs(default_value) + self.systematic_floor(dtype) + noise

    def describe(self) -> str:
        repeatable = f"; bitwise repeatable over {self.runs} runs" if self.bitwise_repeatable else ""
        return f"{self.factor:g} x default + {self.slack:g}{repeatable}"


DEFAULT_RULE = Rule()
