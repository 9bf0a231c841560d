"""The bias-swiglu-fusion lever (`--no-bias-swiglu-fusion`, see correctness/mlp/lever.py):
Megatron's fused SwiGLU (`bias_swiglu_impl`, torch.compile'd as Megatron runs it; in routed
experts `weighted_bias_swiglu_impl`) against the unfused SwiGLU and FP64, the activation's output
and its gradients, at the FFN width per TP rank.

Both seed recipes are named, and neither model has a SwiGLU: Gemma-4's gated GELU (Megatron's
fast_gelu) and Nemotron-3-Super's squared ReLU are NotApplicable, with the reason. The example
Llama-3.1-8B recipe (SwiGLU, TP 2) runs on the CPU; on a GPU Moonlight-16B-A3B's as well (its
dense layer, shared expert and routed experts). With --recipe the one recipe runs, or the test
skips with the reason."""

import pytest

from correctness.mlp import lever as swiglu
from correctness.recipe_sets import GEMMA, LLAMA, MOONLIGHT, NEMOTRON, at_recipes


@pytest.mark.levers(factory=at_recipes(swiglu.megatron_gpu_tier, (GEMMA, NEMOTRON, LLAMA, MOONLIGHT)), lever=swiglu.NAME)
def test_bias_swiglu_fusion_on_gpu(lever, case, lever_check):
    lever_check(lever, case)


@pytest.mark.levers(factory=at_recipes(swiglu.cpu_tier, (GEMMA, NEMOTRON, LLAMA)), lever=swiglu.NAME)
def test_bias_swiglu_fusion_on_cpu(lever, case, lever_check):
    """Megatron's fused SwiGLU compiled for the CPU against its unfused SwiGLU."""
    lever_check(lever, case)
