"""The experts' computation on one EP rank, forward and backward: rows grouped by expert, each
expert's MLP (fc1, the activation, the routing weight, fc2), as megatron-core 0.16's expert modules
compute it (transformer/moe/experts.py):

- `SequentialMLP` (no `--moe-grouped-gemm`): one megatron `MLP` per expert, each two GEMMs
  (ColumnParallelLinear, RowParallelLinear: torch matmuls), over `torch.split` of the rows;
- `TEGroupedMLP` (`--moe-grouped-gemm`, the recipes' choice): TE's `GroupedLinear` for fc1 and fc2,
  one grouped GEMM each over all experts' rows (`m_splits` the token counts);
- both: the activation (`squared_relu`, or SwiGLU for a gated unit), times the token's routing
  weight in the weight's dtype (FP32 with `--moe-router-dtype fp32`), cast back to BF16.

Paths: `MegatronSequentialMLP` runs megatron-core's SequentialMLP module itself (the default);
`TorchGroupedMM` is the grouped GEMM on the CPU, `torch.nn.functional.grouped_mm` (torch 2.13 runs
it on the CPU for BF16 and FP32; not for FP64), called as TEGroupedMLP calls GroupedLinear;
`TeGroupedLinear` runs TE's GroupedLinear (CUDA); `Fp64Experts` is the reference.

Megatron on a machine without a process group: the module is built with a stand-in group of size 1
(`SingleRankGroup`: Megatron reads only its size and rank) for the EP, expert-TP and expert-DP
groups, and `torch.distributed.is_initialized` reports True while it is built and run
(`megatron_without_process_group`): megatron's `get_tensor_model_parallel_group_if_none` returns
None without a process group, and its TP mappings (`copy_to_`/`reduce_from_tensor_model_parallel_
region`) call it on every forward; with a group of size 1 they return their input and no collective
runs. The activation `squared_relu` is megatron's own function with its `jit_fuser`
(torch.compile) wrapper undone (`eager_activation`): compiling it costs 12-19 s per process on a
CPU, and both paths apply the same function, so the lever judges the GEMMs.
"""

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, replace
from unittest import mock

import torch

from correctness.errors import ImplementationUnavailable
from correctness.lever import ImplementationOutput
from correctness.models import ModelFacts
from correctness.moe.routing import seeded_routing
from correctness.moe.shapes import MoeShape
from correctness.provenance import megatron_core_version
from references.moe_experts import experts_mlp_with_grads

EMPTY_LOCAL_EXPERT = 1  # the local expert that receives no token


@dataclass(frozen=True, kw_only=True)
class ExpertsInputs:
    shape: MoeShape
    rows: torch.Tensor  # [R, d]: the rows of the rank's experts, grouped by expert
    counts: tuple[int, ...]  # rows per local expert
    probs: torch.Tensor  # [R]: each row's routing weight, the router's dtype
    w1: torch.Tensor  # [E, fc1 width, d]
    w2: torch.Tensor  # [E, d, ffn]
    grad_out: torch.Tensor  # [R, d]


def make_experts_inputs(shape: MoeShape, model: ModelFacts, seed: int, device: torch.device) -> ExpertsInputs:
    """Tokens routed over all experts; EP rank 0's first `local_experts` experts keep theirs, local
    expert EMPTY_LOCAL_EXPERT none."""
    generator = torch.Generator().manual_seed(seed)
    empty = EMPTY_LOCAL_EXPERT if shape.local_experts > EMPTY_LOCAL_EXPERT else None
    routing = seeded_routing(shape, model, generator, empty)
    local_map = routing.routing_map[:, :shape.local_experts]
    experts, tokens = local_map.t().nonzero(as_tuple=True)
    counts = tuple(int(c) for c in local_map.sum(dim=0))
    dtype = shape.torch_dtype
    token_values = torch.randn(shape.tokens, shape.expert_input, generator=generator)
    w1 = torch.randn(shape.local_experts, shape.fc1_width, shape.expert_input, generator=generator) / shape.expert_input ** 0.5
    w2 = torch.randn(shape.local_experts, shape.expert_input, shape.ffn, generator=generator) / shape.ffn ** 0.5
    grad_out = torch.randn(len(tokens), shape.expert_input, generator=generator)
    return ExpertsInputs(
        shape=shape, rows=token_values[tokens].to(dtype).to(device), counts=counts,
        probs=routing.probs[tokens, experts].to(device), w1=w1.to(dtype).to(device), w2=w2.to(dtype).to(device),
        grad_out=grad_out.to(dtype).to(device),
    )


