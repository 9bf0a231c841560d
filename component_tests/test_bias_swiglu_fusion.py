"""The bias-swiglu-fusion lever's component tests, generated from its spec (docs/levers/bias-swiglu-fusion.md)."""

from correctness.swiglu import lever
from correctness.spec_tests import component_tests

globals().update(component_tests([lever.SPEC]))
