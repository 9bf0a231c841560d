"""The token permutation around the experts, forward and backward, as megatron-core 0.16's alltoall
dispatcher calls it (transformer/moe/token_dispatcher.py: `permute` before the all-to-all,
`unpermute` after it; moe_utils.py):

- permute(tokens [T, d], routing_map [T, X], probs [T, X]) -> the rows [R, d] grouped by expert
  (experts in order, each expert's tokens in order) and their probs [R]; its backward sums each
  token's R-row gradients over its top-k copies and puts the probs' gradients back at (token, expert);
- unpermute(rows [R, d]) -> [T, d], each token the sum of its top-k rows (the alltoall dispatcher:
  the routing weights were applied inside the experts), or with merging probs the weighted sum;
  its backward gathers the token's gradient to each of its rows (times the weight), and the
  weights' gradient is <gradient, row>.

`fused=False` (the default without `--moe-permute-fusion`) is Megatron's torch code: index_select
(its backward an index_add in the tokens' dtype), masked_select of the probs, and a scatter_add
into a BF16 buffer for the combine (each of a token's top-k additions rounded to BF16; with
merging probs the rows are promoted to FP32 by the FP32 weights and summed there). `fused=True`
calls TE's `moe_permute_with_probs` / `moe_unpermute` (TE 2.17 transformer_engine/pytorch/
permutation.py, Triton kernels, CUDA only): the same gathers, and the sums accumulated in FP32 and
rounded once (common/triton/permutation.py `_unpermute_kernel`). `IndexPermutation` does that
arithmetic in torch on the CPU (a row map from the (token, expert) pairs, FP32 index_add, one
rounding): it stands in for TE's kernels where they cannot run, and is not TE.

The gathers are exact: their tensors (EXACT_TENSORS) must equal FP64's bit for bit in every path;
the sums (SUM_TENSORS) round, and are judged by the suite's rule.
"""

from dataclasses import dataclass, replace

import torch

from correctness.errors import ImplementationUnavailable
from correctness.lever import ImplementationOutput
from correctness.models import ModelFacts
from correctness.moe.routing import seeded_routing
from correctness.moe.shapes import MoeShape
from references import moe_experts as reference

EXACT_TENSORS = ("permuted_tokens", "permuted_probs", "grad_probs", "grad_rows")
SUM_TENSORS = ("grad_tokens", "combined", "combined_weighted", "grad_rows_weighted", "grad_merging_probs")


@dataclass(frozen=True, kw_only=True)
class PermuteInputs:
    shape: MoeShape
    tokens: torch.Tensor  # [T, d]
    routing_map: torch.Tensor  # [T, X] bool
    probs: torch.Tensor  # [T, X], zero off the map
    grad_permuted: torch.Tensor  # [R, d]: upstream gradient of the permuted rows
    grad_permuted_probs: torch.Tensor  # [R]
    expert_rows: torch.Tensor  # [R, d]: the experts' outputs to combine
    grad_combined: torch.Tensor  # [T, d]


def make_permute_inputs(shape: MoeShape, model: ModelFacts, seed: int, device: torch.device) -> PermuteInputs:
    generator = torch.Generator().manual_seed(seed)
    routing = seeded_routing(shape, model, generator, empty_expert=None)
    rows = int(routing.routing_map.sum())
    dtype = shape.torch_dtype

    def normal(*size):
        return torch.randn(*size, generator=generator).to(dtype).to(device)

    return PermuteInputs(
        shape=shape, tokens=normal(shape.tokens, shape.expert_input), routing_map=routing.routing_map.to(device),
        probs=routing.probs.to(device), grad_permuted=normal(rows, shape.expert_input),
        grad_permuted_probs=torch.randn(rows, generator=generator).to(routing.probs.dtype).to(device),
        expert_rows=normal(rows, shape.expert_input), grad_combined=normal(shape.tokens, shape.expert_input),
    )


