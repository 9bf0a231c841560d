"""The router lever's shape, its seeded inputs and the FP64 routing they are judged against.

Inputs (synthetic, model-like): hidden states [sequence, batch, hidden] standard normal (the
router reads the pre-MLP RMSNorm's output, of unit RMS), the router weight [experts, hidden] normal
with std 1/sqrt(hidden) (the facts' rule for projections), so that logits are about standard normal;
the gating bias, where the model has one, likewise; all rounded to the recipe's dtype (BF16), as
Megatron holds them. The expert bias (FP32, as Megatron keeps it) is normal with std
EXPERT_BIAS_STD: a trained bias exists to move tokens between experts at the top-k boundary, so it
is of the order of the differences of the scores there (the trained values were not inspected).
The upstream gradient of the dense combination weights is standard normal, rounded to the
recipe's dtype so that every path (BF16, FP32, FP64) receives exactly the same values.

Ties: every input is continuous, so two experts of a token tie in FP64 (or FP32) with probability
zero. Near-ties are what a lower precision turns into different choices; `routing_figures` says,
per path, how many tokens chose another expert set than FP64 and how near to a tie those tokens
were (FP64's `boundary_gap`: the k-th best selection score minus the (k+1)-th).
"""

from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Any

import torch

from correctness.shapes import DTYPES
from references.router import route

EXPERT_BIAS_STD = 0.01


@dataclass(frozen=True, kw_only=True)
class RouterShape:
    model: str
    scale: str  # "smoke" or "recipe"
    seq_len: int
    batch: int
    hidden: int
    experts: int
    top_k: int
    score_function: str
    scaling_factor: float | None
    expert_bias: bool
    router_bias: bool
    pre_softmax: bool
    num_groups: int | None
    group_topk: int | None
    dtype: str
    recipe_router_dtype: str | None
    settings_sources: dict[str, str]

    @property
    def tokens(self) -> int:
        return self.seq_len * self.batch

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def id(self) -> str:
        return (f"{self.model}-router-{self.seq_len}x{self.batch}-h{self.hidden}-e{self.experts}-top{self.top_k}"
                f"-{self.score_function}-{self.dtype}")

    def record(self) -> dict[str, Any]:
        return {"id": self.id, "tokens": self.tokens, **asdict(self)}


@dataclass(frozen=True, kw_only=True)
class RouterInputs:
    shape: RouterShape
    hidden: torch.Tensor  # [seq, batch, hidden], the recipe's dtype
    weight: torch.Tensor  # [experts, hidden], the recipe's dtype
    router_bias: torch.Tensor | None  # [experts], the recipe's dtype
    expert_bias: torch.Tensor | None  # [experts], FP32
    upstream: torch.Tensor  # [tokens, experts], FP32 holding values of the recipe's dtype

    @cached_property
    def reference(self) -> dict[str, torch.Tensor]:
        return self.routed()

    def routed(self, round_logits: Callable[[torch.Tensor], torch.Tensor] | None = None,
               round_scores: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """FP64 routing of these inputs (references.router.route), the logits and the scores passed
        through `round_logits` and `round_scores` where given (a format floor's roundings)."""
        s = self.shape
        return route(self.hidden.reshape(-1, s.hidden), self.weight, top_k=s.top_k, score_function=s.score_function,
                     scaling_factor=s.scaling_factor, expert_bias=self.expert_bias, router_bias=self.router_bias,
                     pre_softmax=s.pre_softmax, num_groups=s.num_groups, group_topk=s.group_topk,
                     upstream=self.upstream, round_logits=round_logits, round_scores=round_scores)

    def routing_figures(self, routing_map: torch.Tensor, logits_dtype: torch.dtype) -> dict[str, Any]:
        """How a path's choice of experts compares with FP64's, token by token; near-ties: the
        share of tokens whose FP64 boundary gap is below one unit in the last place, in the path's
        logits dtype, of their k-th selection score (where a rounding can swap the order)."""
        reference = self.reference["chosen"]
        changed = (routing_map.reshape(reference.shape).to(reference.device) != reference).any(dim=-1)
        swapped = (routing_map.reshape(reference.shape).to(reference.device) & ~reference).sum(dim=-1)
        figures: dict[str, Any] = {
            "tokens": int(changed.numel()),
            "expert_set_changed": int(changed.sum()),
            "expert_set_changed_fraction": float(changed.float().mean()),
            "experts_swapped_per_changed_token": float(swapped[changed].float().mean()) if changed.any() else 0.0,
        }
        gap = self.reference.get("boundary_gap")
        if gap is not None:
            figures["fp64_boundary_gap_median"] = float(gap.median())
            score = self.reference["boundary_score"].abs()
            ulp = torch.finfo(logits_dtype).eps * torch.exp2(torch.floor(torch.log2(score.clamp(min=1e-30))))
            figures["fp64_gap_below_one_ulp_fraction"] = float((gap < ulp).double().mean())
            if changed.any():
                figures["fp64_boundary_gap_of_changed_median"] = float(gap[changed].median())
                figures["fp64_boundary_gap_of_changed_max"] = float(gap[changed].max())
        return figures


def make_inputs(shape: RouterShape, seed: int, device: torch.device) -> RouterInputs:
    generator = torch.Generator().manual_seed(seed)
    dtype = shape.torch_dtype
    hidden = torch.randn(shape.seq_len, shape.batch, shape.hidden, generator=generator)
    weight = torch.randn(shape.experts, shape.hidden, generator=generator) / shape.hidden ** 0.5
    router_bias = torch.randn(shape.experts, generator=generator) / shape.hidden ** 0.5 if shape.router_bias else None
    expert_bias = EXPERT_BIAS_STD * torch.randn(shape.experts, generator=generator) if shape.expert_bias else None
    upstream = torch.randn(shape.tokens, shape.experts, generator=generator).to(dtype).float()
    return RouterInputs(
        shape=shape, hidden=hidden.to(dtype).to(device), weight=weight.to(dtype).to(device),
        router_bias=None if router_bias is None else router_bias.to(dtype).to(device),
        expert_bias=None if expert_bias is None else expert_bias.to(device), upstream=upstream.to(device),
    )
