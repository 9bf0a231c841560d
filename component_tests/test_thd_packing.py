"""The thd-packing and packed-loss levers' component tests, generated from their specs (docs/levers/thd-packing.md,
docs/levers/packed-loss.md)."""

from correctness.attention import thd_packing_lever as attention_packing
from correctness.loss import lever as loss_packing
from correctness.spec_tests import component_tests

globals().update(component_tests([attention_packing.SPEC, loss_packing.SPEC]))
