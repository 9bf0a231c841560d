"""TE 2.17's MoE token permutation on the emulated GPU: the wrappers of its Triton kernels in
transformer_engine/pytorch/triton/permutation.py, which the te_moe custom ops of
transformer_engine/pytorch/permutation.py call (moe_permute / moe_permute_with_probs /
moe_unpermute with the mask map, megatron-core's fused permutation; moe_sort_chunks_by_index).
Where triton is not installed the Triton kernels (transformer_engine/common/triton/permutation.py)
cannot run (`triton` is an inert module under correctness.te_on_cpu): each stand-in replaces one
wrapper, as a module attribute, and computes what its kernel documents; TE's Python around them (the
custom ops, their autograd, FP8 unwrapping, empty inputs) runs as it is. Where triton is installed
nothing is declared here: TE's own kernels run in Triton's interpreter (stand_ins/triton_launch).

The row id map, [tokens, 2 x experts + 1] int32, per token: the destination rows of its routed
(token, expert) pairs in descending order (rows grouped by expert, experts in order, each
expert's tokens in order), then those pairs' experts, then their count. The kernels leave the unused
positions unwritten; here they hold -1.

Sums follow `_unpermute_kernel` and `_unpermute_bwd_with_merging_probs_kernel`: values taken to
FP32, a token's rows (times their merging probabilities, the product rounded to FP32) added in the
map's order into an FP32 accumulator, rounded once to the data's dtype; the merging probabilities'
gradient an FP32 sum over the hidden dimension, rounded to the probabilities' dtype. Two
differences a GPU may show: the kernels' compiler may contract a product and its add into one FMA
(one FP32 rounding fewer), and the gradient's sum runs in the kernel's autotuned block order. The
gathers (permute, the chunk sort) move values and round nothing; `_permute_kernel` writes a zero row
where a routed pair's probability is exactly 0 (a padded slot).

Refused (NotEmulated): FP8 scales (`scale`, blockwise and MXFP8 inputs) and fused padding
(`pad_offsets`, moe_permute_and_pad_with_probs). A destination row beyond the output's rows raises,
as the kernel's write out of bounds would fault.
"""

import torch

from correctness.emulated_gpu import triton_interpreter
from correctness.emulated_gpu.kernels import require_on_gpu, stand_in
from correctness.emulated_gpu.runtime import NotEmulated

WRAPPERS = "transformer_engine.pytorch.triton.permutation"


def _declared(**declaration):
    """The function declared a stand-in where triton is not installed (module docstring)."""
    if triton_interpreter.present():
        return lambda function: function
    return stand_in(**declaration)


class RowOutOfBounds(RuntimeError):
    """A permutation kernel would write or read past its tensor (an illegal memory access on a GPU)."""


def _refuse_fp8_and_padding(kernel: str, scale=None, pad_offsets=None) -> None:
    if scale is not None:
        raise NotEmulated(f"{kernel}: permuting FP8 scales (blockwise or MXFP8 inputs) is not emulated")
    if pad_offsets is not None:
        raise NotEmulated(f"{kernel}: fused padding (pad_offsets) is not emulated")


def _routed_pairs(row_id_map: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, ...]:
    """(token, expert, row) of every routed pair, in the map's order (token by token, rows descending)."""
    rows = row_id_map[:, :num_experts].long()
    experts = row_id_map[:, num_experts:2 * num_experts].long()
    routed = torch.arange(num_experts, device=row_id_map.device) < row_id_map[:, 2 * num_experts:].long()
    tokens = torch.arange(row_id_map.shape[0], device=row_id_map.device).unsqueeze(1).expand_as(rows)
    return tokens[routed], experts[routed], rows[routed]


def _check_rows(kernel: str, rows: torch.Tensor, available: int) -> None:
    if rows.numel() and int(rows.max()) >= available:
        raise RowOutOfBounds(f"{kernel}: row {int(rows.max())} of a tensor of {available} rows (on a GPU: an illegal"
                             " memory access, or another tensor overwritten)")


@_declared(name=f"{WRAPPERS}.make_row_id_map",
          stands_for="TE's Triton row-id-map kernels (_row_id_map_pass_1/2/3_kernel)",
          computes="each routed (token, expert) pair's destination row (experts in order, each expert's tokens in"
                   " order), per token sorted descending with its experts and their count; unused slots -1")