def _outputs(out, rows, probs, w1_grads, w2_grads) -> dict[str, torch.Tensor]:
    tensors = {"out": out.detach(), "grad_input": rows.grad, "grad_probs": probs.grad}
    for expert, (g1, g2) in enumerate(zip(w1_grads, w2_grads)):
        tensors[f"grad_fc1_weight{expert}"] = g1
        tensors[f"grad_fc2_weight{expert}"] = g2
    return tensors


def eager_activation(shape: MoeShape):
    """Megatron's activation for the shape, eager (its torch.compile wrapper undone)."""
    if shape.activation == "squared_relu":
        from megatron.core.activations import squared_relu

        return getattr(squared_relu, "_torchdynamo_orig_callable", squared_relu)
    return torch.nn.functional.silu


def activation_times_probs(h: torch.Tensor, probs: torch.Tensor, shape: MoeShape, activation) -> torch.Tensor:
    """TEGroupedMLP's unfused activation (experts.py bias_act_func, its last branch): the GLU or the
    activation, times the routing weight, cast back to the GEMM's dtype."""
    if shape.gated:
        gate, linear = torch.chunk(h, 2, dim=-1)
        h = activation(gate) * linear
    else:
        h = activation(h)
    return (h * probs.unsqueeze(-1)).to(h.dtype)


@dataclass(frozen=True)
class TorchGroupedMM:
    """fc1 and fc2 each one `torch.nn.functional.grouped_mm` over all experts (offsets the running
    row counts), as TEGroupedMLP calls TE's GroupedLinear."""

    name: str = "torch-grouped-mm"

    def run(self, inputs: ExpertsInputs) -> ImplementationOutput:
        grouped_mm = getattr(torch.nn.functional, "grouped_mm", None)
        if grouped_mm is None:
            raise ImplementationUnavailable(f"torch {torch.__version__} has no torch.nn.functional.grouped_mm")
        shape = inputs.shape
        rows, probs, w1, w2 = (t.detach().clone().requires_grad_() for t in (inputs.rows, inputs.probs, inputs.w1, inputs.w2))
        offsets = torch.tensor(inputs.counts, device=rows.device).cumsum(0).to(torch.int32)
        try:
            fc1 = grouped_mm(rows, w1.transpose(1, 2), offs=offsets)
        except RuntimeError as error:
            if "Expected" in str(error) or "not supported" in str(error).lower():
                raise ImplementationUnavailable(
                    f"torch grouped_mm refuses {rows.dtype} on {rows.device}: {error}") from None
            raise
        hidden = activation_times_probs(fc1, probs, shape, eager_activation(shape))
        out = grouped_mm(hidden, w2.transpose(1, 2), offs=offsets)
        out.backward(inputs.grad_out)
        return ImplementationOutput(
            tensors=_outputs(out, rows, probs, w1.grad, w2.grad), backend=self.name,
            details={"function": "torch.nn.functional.grouped_mm", "torch": torch.__version__,
                     "counts": list(inputs.counts), "device": str(rows.device)},
        )