@dataclass(frozen=True)
class MegatronPermutation:
    """megatron-core's permute and unpermute (moe_utils.py), fused=False (torch) or True (TE)."""

    fused: bool

    @property
    def name(self) -> str:
        return "megatron-permute-te-fused" if self.fused else "megatron-permute-torch"

    def run(self, inputs: PermuteInputs) -> ImplementationOutput:
        try:
            from megatron.core.transformer.moe import moe_utils
        except Exception as error:  # noqa: BLE001
            raise ImplementationUnavailable(
                f"megatron-core is not usable here: {type(error).__name__}: {error}") from None
        if self.fused and not moe_utils.HAVE_TE:
            raise ImplementationUnavailable(
                "megatron-core found no Transformer Engine: its fused permute is not available")
        routing_map, rows = inputs.routing_map, inputs.grad_permuted.shape[0]
        tokens, probs = (t.detach().clone().requires_grad_() for t in (inputs.tokens, inputs.probs))
        permuted, permuted_probs, mapping = moe_utils.permute(tokens, routing_map, probs=probs, num_out_tokens=rows,
                                                              fused=self.fused)
        torch.autograd.backward([permuted, permuted_probs], [inputs.grad_permuted, inputs.grad_permuted_probs])
        expert_rows = inputs.expert_rows.detach().clone().requires_grad_()
        combined = moe_utils.unpermute(expert_rows, mapping, restore_shape=tokens.shape, routing_map=routing_map,
                                       fused=self.fused)
        combined.backward(inputs.grad_combined)
        weighted_rows, merging_probs = (t.detach().clone().requires_grad_() for t in (inputs.expert_rows, inputs.probs))
        weighted = moe_utils.unpermute(weighted_rows, mapping, restore_shape=tokens.shape, probs=merging_probs,
                                       routing_map=routing_map, fused=self.fused)
        weighted.backward(inputs.grad_combined)
        tensors = {
            "permuted_tokens": permuted.detach(), "permuted_probs": permuted_probs.detach(), "grad_probs": probs.grad,
            "grad_rows": expert_rows.grad, "grad_tokens": tokens.grad, "combined": combined.detach(),
            "combined_weighted": weighted.detach(), "grad_rows_weighted": weighted_rows.grad,
            "grad_merging_probs": merging_probs.grad,
        }
        from correctness.provenance import megatron_core_version

        return ImplementationOutput(tensors=tensors, backend=self.name,
                          details={"functions": "megatron.core.transformer.moe.moe_utils.permute / unpermute",
                                   "fused": self.fused, "megatron_core": megatron_core_version()})


@dataclass(frozen=True)
class IndexPermutation:
    """TE's fused kernels' arithmetic in torch (module docstring): a stand-in, on the CPU."""

    name: str = "torch-index-permute"

    def run(self, inputs: PermuteInputs) -> ImplementationOutput:
        dtype, routing_map = inputs.tokens.dtype, inputs.routing_map
        pairs = routing_map.nonzero()  # (token, expert), token-major as a top-k index map
        order = torch.sort(pairs[:, 1], stable=True).indices  # grouped by expert, tokens in order
        token, expert = pairs[order, 0], pairs[order, 1]
        weight = inputs.probs[token, expert]
        accumulate = torch.float32

        def sum_to_tokens(values: torch.Tensor) -> torch.Tensor:
            total = torch.zeros(routing_map.shape[0], values.shape[1], dtype=accumulate, device=values.device)
            return total.index_add_(0, token, values.to(accumulate)).to(dtype)

        grad_probs = torch.zeros_like(inputs.probs)
        grad_probs[token, expert] = inputs.grad_permuted_probs
        grad_gathered = inputs.grad_combined[token].to(accumulate)
        grad_merging = torch.zeros_like(inputs.probs)
        grad_merging[token, expert] = (grad_gathered * inputs.expert_rows.to(accumulate)).sum(dim=-1).to(grad_merging.dtype)
        tensors = {
            "permuted_tokens": inputs.tokens[token], "permuted_probs": weight, "grad_probs": grad_probs,
            "grad_rows": inputs.grad_combined[token], "grad_tokens": sum_to_tokens(inputs.grad_permuted),
            "combined": sum_to_tokens(inputs.expert_rows),
            "combined_weighted": sum_to_tokens(inputs.expert_rows.to(accumulate) * weight.to(accumulate).unsqueeze(-1)),
            "grad_rows_weighted": (grad_gathered * weight.to(accumulate).unsqueeze(-1)).to(dtype),
            "grad_merging_probs": grad_merging,
        }
        return ImplementationOutput(tensors=tensors, backend=self.name,
                          details={"stands_in_for": "TE moe_permute_with_probs / moe_unpermute (FP32 accumulation)"})