def make_row_id_map(routing_map: torch.Tensor, num_tokens: int, num_experts: int) -> torch.Tensor:
    require_on_gpu("make_row_id_map", routing_map=routing_map)
    routed = routing_map.bool()
    per_expert = routed.sum(dim=0)
    first_row = per_expert.cumsum(dim=0) - per_expert
    rows = torch.where(routed, first_row + routed.long().cumsum(dim=0) - 1, -1)
    rows, experts = rows.sort(dim=1, descending=True, stable=True)
    row_id_map = torch.full((num_tokens, 2 * num_experts + 1), -1, dtype=torch.int32, device=routing_map.device)
    row_id_map[:, :num_experts] = rows
    row_id_map[:, num_experts:2 * num_experts] = torch.where(rows >= 0, experts, -1)
    row_id_map[:, 2 * num_experts] = routed.sum(dim=1)
    return row_id_map


@_declared(name=f"{WRAPPERS}.permute_with_mask_map",
          stands_for="TE's Triton permute kernel (_permute_kernel)",
          computes="each token's row copied to its destination rows, its probability to the same rows; a row whose"
                   " probability is exactly 0 written as zeros")
def permute_with_mask_map(inp, row_id_map, probs, scale, pad_offsets, num_tokens, num_experts, num_out_tokens,
                          hidden_size, scale_hidden_dim):
    require_on_gpu("permute_with_mask_map", inp=inp, row_id_map=row_id_map, probs=probs)
    _refuse_fp8_and_padding("permute_with_mask_map", scale, pad_offsets)
    token, expert, row = _routed_pairs(row_id_map, num_experts)
    _check_rows("permute_with_mask_map", row, num_out_tokens)
    output = torch.zeros((num_out_tokens, hidden_size), dtype=inp.dtype, device=inp.device)
    output[row] = inp[token]
    permuted_probs = None
    if probs is not None:
        chosen = probs[token, expert]
        permuted_probs = torch.zeros((num_out_tokens,), dtype=probs.dtype, device=probs.device)
        permuted_probs[row] = chosen
        output[row[chosen == 0]] = 0
    return output, None, permuted_probs


@_declared(name=f"{WRAPPERS}.unpermute_with_mask_map",
          stands_for="TE's Triton unpermute kernel (_unpermute_kernel)",
          computes="each token the FP32 sum of its rows (times their merging probabilities) in the map's order,"
                   " rounded once to the rows' dtype; permuted probabilities put back at (token, expert), zero"
                   " elsewhere")
def unpermute_with_mask_map(inp, row_id_map, merging_probs, permuted_probs, pad_offsets, num_tokens, num_experts,
                            hidden_size):
    require_on_gpu("unpermute_with_mask_map", inp=inp, row_id_map=row_id_map, merging_probs=merging_probs,
                   permuted_probs=permuted_probs)
    _refuse_fp8_and_padding("unpermute_with_mask_map", pad_offsets=pad_offsets)
    width = int(row_id_map[:, 2 * num_experts].max()) if num_tokens else 0
    rows = row_id_map[:, :width].long()
    routed = torch.arange(width, device=row_id_map.device) < row_id_map[:, 2 * num_experts:].long()
    _check_rows("unpermute_with_mask_map", rows[routed], inp.shape[0])
    values = inp[rows.clamp(min=0)].float()  # [tokens, width, hidden]
    if merging_probs is not None:
        experts = row_id_map[:, num_experts:num_experts + width].long().clamp(min=0)
        values = values * merging_probs.gather(1, experts).float().unsqueeze(-1)
    values = torch.where(routed.unsqueeze(-1), values, 0.0)
    total = torch.zeros((num_tokens, hidden_size), dtype=torch.float32, device=inp.device)
    for slot in range(width):  # the kernel's order: a token's rows one after the other
        total = total + values[:, slot]
    unpermuted_probs = None
    if permuted_probs is not None:
        token, expert, row = _routed_pairs(row_id_map, num_experts)
        unpermuted_probs = torch.zeros((num_tokens, num_experts), dtype=permuted_probs.dtype, device=inp.device)
        unpermuted_probs[token, expert] = permuted_probs[row]
    return total.to(inp.dtype), unpermuted_probs


