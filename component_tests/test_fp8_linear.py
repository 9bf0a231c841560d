"""The fp8 lever's component tests, generated from its spec (docs/levers/fp8.md)."""

from correctness.fp8 import lever
from correctness.spec_tests import component_tests

globals().update(component_tests([lever.SPEC]))
