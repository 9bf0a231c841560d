"""megatron-core 0.16.1's fused masked-softmax CUDA kernels on the emulated GPU.

megatron-core's FusedScaleMaskSoftmax (fusions/fused_softmax.py) imports three compiled extensions,
whether TE is installed or not (megatron-core 0.16.1 reaches none of TE's softmax): on training
images they are Apex's (csrc/megatron, read at commit 6424da3). With masked-softmax fusion on, BF16
or FP16 scores and a shape `is_kernel_available` accepts (16 < keys <= 4096, queries, keys and
batch x heads multiples of 4, and the kernel's batches per block dividing them), it calls:
- `scaled_upper_triang_masked_softmax_cuda.forward/backward` for a causal mask (the scores viewed
  [batch x heads, queries, keys]); the kernel takes no window;
- `scaled_masked_softmax_cuda.forward/backward` for a given mask, `scaled_softmax_cuda.forward/
  backward` without one; `scaled_masked_softmax_cuda.get_batch_per_block` answers is_kernel_available.
Those modules are absent from a CPU machine; under the emulation these stand-ins are their functions
(correctness.emulated_gpu.kernels makes such a module for the emulation's block).

What the kernels compute (scaled_upper_triang_masked_softmax.h, scaled_masked_softmax.h), the
arithmetic of TE's fused softmax too, here fused_softmax_arithmetic.py: forward, each score read
into FP32 and multiplied by the scale (passed to the kernel in the scores' dtype, so rounded to it);
keys after the query (causal) -inf, masked keys (mask byte 1) -10000; FP32 row max, exp(x - max)
and row sum; exp / sum rounded once to the scores' dtype; a causal row's hidden keys and a fully
masked row (max -10000) give zeros. Backward, from the BF16/FP16 softmax output y and gradient dy:
g = dy y in FP32, dx = scale (g - y sum(g)) with the FP32 scale, rounded once; the causal and
unmasked kernels write it into dy (in place), the masked one into a new tensor. The launchers'
asserts (dims, dtype, lengths, batches per block) raise as they do. Row sums are FP32 sums in
torch's order, not the kernels' warp-shuffle trees: the last bit can differ from a GPU's.
"""

import torch

from correctness.emulated_gpu.kernels import require_on_gpu, stand_in
from correctness.emulated_gpu.stand_ins.fused_softmax_arithmetic import (LOW_PRECISION, causal_scores, masked_scores,
                                                                         scaled_scores, softmax, softmax_gradient)

WARP_SIZE = 32  # C10_WARP_SIZE on CUDA
THREADS_PER_BLOCK = 128
MAX_KEYS = 16384  # the forward launchers' TORCH_INTERNAL_ASSERT(key_seq_len <= 16384)
MAX_KEYS_MASKED = 4096  # dispatch_scaled_masked_softmax_forward/backward: key_seq_len <= 4096
UPPER_TRIANG = "scaled_upper_triang_masked_softmax_cuda"
MASKED = "scaled_masked_softmax_cuda"
UNMASKED = "scaled_softmax_cuda"


class KernelAssertFailed(RuntimeError):
    """What the launcher's TORCH_CHECK or TORCH_INTERNAL_ASSERT raises."""


