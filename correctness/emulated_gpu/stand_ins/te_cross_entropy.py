"""TE 2.17's parallel cross entropy's Triton functions on the emulated GPU, where triton is not
installed (where it is, TE's own kernels run in Triton's interpreter: triton_launch).

TE's autograd function (transformer_engine/pytorch/cross_entropy.py 26-84, `CrossEntropyFunction`)
runs around the two functions it calls in transformer_engine/pytorch/triton/cross_entropy.py, which
launch the kernels of transformer_engine/common/triton/cross_entropy.py. Without triton those
functions cannot run at all (they size their blocks with `triton.next_power_of_2`), so the stand-ins
take their place, each doing what the function and its kernels do, vectorised over the rows:

- `cross_entropy_forward` (triton/cross_entropy.py 26-116): per row of this rank's vocabulary shard
  the max m, the sum d of exp(x - m) and the label's logit (-inf where the label is in another
  rank's shard), all in FP32 (`online_softmax_kernel`); where the group has more than one rank,
  these [rows x 3] statistics are all-gathered over it, as TE does, and combined (max of the maxes,
  sums rescaled to it, the one finite label logit); then (`cross_entropy_kernel`) the loss
  log d + m - x_label per row and the gradient softmax - eps (eps = label_smoothing / full
  vocabulary) written into the input in its dtype, with -(1 - label_smoothing) added at the label
  in that dtype, both divided by the count of labels other than ignore_idx where reduce_loss;
  rows whose label is ignore_idx get loss 0 and gradient 0. Label smoothing adds, as the kernel
  does, -eps times the sum of this rank's logits plus label_smoothing * (m + log d).
  Returns (the loss: [B, SQ], or its sum over that count where reduce_loss; the input now holding
  the gradient).
- `cross_entropy_backward` (116-143, `element_mul_kernel`): the stored gradient times the upstream
  gradient of its row (one value for all rows where it has one element), in FP32, rounded to the
  input's dtype, in place; nothing where the upstream gradient is the scalar 1.0.

The arithmetic is the kernels' (FP32, one rounding to the logits' dtype per store), not their
order of summation (TE sums exp over blocks of up to 32,768 columns, online).
"""

from typing import Any

import torch
import torch.distributed as dist

from correctness.emulated_gpu import triton_interpreter
from correctness.emulated_gpu.kernels import require_on_gpu, stand_in

MODULE = "transformer_engine.pytorch.triton.cross_entropy"


def shard_statistics(logits: torch.Tensor, labels: torch.Tensor, rank: int) -> torch.Tensor:
    """[rows, 3] FP32: max, sum of exp(x - max), and the label's logit or -inf (online_softmax_kernel)."""
    width = logits.shape[-1]
    local = labels - rank * width
    in_shard = (local >= 0) & (local < width)
    maximum = logits.max(dim=-1).values
    sums = torch.exp(logits - maximum.unsqueeze(-1)).sum(dim=-1)
    label_logit = logits.gather(-1, local.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1)
    label_logit = torch.where(in_shard, label_logit, torch.full_like(label_logit, float("-inf")))
    return torch.stack((maximum, sums, label_logit), dim=-1)