@_declared(name=f"{WRAPPERS}.unpermute_with_mask_map_bwd_with_merging_probs",
          stands_for="TE's Triton unpermute backward kernel with merging probabilities"
                     " (_unpermute_bwd_with_merging_probs_kernel)",
          computes="each routed row's gradient the token's gradient times its merging probability in FP32, rounded"
                   " once; each probability's gradient the FP32 sum over the hidden dimension of row x gradient")
def unpermute_with_mask_map_bwd_with_merging_probs(fwd_output_grad, row_id_map, fwd_input, merging_probs, pad_offsets,
                                                   num_tokens, num_experts, num_out_tokens, hidden_size):
    require_on_gpu("unpermute_with_mask_map_bwd_with_merging_probs", fwd_output_grad=fwd_output_grad,
                   row_id_map=row_id_map, fwd_input=fwd_input, merging_probs=merging_probs)
    _refuse_fp8_and_padding("unpermute_with_mask_map_bwd_with_merging_probs", pad_offsets=pad_offsets)
    token, expert, row = _routed_pairs(row_id_map, num_experts)
    _check_rows("unpermute_with_mask_map_bwd_with_merging_probs", row, min(num_out_tokens, fwd_input.shape[0]))
    gradient = fwd_output_grad[token].float()
    act_grad = torch.zeros((num_out_tokens, hidden_size), dtype=fwd_output_grad.dtype, device=fwd_output_grad.device)
    act_grad[row] = (gradient * merging_probs[token, expert].float().unsqueeze(-1)).to(act_grad.dtype)
    probs_grad = torch.zeros((num_tokens, num_experts), dtype=merging_probs.dtype, device=merging_probs.device)
    probs_grad[token, expert] = (fwd_input[row].float() * gradient).sum(dim=-1).to(probs_grad.dtype)
    return act_grad, probs_grad


@_declared(name=f"{WRAPPERS}.make_chunk_sort_map",
          stands_for="TE's Triton chunk-sort map kernel (_make_chunk_sort_map_kernel)",
          computes="each row's destination when the chunks of split_sizes are put in sorted_indices' order; rows past"
                   " the chunks map to themselves")
def make_chunk_sort_map(split_sizes, sorted_indices, num_tokens, num_splits):
    require_on_gpu("make_chunk_sort_map", split_sizes=split_sizes, sorted_indices=sorted_indices)
    sizes, order = split_sizes.long(), sorted_indices.long()
    ends = sizes.cumsum(dim=0)
    sorted_sizes = sizes[order]
    destination_start = torch.empty_like(sizes)
    destination_start[order] = sorted_sizes.cumsum(dim=0) - sorted_sizes
    row = torch.arange(num_tokens, device=split_sizes.device)
    chunk = torch.searchsorted(ends, row, right=True).clamp(max=num_splits - 1)
    destination = destination_start[chunk] + row - (ends[chunk] - sizes[chunk])
    valid = row < ends[-1]
    return torch.where(valid, destination, row).to(torch.int32)


@_declared(name=f"{WRAPPERS}.sort_chunks_by_map",
          stands_for="TE's Triton chunk-sort kernel (_sort_chunks_by_map_kernel)",
          computes="rows (and probabilities) moved to their mapped rows (forward) or taken from them (backward)")
def sort_chunks_by_map(inp, row_id_map, probs, num_tokens, hidden_size, is_forward):
    require_on_gpu("sort_chunks_by_map", inp=inp, row_id_map=row_id_map, probs=probs)
    mapped = row_id_map.long()
    _check_rows("sort_chunks_by_map", mapped, num_tokens)
    output = torch.zeros((num_tokens, hidden_size), dtype=inp.dtype, device=inp.device)
    permuted_probs = None if probs is None else torch.zeros((num_tokens,), dtype=probs.dtype, device=probs.device)
    if is_forward:
        output[mapped] = inp
        if probs is not None:
            permuted_probs[mapped] = probs
    else:
        output.copy_(inp[mapped])
        if probs is not None:
            permuted_probs.copy_(probs[mapped])
    return output, permuted_probs
