"""The moe-router-dtype lever's component tests, generated from its spec (docs/levers/moe-router-dtype.md)."""

from correctness.router import lever
from correctness.spec_tests import component_tests

globals().update(component_tests([lever.SPEC]))