def combined(statistics: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ranks' [world, rows, 3] statistics as one max, sum and label logit per row."""
    maxima, sums, label_logits = statistics.unbind(-1)
    maximum = maxima.max(dim=0).values
    total = (sums * torch.exp(maxima - maximum)).sum(dim=0)
    return maximum, total, label_logits.max(dim=0).values


def forward(_input: torch.Tensor, target: torch.Tensor, label_smoothing: float, reduce_loss: bool,
            dist_process_group: Any, ignore_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    batch, sequence, width = _input.shape
    rows = batch * sequence
    if target.numel() != rows:
        raise AssertionError("Each token needs a target token ID.")
    require_on_gpu("TE cross_entropy_forward (online_softmax_kernel, cross_entropy_kernel)", inp=_input, target=target)
    if _input.stride(-1) != 1 or _input.stride(-2) != width:
        _input = _input.contiguous()
    rank = 0 if dist_process_group is None else dist.get_rank(dist_process_group)
    world = 1 if dist_process_group is None else dist.get_world_size(dist_process_group)
    logits = _input.reshape(rows, width).float()
    labels = target.reshape(rows)
    counted = (labels != ignore_idx).sum().clamp(min=1).reshape(1)

    statistics = shard_statistics(logits, labels, rank).reshape(-1)
    if world > 1:
        gathered = torch.zeros(world * statistics.numel(), dtype=torch.float32, device=_input.device)
        dist.all_gather_into_tensor(gathered, statistics, group=dist_process_group)
    else:
        gathered = statistics
    maximum, total, label_logit = combined(gathered.reshape(world, rows, 3))
    log_total = torch.log(total)

    loss = -(label_logit - maximum - log_total)  # the kernel's order: x_label - max is exact near the max
    eps = label_smoothing / (width * world)
    if label_smoothing > 0:
        smoothing = (-eps * logits).sum(dim=-1) + label_smoothing * (maximum + log_total)
        loss = loss * (1 - label_smoothing) + smoothing
    scale = counted.float() if reduce_loss else torch.ones(1, device=_input.device)
    grad = ((torch.exp(logits - maximum.unsqueeze(-1)) / total.unsqueeze(-1) - eps) / scale).to(_input.dtype)

    local = labels - rank * width
    at_label = (local >= 0) & (local < width) & (labels != ignore_idx)
    if reduce_loss:  # an FP32 term: the sum is FP32, rounded once to the input's dtype
        label_term = -(1 - label_smoothing) / counted.float()
    else:  # a Python constant, in the input's dtype, as the kernel adds it
        label_term = torch.tensor(-(1 - label_smoothing), dtype=_input.dtype, device=_input.device).float()
    column = local.clamp(0, width - 1).unsqueeze(-1)
    with_label = (grad.gather(-1, column).float() + label_term).to(_input.dtype)
    grad.scatter_(-1, column, torch.where(at_label.unsqueeze(-1), with_label, grad.gather(-1, column)))

    ignored = (labels == ignore_idx).unsqueeze(-1)
    grad = torch.where(ignored, torch.zeros_like(grad), grad)
    loss = torch.where(labels == ignore_idx, torch.zeros_like(loss), loss)
    _input.view(rows, width).copy_(grad)
    if reduce_loss:
        return loss.sum() / counted, _input
    return loss.reshape(batch, sequence), _input


def backward(_input: torch.Tensor, grad_output: torch.Tensor, is_cg_capturable: bool = False) -> torch.Tensor:
    if not is_cg_capturable and torch.equal(grad_output, torch.tensor(1.0, device=grad_output.device)):
        return _input
    require_on_gpu("TE cross_entropy_backward (element_mul_kernel)", inp=_input, grad_output=grad_output)
    batch, sequence, width = _input.shape
    upstream = grad_output.contiguous().reshape(-1)
    per_row = upstream if upstream.numel() > 1 else upstream.expand(batch * sequence)
    common = torch.promote_types(_input.dtype, upstream.dtype)
    rows = _input.view(batch * sequence, width)
    rows.copy_((rows.to(common) * per_row.to(common).unsqueeze(-1)).to(_input.dtype))
    return _input


if not triton_interpreter.present():
    stand_in(name=f"{MODULE}.cross_entropy_forward",
             stands_for="TE 2.17's cross-entropy forward Triton kernels (online_softmax_kernel, cross_entropy_kernel)"
                        " and their launcher",
             computes="per row in FP32: max, sum of exponentials and label logit, all-gathered over the TP group as"
                      " TE does; loss log(sum) + max - label logit; gradient softmax - eps (- (1 - smoothing) at the"
                      " label) rounded to the logits' dtype and written into them; ignore_idx rows zero")(forward)
    stand_in(name=f"{MODULE}.cross_entropy_backward",
             stands_for="TE 2.17's cross-entropy backward Triton kernel (element_mul_kernel) and its launcher",
             computes="the stored gradient times each row's upstream gradient in FP32, rounded to the logits' dtype,"
                      " in place; skipped where the upstream gradient is the scalar 1.0")(backward)
