"""The cross-entropy-fusion lever's component tests, generated from its spec (docs/levers/cross-entropy-fusion.md)."""

from correctness.cross_entropy import lever
from correctness.spec_tests import component_tests

globals().update(component_tests([lever.SPEC]))
