"""The precision-aware-adam lever's component tests, generated from its spec (docs/levers/precision-aware-adam.md)."""

from correctness.adam_precision import lever
from correctness.spec_tests import component_tests

globals().update(component_tests([lever.SPEC]))
