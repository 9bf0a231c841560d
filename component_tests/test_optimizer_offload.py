"""The optimizer-offload lever's component tests, generated from its spec (docs/levers/optimizer-offload.md)."""

from correctness.optimizer import lever
from correctness.spec_tests import component_tests

globals().update(component_tests([lever.SPEC]))
