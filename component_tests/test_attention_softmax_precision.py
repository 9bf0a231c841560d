"""The attention-softmax-precision lever at the Gemma-4-31B recipe (see
correctness/attention/softmax_precision.py): Megatron's DotProductAttention with its softmax in
BF16 against FP32 (both tiers expected to pass: on the CPU tier the BF16 softmax's errors are
1.000-1.006 x the FP32 softmax's, README), and its fused masked-softmax kernel against its torch softmax
(GPU only)."""

from functools import partial

import pytest

from correctness.attention import softmax_precision

RECIPE = "gemma-4-31b/h100/attune-tp2-pp4-split13"


@pytest.mark.levers(factory=partial(softmax_precision.gpu_tier, RECIPE), lever=softmax_precision.NAME)
def test_megatron_softmax_bf16_against_fp32_gpu(lever, case, lever_check):
    lever_check(lever, case)


@pytest.mark.levers(factory=partial(softmax_precision.cpu_tier, RECIPE), lever=softmax_precision.NAME)
def test_megatron_softmax_bf16_against_fp32_cpu(lever, case, lever_check):
    lever_check(lever, case)


@pytest.mark.levers(factory=partial(softmax_precision.fusion_gpu_tier, RECIPE), lever=softmax_precision.NAME)
def test_megatron_fused_masked_softmax_against_torch_softmax_gpu(lever, case, lever_check):
    """`--no-masked-softmax-fusion`: Megatron's fused masked-softmax kernel (where its CUDA extension
    is built and the shape is one it takes) against its torch softmax."""
    lever_check(lever, case)
