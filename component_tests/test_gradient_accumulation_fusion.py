"""The gradient-accumulation-fusion lever's component tests, generated from its spec (docs/levers/gradient-accumulation-fusion.md)."""

from correctness.grad_accumulation import lever
from correctness.spec_tests import component_tests

globals().update(component_tests([lever.SPEC]))