@dataclass(frozen=True)
class SingleRankGroup:
    """Stands in for a process group of one rank: megatron reads only its size and rank."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


@contextlib.contextmanager
def megatron_without_process_group() -> Iterator[None]:
    """The module docstring's shim: torch.distributed reports a process group while Megatron's
    expert modules are built and run on stand-in groups of one rank."""
    with mock.patch.object(torch.distributed, "is_initialized", lambda: True):
        yield


def megatron_config(shape: MoeShape, local_experts: int):
    from megatron.core.transformer.transformer_config import TransformerConfig

    with warnings.catch_warnings():  # about settings no call here reads (cuda_graph_scope)
        warnings.simplefilter("ignore")
        return TransformerConfig(
            num_layers=1, hidden_size=shape.expert_input, num_attention_heads=1, ffn_hidden_size=shape.ffn,
            num_moe_experts=local_experts, moe_ffn_hidden_size=shape.ffn, moe_router_topk=shape.top_k,
            activation_func=eager_activation(shape), gated_linear_unit=shape.gated, add_bias_linear=False,
            bias_activation_fusion=False, gradient_accumulation_fusion=False, bf16=shape.dtype == "bf16",
            fp16=shape.dtype == "fp16", params_dtype=shape.torch_dtype, use_cpu_initialization=True,
            perform_initialization=False, hidden_dropout=0.0, attention_dropout=0.0,
        )


@dataclass(frozen=True)
class MegatronSequentialMLP:
    """megatron-core's SequentialMLP (one MLP of ColumnParallelLinear and RowParallelLinear per
    expert), its weights the inputs'; the experts' input width is the config's hidden size (for a
    latent model the same as SequentialMLP's moe_latent_size: MLP reads one or the other)."""

    name: str = "megatron-sequential-mlp"

    def run(self, inputs: ExpertsInputs) -> ImplementationOutput:
        try:
            from megatron.core.process_groups_config import ProcessGroupCollection
            from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
            from megatron.core.transformer.mlp import MLPSubmodules
            from megatron.core.transformer.moe.experts import SequentialMLP
        except Exception as error:  # noqa: BLE001 - any import failure makes the path unavailable
            raise ImplementationUnavailable(
                f"megatron-core is not usable here: {type(error).__name__}: {error}") from None
        shape = inputs.shape
        local = len(inputs.counts)
        group = SingleRankGroup()
        with megatron_without_process_group():
            module = SequentialMLP(
                local, megatron_config(shape, local), MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
                pg_collection=ProcessGroupCollection(tp=group, ep=group, expt_tp=group, expt_dp=group),
            ).to(inputs.rows.device)
            with torch.no_grad():
                for expert, mlp in enumerate(module.local_experts):
                    mlp.linear_fc1.weight.copy_(inputs.w1[expert])
                    mlp.linear_fc2.weight.copy_(inputs.w2[expert])
            rows, probs = (t.detach().clone().requires_grad_() for t in (inputs.rows, inputs.probs))
            counts = torch.tensor(inputs.counts)  # SequentialMLP calls .tolist() on it
            out, _ = module(rows, counts, probs)
            out.backward(inputs.grad_out)

        def grad(parameter):
            return torch.zeros_like(parameter) if parameter.grad is None else parameter.grad

        return ImplementationOutput(
            tensors=_outputs(out, rows, probs, [grad(m.linear_fc1.weight) for m in module.local_experts],
                             [grad(m.linear_fc2.weight) for m in module.local_experts]),
            backend=self.name,
            details={"module": "megatron.core.transformer.moe.experts.SequentialMLP", "megatron_core": megatron_core_version(),
                     "shims": ["process groups of one rank (torch.distributed.is_initialized True)",
                               "activation eager (torch.compile wrapper undone)"]},
        )


