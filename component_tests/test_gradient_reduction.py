"""The gradient-reduction-dtype lever's component tests, generated from its spec (docs/levers/gradient-reduction-dtype.md)."""

from correctness.grad_reduction import lever
from correctness.spec_tests import component_tests

globals().update(component_tests([lever.SPEC]))
