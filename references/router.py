"""FP64 top-k routing of a mixture-of-experts router, from the formula (no Megatron code).

For hidden states h [tokens, hidden], the router weight W [experts, hidden] (and an optional bias
b [experts]), all taken to FP64:

    logits = h W^T (+ b)
    sigmoid scoring: s = sigmoid(logits); the k experts with the largest s + e (e the expert bias,
        where there is one: it moves the choice, never the weights) are chosen; their weights are
        s / (sum of the chosen s) where k > 1, else s itself
    softmax scoring: the k experts with the largest logits (largest softmax over all experts where
        `pre_softmax`) are chosen; their weights are a softmax over the k chosen logits (over all
        experts, then taken at the chosen ones, where `pre_softmax`)
    group-limited choice (num_groups, group_topk): the experts split into num_groups equal groups
        in order; a group's score is the sum of its k / group_topk largest scores; only the experts
        of the group_topk best groups can be chosen
    then every weight times the scaling factor, where there is one.

`round_logits`, where given, is applied to the logits before everything that follows them (a
narrower format's rounding, for a format floor), and `round_scores` to the scores the score
function makes over all experts (sigmoid, or softmax where `pre_softmax`) before the expert bias
and the choice; their gradients are passed straight through, as a cast's is, so the gradients are
exact from the rounded values on.

Returned dense: `weights` [tokens, experts], zero where an expert is not chosen, and the boolean
`chosen` map; the gradients of sum(weights x upstream) with respect to W and h (autograd in FP64:
the choice is discrete and carries no gradient; the weights' gradient flows through the scores).
`boundary_gap` is, per token, the selection score of its k-th choice minus that of its (k+1)-th:
how near the token is to a tie, in the units the choice is made in; `boundary_score` is the k-th
best selection score itself.
"""

from collections.abc import Callable

import torch


def _rounded(x: torch.Tensor, rounding: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
    """x through `rounding`, its gradient passed straight through."""
    return x if rounding is None else x + (rounding(x.detach()).double() - x.detach())


def _choice_scores(logits: torch.Tensor, score_function: str, pre_softmax: bool, expert_bias: torch.Tensor | None,
                   round_scores: Callable[[torch.Tensor], torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the scores the choice ranks, the scores the weights are made from), over all experts."""
    if score_function == "sigmoid":
        scores = _rounded(torch.sigmoid(logits), round_scores)
        ranked = scores if expert_bias is None else scores + expert_bias
        return ranked, scores
    if score_function == "softmax":
        if pre_softmax:
            scores = _rounded(torch.softmax(logits, dim=-1), round_scores)
            return scores, scores
        return logits, logits
    raise ValueError(f"router reference: unknown score function {score_function!r} (sigmoid or softmax)")


def _allowed_by_groups(ranked: torch.Tensor, top_k: int, num_groups: int, group_topk: int) -> torch.Tensor:
    tokens, experts = ranked.shape
    if experts % num_groups or top_k % group_topk:
        raise ValueError(f"router reference: {experts} experts in {num_groups} groups, top-{top_k} over {group_topk}"
                         " groups do not divide")
    grouped = ranked.reshape(tokens, num_groups, experts // num_groups)
    group_scores = grouped.topk(top_k // group_topk, dim=-1).values.sum(dim=-1)
    best = group_scores.topk(group_topk, dim=-1).indices
    allowed = torch.zeros(tokens, num_groups, dtype=torch.bool, device=ranked.device)
    allowed.scatter_(1, best, True)
    return allowed.repeat_interleave(experts // num_groups, dim=1)


def route(hidden: torch.Tensor, weight: torch.Tensor, *, top_k: int, score_function: str,
          scaling_factor: float | None = None, expert_bias: torch.Tensor | None = None,
          router_bias: torch.Tensor | None = None, pre_softmax: bool = False,
          num_groups: int | None = None, group_topk: int | None = None,
          upstream: torch.Tensor | None = None,
          round_logits: Callable[[torch.Tensor], torch.Tensor] | None = None,
          round_scores: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """FP64 routing of hidden [tokens, hidden] by weight [experts, hidden]: logits, dense weights,
    the chosen map and the boundary gap; with `upstream` [tokens, experts] also grad_weight and
    grad_hidden of sum(weights x upstream)."""
    h = hidden.detach().double().requires_grad_(upstream is not None)
    w = weight.detach().double().requires_grad_(upstream is not None)
    logits = h @ w.t()
    if router_bias is not None:
        logits = logits + router_bias.double()
    logits = _rounded(logits, round_logits)
    bias = None if expert_bias is None else expert_bias.double()
    ranked, scores = _choice_scores(logits, score_function, pre_softmax, bias, round_scores)
    candidates = ranked.detach()
    if group_topk:
        candidates = candidates.masked_fill(~_allowed_by_groups(candidates, top_k, num_groups, group_topk),
                                            float("-inf"))
    order = candidates.topk(top_k + 1, dim=-1) if top_k < candidates.shape[-1] else None
    chosen_index = candidates.topk(top_k, dim=-1).indices
    picked = scores.gather(1, chosen_index)
    if score_function == "sigmoid":
        picked = picked / picked.sum(dim=-1, keepdim=True) if top_k > 1 else picked
    elif not pre_softmax:
        picked = torch.softmax(picked, dim=-1)
    if scaling_factor:
        picked = picked * scaling_factor
    weights = torch.zeros_like(logits).scatter(1, chosen_index, picked)
    chosen = torch.zeros_like(logits, dtype=torch.bool).scatter(1, chosen_index, True)
    result = {"logits": logits.detach(), "weights": weights.detach(), "chosen": chosen}
    if order is not None:
        result["boundary_gap"] = order.values[:, top_k - 1] - order.values[:, top_k]
        result["boundary_score"] = order.values[:, top_k - 1]
    if upstream is not None:
        (weights * upstream.double()).sum().backward()
        result["grad_weight"] = w.grad
        result["grad_hidden"] = h.grad
    return result
