"""The moe-permute-fusion and moe-permute-fusion-sums levers' component tests, generated from their specs
(one factory builds both; docs/levers/moe-permute-fusion.md)."""

from correctness.moe import permute_lever
from correctness.spec_tests import component_tests

globals().update(component_tests([permute_lever.EXACT_SPEC, permute_lever.SUMS_SPEC]))
