"""FP64 reference for the per-token cross entropy of logits split over the vocabulary (tensor
parallel shards), and its logits gradient for a given upstream gradient.

The shards are gathered first: the reference sees the full vocabulary, as no rank does. For token
t with logits z_t over the full vocabulary V, label y_t (an index into V) and upstream gradient g_t
(dL/dloss_t, e.g. the loss mask where the per-token losses are summed):

    loss_t  = logsumexp(z_t) - z_t[y_t]
    dL/dz_t = g_t (softmax(z_t) - onehot(y_t))

computed in FP64 from the inputs as given (already rounded to their dtype), the gradient returned
split back into shards of the same widths as the inputs.

Layout: each shard [..., V_r] (Megatron: [sequence, batch, V / TP]), labels and upstream [...].
"""

from collections.abc import Sequence

import torch


def vocab_parallel_cross_entropy(
    logit_shards: Sequence[torch.Tensor], labels: torch.Tensor, upstream: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(loss [...] FP64, [dL/dz shard r [..., V_r] FP64 for each shard]) for the formulas above."""
    if not logit_shards:
        raise ValueError("no logit shards given")
    leading = tuple(logit_shards[0].shape[:-1])
    for shard in logit_shards:
        if tuple(shard.shape[:-1]) != leading:
            shapes = [tuple(s.shape) for s in logit_shards]
            raise ValueError(f"logit shards must agree in their leading dimensions, got {shapes}")
    if tuple(labels.shape) != leading or tuple(upstream.shape) != leading:
        raise ValueError(
            f"labels and upstream gradient must be {leading}, got {tuple(labels.shape)} and {tuple(upstream.shape)}"
        )
    z = torch.cat([shard.to(torch.float64) for shard in logit_shards], dim=-1)
    index = labels.long().unsqueeze(-1)
    if bool((index < 0).any()) or bool((index >= z.shape[-1]).any()):
        raise ValueError(f"labels must lie in [0, {z.shape[-1]}), the full vocabulary")
    log_probabilities = z - torch.logsumexp(z, dim=-1, keepdim=True)
    loss = -log_probabilities.gather(-1, index).squeeze(-1)
    grad = log_probabilities.exp_()
    grad.scatter_add_(-1, index, torch.full_like(index, -1.0, dtype=torch.float64))
    grad.mul_(upstream.to(torch.float64).unsqueeze(-1))
    widths = [shard.shape[-1] for shard in logit_shards]
    return loss, list(grad.split(widths, dim=-1))