@dataclass(frozen=True)
class Fp64Permutation:
    name: str = "fp64-permutation"

    def run(self, inputs: PermuteInputs) -> ImplementationOutput:
        routing_map = inputs.routing_map.cpu()
        permuted, permuted_probs = reference.permute(inputs.tokens.cpu(), routing_map, inputs.probs.cpu())
        grad_tokens, grad_probs = reference.permute_grads(inputs.grad_permuted.cpu(), inputs.grad_permuted_probs.cpu(),
                                                          routing_map)
        rows = inputs.expert_rows.cpu()
        grad_rows, _ = reference.unpermute_grads(inputs.grad_combined.cpu(), rows, routing_map)
        grad_rows_weighted, grad_merging = reference.unpermute_grads(inputs.grad_combined.cpu(), rows, routing_map,
                                                                     inputs.probs.cpu())
        tensors = {
            "permuted_tokens": permuted, "permuted_probs": permuted_probs, "grad_probs": grad_probs,
            "grad_rows": grad_rows, "grad_tokens": grad_tokens, "combined": reference.unpermute(rows, routing_map),
            "combined_weighted": reference.unpermute(rows, routing_map, inputs.probs.cpu()),
            "grad_rows_weighted": grad_rows_weighted, "grad_merging_probs": grad_merging,
        }
        return ImplementationOutput(
            tensors={k: v.to(inputs.tokens.device) for k, v in tensors.items()}, backend=self.name)


@dataclass(frozen=True)
class Judged:
    """A permutation path whose outputs are cut down to the tensors one lever judges."""

    path: object
    tensors: tuple[str, ...]

    @property
    def name(self) -> str:
        return self.path.name

    def run(self, inputs: PermuteInputs) -> ImplementationOutput:
        output = self.path.run(inputs)
        return replace(output, tensors={name: output.tensors[name] for name in self.tensors})


# Deliberately wrong inputs for the negative controls.

def _routed_pair(inputs: PermuteInputs) -> tuple[int, int]:
    token, expert = inputs.routing_map.nonzero()[0].tolist()
    return token, expert


def token_to_neighbour(inputs: PermuteInputs) -> PermuteInputs:
    """Token 0's first expert replaced by the next expert it does not use (its weight moves along)."""
    token, expert = _routed_pair(inputs)
    neighbour = next(e for e in range(expert + 1, inputs.routing_map.shape[1]) if not inputs.routing_map[token, e])
    routing_map, probs = inputs.routing_map.clone(), inputs.probs.clone()
    routing_map[token, expert], routing_map[token, neighbour] = False, True
    probs[token, neighbour], probs[token, expert] = probs[token, expert], 0
    return replace(inputs, routing_map=routing_map, probs=probs)


def experts_swapped(inputs: PermuteInputs) -> PermuteInputs:
    """The two busiest experts' columns of the routing map and probs swapped: their rows trade places."""
    counts = inputs.routing_map.sum(dim=0)
    a, b = counts.topk(2).indices.tolist()
    columns = list(range(inputs.routing_map.shape[1]))
    columns[a], columns[b] = b, a
    return replace(inputs, routing_map=inputs.routing_map[:, columns], probs=inputs.probs[:, columns])


def token_dropped(inputs: PermuteInputs) -> PermuteInputs:
    """Token 0 lost: its values and its first expert's output zero."""
    tokens, rows = inputs.tokens.clone(), inputs.expert_rows.clone()
    tokens[0] = 0
    _, expert = _routed_pair(inputs)
    rows[int(inputs.routing_map[:, :expert].sum())] = 0  # token 0 is its expert's first row
    return replace(inputs, tokens=tokens, expert_rows=rows)


def probs_not_applied(inputs: PermuteInputs) -> PermuteInputs:
    return replace(inputs, probs=inputs.routing_map.to(inputs.probs.dtype))
