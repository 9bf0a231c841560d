"""Seeded routing of tokens to experts, as a router would produce it: each token's top-k of all the
model's experts (random logits plus a per-expert load offset, so that experts receive uneven token
counts), one chosen expert forced to receive none, and the routing weights the model's score
function gives (sigmoid scores normalised over the top-k and scaled, or a softmax over the top-k
logits). Returns the routing map [tokens, experts] and the probs [tokens, experts] (zeros off the
map), as megatron-core's router hands them to the token dispatcher."""

from dataclasses import dataclass

import torch

from correctness.models import ModelFacts
from correctness.moe.shapes import MoeShape

EXPERT_LOAD_STD = 0.4  # spread of the per-expert logit offset: uneven loads


@dataclass(frozen=True)
class Routing:
    routing_map: torch.Tensor  # [tokens, experts] bool
    probs: torch.Tensor  # [tokens, experts], the router's dtype; zero where not routed


def seeded_routing(shape: MoeShape, model: ModelFacts, generator: torch.Generator, empty_expert: int | None) -> Routing:
    logits = torch.randn(shape.tokens, shape.experts, generator=generator, dtype=torch.float64)
    logits += EXPERT_LOAD_STD * torch.randn(shape.experts, generator=generator, dtype=torch.float64)
    if empty_expert is not None:
        logits[:, empty_expert] = -torch.inf
    top_logits, top = logits.topk(shape.top_k, dim=-1)
    moe = model.field("moe")
    if moe.get("routing") == "sigmoid":
        scores = torch.sigmoid(top_logits)
        weights = scores / scores.sum(dim=-1, keepdim=True) * float(moe.get("routing_scaling_factor") or 1.0)
    else:
        weights = torch.softmax(top_logits, dim=-1)
    routing_map = torch.zeros(shape.tokens, shape.experts, dtype=torch.bool).scatter_(1, top, True)
    probs = torch.zeros(shape.tokens, shape.experts, dtype=torch.float64).scatter_(1, top, weights)
    return Routing(routing_map=routing_map, probs=probs.to(shape.torch_probs_dtype))
