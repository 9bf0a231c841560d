"""TE 2.17's fused scaled (masked) softmax kernels on the emulated GPU: what TE's unfused attention
calls for its BF16/FP16 softmax where NVTE_MASKED_SOFTMAX_FUSION is on, as it is by default
(attention/dot_product_attention/softmax.py: FusedScaleMaskSoftmax.is_kernel_available, 190-223;
forward_fused_softmax picks ScaledSoftmax or ScaledMaskedSoftmax, 225-246).

What the kernels compute (common/fused_softmax/scaled_masked_softmax.cu at v2.17), here
fused_softmax_arithmetic.py, shared with Apex's kernels:
- forward: each score read into FP32 and multiplied by the scale, which the launcher hands the
  kernel in the scores' dtype (`const input_t scale`, 424 and 522: rounded to BF16/FP16; TE's
  unfused attention passes 1.0, or its layer number); where the mask holds 1 the score is -10000
  instead (95-190: no mask; 203-325: mask [1 or b, 1, sq, sk], broadcast over the heads and, where
  its first dimension is 1, the batch); FP32 row max, exp(x - max), FP32 row sum, exp / sum rounded
  once to the input dtype; a row whose every key is masked (its max is -10000) gives zeros (290-295).
- backward (330-420, one kernel for both, its scale FP32, 635): FP32 y = softmax output and
  g = dy * y; the FP32 row sum of g; dx = scale * (g - y * sum) rounded to the dtype, written in
  place into the incoming gradient (pytorch/csrc/extensions/softmax.cpp 40-63, 103-126: "Produce
  gradients in place").
The row sums are FP32 sums in torch's order, not the kernel's warp-shuffle tree: the last bit can
differ from a GPU's. The launchers' checks (softmax.cpp: 4-D input, FP16/BF16, key length at most
16384 and a multiple of 8, more than one query, the mask's shape) raise as they do.
ScaledUpperTriangMaskedSoftmax and ScaledAlignedCausalMaskedSoftmax are not reached in TE 2.17
(forward_fused_softmax, 239-241) and have no stand-in. megatron-core's own fused softmax (Apex's
kernels, the same arithmetic with another launcher) has its stand-ins in megatron_softmax.py.
"""

import torch

from correctness.emulated_gpu.kernels import require_on_gpu, stand_in
from correctness.emulated_gpu.stand_ins.fused_softmax_arithmetic import (LOW_PRECISION, masked_scores, scaled_scores,
                                                                         softmax, softmax_gradient)


class SoftmaxCheckFailed(RuntimeError):
    """What the launcher's AT_ASSERTM / TORCH_CHECK raises (pytorch/csrc/extensions/softmax.cpp)."""


def _check_scores(kernel: str, scores: torch.Tensor) -> None:
    if scores.dim() != 4:
        raise SoftmaxCheckFailed(f"{kernel}: expected 4D tensor")
    if scores.dtype not in LOW_PRECISION:
        raise SoftmaxCheckFailed(f"{kernel}: Only fp16 and bf16 are supported")
    keys, queries = scores.shape[3], scores.shape[2]
    if keys > 16384:
        raise SoftmaxCheckFailed(f"{kernel}: Key sequence length must be 16384 or less")
    if keys % 8 != 0:
        raise SoftmaxCheckFailed(f"{kernel}: Key sequence length must be divisible by 8")
    if queries <= 1:
        raise SoftmaxCheckFailed(f"{kernel}: Query sequence length must be greater than 1")


def _backward(kernel: str, grad: torch.Tensor, probs: torch.Tensor, scale: float) -> torch.Tensor:
    require_on_gpu(kernel, output_grads=grad, softmax_results=probs)
    for name, tensor in (("output_grads", grad), ("softmax_results", probs)):
        if tensor.dim() != 4:
            raise SoftmaxCheckFailed(f"{kernel}: expected 4D tensor ({name})")
        if tensor.dtype not in LOW_PRECISION:
            raise SoftmaxCheckFailed(f"{kernel}: Only fp16 and bf16 are supported ({name})")
    return softmax_gradient(grad, probs, scale, in_place=True)


@stand_in(name="transformer_engine_torch.scaled_softmax_forward",
          stands_for="TE's fused scaled softmax kernel, forward (scaled_softmax_warp_forward)",
          computes="softmax of the FP32 scores times the scale (rounded to BF16/FP16 by the launcher; FP32 max, exp"
                   " and sum), rounded once to BF16/FP16")
def scaled_softmax_forward(inputs, scale_factor):
    require_on_gpu("scaled_softmax_forward", input=inputs)
    _check_scores("scaled_softmax_forward", inputs)
    # TE's unmasked kernel (scaled_masked_softmax.cu 95-190) zeroes no row: only its masked one does.
    return softmax(scaled_scores(inputs, scale_factor), inputs.dtype, zero_fully_masked_rows=False)


@stand_in(name="transformer_engine_torch.scaled_softmax_backward",
          stands_for="TE's fused scaled softmax kernel, backward (scaled_masked_softmax_warp_backward)",
          computes="scale * (dy y - y sum(dy y)) in FP32 from the BF16/FP16 dy and y, rounded once, in place into dy")
def scaled_softmax_backward(output_grads, softmax_results, scale_factor):
    return _backward("scaled_softmax_backward", output_grads, softmax_results, scale_factor)


@stand_in(name="transformer_engine_torch.scaled_masked_softmax_forward",
          stands_for="TE's fused scaled masked softmax kernel, forward (scaled_masked_softmax_warp_forward)",
          computes="softmax of the FP32 scores times the scale (rounded to BF16/FP16 by the launcher) with masked"
                   " ones at -10000 (FP32 max, exp and sum), rounded once to BF16/FP16; a fully masked row gives zeros")
def scaled_masked_softmax_forward(inputs, mask, scale_factor):
    require_on_gpu("scaled_masked_softmax_forward", input=inputs, mask=mask)
    _check_scores("scaled_masked_softmax_forward", inputs)
    if mask.dim() != 4:
        raise SoftmaxCheckFailed("scaled_masked_softmax_forward: expected 4D tensor (mask)")
    batches, _, queries, keys = inputs.shape
    if mask.shape[0] not in (1, batches) or tuple(mask.shape[1:]) != (1, queries, keys):
        raise SoftmaxCheckFailed(f"scaled_masked_softmax_forward: mask of shape {list(mask.shape)} for scores of"
                                 f" shape {list(inputs.shape)} (pad_batches == 1 || pad_batches == batches,"
                                 " mask.size(1) == 1, the scores' query and key lengths)")
    return softmax(masked_scores(inputs, mask, scale_factor), inputs.dtype, zero_fully_masked_rows=True)


@stand_in(name="transformer_engine_torch.scaled_masked_softmax_backward",
          stands_for="TE's fused scaled masked softmax kernel, backward (scaled_masked_softmax_warp_backward)",
          computes="scale * (dy y - y sum(dy y)) in FP32 from the BF16/FP16 dy and y, rounded once, in place into dy")
def scaled_masked_softmax_backward(output_grads, softmax_results, scale_factor):
    return _backward("scaled_masked_softmax_backward", output_grads, softmax_results, scale_factor)
