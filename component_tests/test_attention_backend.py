"""The attention-backend lever's component tests, generated from its spec (docs/levers/attention-backend.md)."""

from correctness.attention import backend_lever as lever
from correctness.spec_tests import component_tests

globals().update(component_tests([lever.SPEC]))
