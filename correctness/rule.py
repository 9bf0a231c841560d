"""The pass rule: the candidate's error may be at most `factor` x the default's error + `slack`.

These are the suite's only tolerance constants. A lever that overrides them must say why
(`Lever.rule_reason`).
"""

from dataclasses import dataclass

DEFAULT_FACTOR = 2.0
DEFAULT_SLACK = 1e-3


@dataclass(frozen=True, kw_only=True)
class Rule:
    factor: float = DEFAULT_FACTOR
    slack: float = DEFAULT_SLACK

    def __post_init__(self):
        if not (self.factor >= 1.0 and self.slack >= 0.0):
            raise ValueError(f"rule: factor must be >= 1 and slack >= 0, got factor={self.factor}, slack={self.slack}")

    def bound(self, default_error: float) -> float:
        return self.factor * default_error + self.slack

    def describe(self) -> str:
        return f"{self.factor:g} x default + {self.slack:g}"


DEFAULT_RULE = Rule()
