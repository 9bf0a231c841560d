"""FP64 reference for the per-token cross-entropy loss of a packed microbatch, and its gradient.

For tokens t with logits z_t (over the vocabulary), label y_t and loss mask m_t in {0, 1}:

    loss_t = logsumexp(z_t) - z_t[y_t]
    L      = sum_t m_t loss_t                      (Megatron's --calculate-per-token-loss: the sum;
                                                    dividing by the token count happens later, alike
                                                    for every path)
    dL/dz_t = m_t (softmax(z_t) - onehot(y_t))

Layout: logits [T, V] (the packed tokens of every row), labels [T] integers, mask [T].
"""

import torch


def masked_loss_sum(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """{"loss_sum": 0-d FP64 tensor, "grad_logits": FP64 [T, V]} for the formula above."""
    if logits.dim() != 2 or labels.shape != logits.shape[:1] or mask.shape != labels.shape:
        raise ValueError(
            f"logits must be [T, V] with labels and mask [T], got {tuple(logits.shape)}, "
            f"{tuple(labels.shape)} and {tuple(mask.shape)}"
        )
    z = logits.to(torch.float64)
    m = mask.to(torch.float64)
    log_probabilities = z - torch.logsumexp(z, dim=-1, keepdim=True)
    picked = log_probabilities.gather(1, labels.long()[:, None])[:, 0]
    grad = log_probabilities.exp()
    grad[torch.arange(len(labels)), labels.long()] -= 1.0
    return {"loss_sum": -(m * picked).sum(), "grad_logits": grad * m[:, None]}
