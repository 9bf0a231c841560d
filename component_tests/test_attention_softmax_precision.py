"""The attention-softmax-precision lever's component tests, generated from its spec (docs/levers/attention-softmax-precision.md)."""

from correctness.attention import softmax_precision_lever as softmax_precision
from correctness.spec_tests import component_tests

globals().update(component_tests([softmax_precision.SPEC]))
