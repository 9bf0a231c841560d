"""The deterministic-mode lever's component tests, generated from its spec (docs/levers/deterministic-mode.md)."""

from correctness.composites.determinism import lever
from correctness.spec_tests import component_tests

globals().update(component_tests([lever.SPEC]))