def batches_per_block(keys: int) -> int:
    """Rows one thread block of the kernel takes (get_batch_per_block): from the keys' next power of two."""
    power = 1 << max(keys - 1, 0).bit_length()
    warp = min(power, WARP_SIZE)
    per_warp = 2 if power <= 128 else 1
    return (THREADS_PER_BLOCK // warp) * per_warp


def _check(kernel: str, condition: bool, text: str) -> None:
    if not condition:
        raise KernelAssertFailed(f"{kernel}: {text}")


def _check_dtype(kernel: str, *tensors: torch.Tensor) -> None:
    _check(kernel, all(t.dtype in LOW_PRECISION for t in tensors), "Only fp16 and bf16 are supported")


def _check_backward(kernel: str, output_grads: torch.Tensor, softmax_results: torch.Tensor, dims: int) -> None:
    require_on_gpu(kernel, output_grads=output_grads, softmax_results=softmax_results)
    _check(kernel, output_grads.dim() == dims and softmax_results.dim() == dims, f"expected {dims}D tensor")
    _check_dtype(kernel, output_grads, softmax_results)


def _check_masked_keys(kernel: str, keys: int) -> None:
    _check(kernel, keys <= MAX_KEYS_MASKED,
           f"TORCH_INTERNAL_ASSERT(key_seq_len <= {MAX_KEYS_MASKED}) failed (key_seq_len {keys})")


@stand_in(name=f"{UPPER_TRIANG}.forward",
          stands_for="Apex's scaled upper-triangular masked softmax kernel, forward (Megatron's causal fused softmax)",
          computes="causal softmax of the FP32 scaled scores (keys after the query -inf; FP32 max, exp and sum), rounded"
                   " once to BF16/FP16")
def upper_triang_forward(inputs, scale_factor):
    kernel = f"{UPPER_TRIANG}.forward"
    require_on_gpu(kernel, input=inputs)
    _check(kernel, inputs.dim() == 3, "expected 3D tensor")
    _check_dtype(kernel, inputs)
    batches, queries, keys = inputs.shape
    _check(kernel, queries <= MAX_KEYS, f"TORCH_INTERNAL_ASSERT(seq_len <= {MAX_KEYS}) failed (seq_len {queries})")
    _check(kernel, queries == keys, f"the kernel reads [attn_batches, seq_len, seq_len]; got {list(inputs.shape)}")
    _check(kernel, batches % batches_per_block(keys) == 0,
           f"TORCH_INTERNAL_ASSERT(attn_batches % batches_per_block == 0) failed ({batches} % {batches_per_block(keys)})")
    return softmax(causal_scores(inputs, scale_factor), inputs.dtype, zero_fully_masked_rows=False)


@stand_in(name=f"{UPPER_TRIANG}.backward",
          stands_for="Apex's scaled upper-triangular masked softmax kernel, backward",
          computes="scale (dy y - y sum(dy y)) in FP32 from the BF16/FP16 dy and y, rounded once, in place into dy")
def upper_triang_backward(output_grads, softmax_results, scale_factor):
    kernel = f"{UPPER_TRIANG}.backward"
    _check_backward(kernel, output_grads, softmax_results, dims=3)
    _check(kernel, output_grads.shape[1] == output_grads.shape[2],
           "TORCH_INTERNAL_ASSERT(output_grads.size(1) == output_grads.size(2)) failed")
    return softmax_gradient(output_grads, softmax_results, scale_factor, in_place=True)


def _check_4d_scores(kernel: str, inputs: torch.Tensor) -> None:
    _check(kernel, inputs.dim() == 4, "expected 4D tensor")
    _check_dtype(kernel, inputs)
    queries, keys = inputs.shape[2], inputs.shape[3]
    _check(kernel, keys <= MAX_KEYS, f"TORCH_INTERNAL_ASSERT(key_seq_len <= {MAX_KEYS}) failed (key_seq_len {keys})")
    _check(kernel, queries > 1, "TORCH_INTERNAL_ASSERT(query_seq_len > 1) failed")


def _backward_4d(kernel: str, output_grads: torch.Tensor, softmax_results: torch.Tensor, scale: float, *,
                 in_place: bool) -> torch.Tensor:
    """The masked and unmasked kernels' backward (one dispatch, dispatch_scaled_masked_softmax_backward,
    behind two launchers: the masked one writes a new tensor, the unmasked one into dy)."""
    _check_backward(kernel, output_grads, softmax_results, dims=4)
    _check_masked_keys(kernel, output_grads.shape[3])
    return softmax_gradient(output_grads, softmax_results, scale, in_place=in_place)


def _check_rows_per_block(kernel: str, queries: int, keys: int) -> None:
    _check(kernel, queries % batches_per_block(keys) == 0,
           f"TORCH_INTERNAL_ASSERT(query_seq_len % batches_per_block == 0) failed ({queries} %"
           f" {batches_per_block(keys)})")


@stand_in(name=f"{MASKED}.forward",
          stands_for="Apex's scaled masked softmax kernel, forward (Megatron's fused softmax with a mask)",
          computes="softmax of the FP32 scaled scores with masked ones (mask byte 1) at -10000 (FP32 max, exp and sum),"
                   " rounded once to BF16/FP16; a fully masked row gives zeros")
def masked_forward(inputs, mask, scale_factor):
    kernel = f"{MASKED}.forward"
    require_on_gpu(kernel, input=inputs, mask=mask)
    _check_4d_scores(kernel, inputs)
    _check(kernel, mask.dim() == 4, "expected 4D tensor")
    batches, _, queries, keys = inputs.shape
    _check(kernel, mask.shape[0] in (1, batches) and tuple(mask.shape[1:]) == (1, queries, keys),
           f"TORCH_INTERNAL_ASSERT on the mask's shape failed: mask {list(mask.shape)} for scores {list(inputs.shape)}"
           " (pad_batches == 1 || pad_batches == batches, mask.size(1) == 1, the scores' query and key lengths)")
    _check_masked_keys(kernel, keys)
    _check_rows_per_block(kernel, queries, keys)
    return softmax(masked_scores(inputs, mask, scale_factor), inputs.dtype, zero_fully_masked_rows=True)


@stand_in(name=f"{MASKED}.backward", stands_for="Apex's scaled masked softmax kernel, backward",
          computes="scale (dy y - y sum(dy y)) in FP32 from the BF16/FP16 dy and y, rounded once, into a new tensor")
def masked_backward(output_grads, softmax_results, scale_factor):
    return _backward_4d(f"{MASKED}.backward", output_grads, softmax_results, scale_factor, in_place=False)


@stand_in(name=f"{MASKED}.get_batch_per_block", stands_for="Apex's scaled masked softmax get_batch_per_block",
          computes="rows per thread block from the keys' next power of two: (128 // min(power, 32)) x (2 if power <= 128"
                   " else 1), as the kernel's launcher computes it")
def get_batch_per_block(query_seq_len, key_seq_len, batches, attn_heads):
    return batches_per_block(int(key_seq_len))


@stand_in(name=f"{UNMASKED}.forward",
          stands_for="Apex's scaled softmax kernel, forward (Megatron's fused softmax without a mask)",
          computes="softmax of the FP32 scaled scores (FP32 max, exp and sum), rounded once to BF16/FP16")
def unmasked_forward(inputs, scale_factor):
    kernel = f"{UNMASKED}.forward"
    require_on_gpu(kernel, input=inputs)
    _check_4d_scores(kernel, inputs)
    _check_rows_per_block(kernel, inputs.shape[2], inputs.shape[3])
    return softmax(scaled_scores(inputs, scale_factor), inputs.dtype, zero_fully_masked_rows=False)


@stand_in(name=f"{UNMASKED}.backward", stands_for="Apex's scaled softmax kernel, backward",
          computes="scale (dy y - y sum(dy y)) in FP32 from the BF16/FP16 dy and y, rounded once, in place into dy")
def unmasked_backward(output_grads, softmax_results, scale_factor):
    return _backward_4d(f"{UNMASKED}.backward", output_grads, softmax_results, scale_factor, in_place=True)
