"""FP64 references for a mixture-of-experts layer's routed part: the experts' MLPs over tokens
grouped by expert, and the token permutation around them. Written from the formulas; imports only
torch. Every function takes the (rounded) inputs of the paths under test and computes in FP64.

Layouts:
- `rows` [R, d]: the tokens routed to this rank's experts, grouped by expert in order: expert e
  holds `counts[e]` consecutive rows (an expert may hold none).
- `w1` [E, f, d] (f = 2 x ffn for a gated unit: the first half the gate, the second the linear
  part), `w2` [E, d, ffn]: expert e's first and second projection, y = x W^T as torch's Linear.
- `routing_map` [T, X] bool: token t is routed to expert x; `probs` [T, X]: its weight there.
"""

import torch

ACTIVATIONS = ("squared_relu", "swiglu")


def _activation(h: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "squared_relu":
        return torch.relu(h).square()
    if activation == "swiglu":
        gate, linear = h.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * linear
    raise ValueError(f"activation {activation!r}: the reference knows {', '.join(ACTIVATIONS)}")


def experts_mlp(rows: torch.Tensor, counts: list[int], w1: torch.Tensor, w2: torch.Tensor,
                probs: torch.Tensor, activation: str) -> torch.Tensor:
    """out[r] = (act(rows[r] W1_e^T) * probs[r]) W2_e^T for the expert e that holds row r."""
    if sum(counts) != rows.shape[0] or len(counts) != w1.shape[0]:
        raise ValueError(f"counts {counts} do not cover {rows.shape[0]} rows over {w1.shape[0]} experts")
    pieces = []
    for expert, (x, p) in enumerate(zip(rows.split(counts), probs.split(counts))):
        hidden = _activation(x @ w1[expert].transpose(0, 1), activation) * p.unsqueeze(-1)
        pieces.append(hidden @ w2[expert].transpose(0, 1))
    return torch.cat(pieces)


def experts_mlp_with_grads(rows, counts, w1, w2, probs, grad_out, activation) -> dict[str, torch.Tensor]:
    """The output and, for the upstream gradient `grad_out`, the gradients of the rows, the probs
    and each expert's weights (autograd over the FP64 formula above)."""
    x, a, b, p = (t.detach().double().requires_grad_() for t in (rows, w1, w2, probs))
    out = experts_mlp(x, counts, a, b, p, activation)
    out.backward(grad_out.double())
    tensors = {"out": out.detach(), "grad_input": x.grad, "grad_probs": p.grad}
    for expert in range(w1.shape[0]):
        tensors[f"grad_fc1_weight{expert}"] = a.grad[expert]
        tensors[f"grad_fc2_weight{expert}"] = b.grad[expert]
    return tensors


def permutation_order(routing_map: torch.Tensor) -> torch.Tensor:
    """The source token of each permuted row: experts in order, each expert's tokens in order."""
    experts, tokens = routing_map.t().nonzero(as_tuple=True)
    return tokens


def permute(tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
    """(rows [R, d], their probs [R]): row i is the token order[i] sent to its i-th expert slot."""
    order = permutation_order(routing_map)
    experts = routing_map.t().nonzero(as_tuple=True)[0]
    return tokens.double()[order], probs.double()[order, experts]


def unpermute(rows: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor | None = None) -> torch.Tensor:
    """out[t] = sum over the experts x of token t of (probs[t, x] x) row(t, x), the weight 1 where
    `probs` is None: the combine after the experts."""
    order = permutation_order(routing_map)
    experts = routing_map.t().nonzero(as_tuple=True)[0]
    weights = torch.ones(order.shape[0], dtype=torch.float64) if probs is None else probs.double()[order, experts]
    out = torch.zeros(routing_map.shape[0], rows.shape[1], dtype=torch.float64)
    for row, (token, weight) in enumerate(zip(order.tolist(), weights.tolist())):
        out[token] += weight * rows[row].double()
    return out


def permute_grads(grad_rows: torch.Tensor, grad_row_probs: torch.Tensor, routing_map: torch.Tensor):
    """Permute's backward: the tokens' gradient sums the gradients of their copies; the probs'
    gradient [T, X] puts each row's back at (token, expert), zeros elsewhere."""
    order = permutation_order(routing_map)
    experts = routing_map.t().nonzero(as_tuple=True)[0]
    grad_tokens = torch.zeros(routing_map.shape[0], grad_rows.shape[1], dtype=torch.float64)
    for row, token in enumerate(order.tolist()):
        grad_tokens[token] += grad_rows[row].double()
    grad_probs = torch.zeros(routing_map.shape, dtype=torch.float64)
    grad_probs[order, experts] = grad_row_probs.double()
    return grad_tokens, grad_probs


def unpermute_grads(grad_out: torch.Tensor, rows: torch.Tensor, routing_map: torch.Tensor,
                    probs: torch.Tensor | None = None):
    """Unpermute's backward: row(t, x)'s gradient is grad_out[t] (times probs[t, x]); with probs,
    probs[t, x]'s gradient is <grad_out[t], row(t, x)> ([T, X], zeros off the routing map)."""
    order = permutation_order(routing_map)
    experts = routing_map.t().nonzero(as_tuple=True)[0]
    gathered = grad_out.double()[order]
    if probs is None:
        return gathered, None
    grad_rows = gathered * probs.double()[order, experts].unsqueeze(-1)
    grad_probs = torch.zeros(routing_map.shape, dtype=torch.float64)
    grad_probs[order, experts] = (gathered * rows.double()).sum(dim=-1)
    return grad_rows, grad_probs