@dataclass(frozen=True)
class TeGroupedLinear:
    """TE's GroupedLinear for fc1 and fc2 (CUDA), as TEGroupedMLP runs them (m_splits the counts)."""

    name: str = "te-grouped-linear"

    def run(self, inputs: ExpertsInputs) -> ImplementationOutput:
        try:
            import transformer_engine
            from transformer_engine.pytorch import GroupedLinear
        except Exception as error:  # noqa: BLE001
            raise ImplementationUnavailable(
                f"Transformer Engine is not usable here: {type(error).__name__}: {error}") from None
        if inputs.rows.device.type != "cuda":
            raise ImplementationUnavailable("TE's GroupedLinear runs on CUDA only")
        shape = inputs.shape
        local, device = len(inputs.counts), inputs.rows.device

        def grouped(weights: torch.Tensor):
            layer = GroupedLinear(local, weights.shape[2], weights.shape[1], bias=False, params_dtype=weights.dtype,
                                  device=device)
            with torch.no_grad():
                for expert in range(local):
                    getattr(layer, f"weight{expert}").copy_(weights[expert])
            return layer

        fc1, fc2 = grouped(inputs.w1), grouped(inputs.w2)
        rows, probs = (t.detach().clone().requires_grad_() for t in (inputs.rows, inputs.probs))
        splits = list(inputs.counts)
        hidden = activation_times_probs(fc1(rows, splits), probs, shape, eager_activation(shape))
        out = fc2(hidden, splits)
        out.backward(inputs.grad_out)

        def grad(layer, expert):
            weight = getattr(layer, f"weight{expert}")
            return torch.zeros_like(weight) if weight.grad is None else weight.grad

        return ImplementationOutput(
            tensors=_outputs(out, rows, probs, [grad(fc1, e) for e in range(local)], [grad(fc2, e) for e in range(local)]),
            backend=self.name,
            details={"module": "transformer_engine.pytorch.GroupedLinear",
                     "transformer_engine": getattr(transformer_engine, "__version__", "unknown")},
        )


@dataclass(frozen=True)
class Fp64Experts:
    name: str = "fp64-experts"

    def run(self, inputs: ExpertsInputs) -> ImplementationOutput:
        tensors = experts_mlp_with_grads(inputs.rows, list(inputs.counts), inputs.w1, inputs.w2, inputs.probs,
                                         inputs.grad_out, inputs.shape.activation)
        return ImplementationOutput(tensors=tensors, backend=self.name)


# Deliberately wrong inputs for the negative controls (correctness.lever.Mutated).

def busiest_expert(inputs: ExpertsInputs) -> int:
    return max(range(len(inputs.counts)), key=lambda e: inputs.counts[e])


def token_to_neighbour(inputs: ExpertsInputs) -> ExpertsInputs:
    """The busiest expert's last row counted as its neighbour's: that row meets the wrong weights."""
    expert = busiest_expert(inputs)
    if expert + 1 >= len(inputs.counts):
        expert -= 1  # the previous expert's last row goes to the busiest instead
    counts = list(inputs.counts)
    counts[expert] -= 1
    counts[expert + 1] += 1
    return replace(inputs, counts=tuple(counts))


def weights_swapped(inputs: ExpertsInputs) -> ExpertsInputs:
    """The busiest expert's weights swapped with the next busy expert's."""
    order = sorted(range(len(inputs.counts)), key=lambda e: -inputs.counts[e])
    a, b = order[0], order[1]
    permutation = list(range(len(inputs.counts)))
    permutation[a], permutation[b] = b, a
    return replace(inputs, w1=inputs.w1[permutation], w2=inputs.w2[permutation])


def token_dropped(inputs: ExpertsInputs) -> ExpertsInputs:
    """The busiest expert's first row skipped: zero input and weight (no output, no gradient)."""
    row = sum(inputs.counts[:busiest_expert(inputs)])
    rows, probs = inputs.rows.clone(), inputs.probs.clone()
    rows[row] = 0
    probs[row] = 0
    return replace(inputs, rows=rows, probs=probs)


def probs_not_applied(inputs: ExpertsInputs) -> ExpertsInputs:
    return replace(inputs, probs=torch.ones_like(inputs.probs))

