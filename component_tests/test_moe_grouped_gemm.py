"""The moe-grouped-gemm lever's component tests, generated from its spec (docs/levers/moe-grouped-gemm.md)."""

from correctness.moe import grouped_gemm_lever
from correctness.spec_tests import component_tests

globals().update(component_tests([grouped_gemm_lever.SPEC]))
