"""The rope-fusion lever's component tests, generated from its spec (docs/levers/rope-fusion.md)."""

from correctness.rope import lever
from correctness.spec_tests import component_tests

globals().update(component_tests([lever.SPEC]))
