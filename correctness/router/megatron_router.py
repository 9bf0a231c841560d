"""Megatron's own router, `megatron.core.transformer.moe.router.TopKRouter` (megatron-core 0.16.1),
as a path of the router lever: built from a TransformerConfig with the recipe's router settings and
one `moe_router_dtype`, its weight (and expert bias) set to the case's, run forward and backward.

What it computes (router.py, moe/moe_utils.py): `gating` runs `router_gating_linear`, an autograd
Function whose forward is one GEMM of the BF16 hidden states and the BF16 weight with its output in
the router dtype (the input's, BF16, where moe_router_dtype is unset; FP32 or FP64 where it says
so: TE's general_gemm where megatron-core's `te_general_gemm` is bound and the dtype is not FP64,
else torch.mm of both taken to that dtype; beside TE 2.17 megatron-core 0.16.1 binds it to None, its
import of `get_workspace`, which TE removed in 2.11, failing, so torch.mm runs on a GPU too); its
backward gives the hidden states' gradient in their dtype and the weight's in its dtype (BF16 both).
Then `routing`: `topk_routing_with_score_function` (unfused: moe_router_fusion is off in every
recipe here): sigmoid scores `torch.sigmoid(logits.float()).type_as(logits)` (so
rounded to BF16 where the logits are BF16), plus the FP32 expert bias for the choice only, top-k,
the chosen scores normalised (k > 1) and scaled; softmax scoring: top-k of the logits and a softmax
over them in FP32, cast back to the logits' dtype. The result is dense: `routing_probs`
[tokens, experts], zero where not routed, in the logits' dtype, and the boolean routing map.

On a machine without a GPU, `router_on_cpu()` stands in for the CUDA-only calls, for its duration:
- `torch.cuda.current_device()` returns "cpu": TopKRouter allocates its expert-bias buffers there,
  and `gating` moves a CPU weight to that device;
- `moe_utils.te_general_gemm` is None where megatron-core left it undefined: moe_utils.py
  (0.16.1, lines 22-39) binds the name only inside its `import transformer_engine` try block, and
  `RouterGatingLinearFunction` reads it unguarded (`te_general_gemm is not None`), so without TE
  the router raises NameError; with the name None its own torch branch runs (on a GPU without TE
  too; with TE the name is TE's and nothing is changed);
- BF16 and FP16 matrix products on CPU tensors, forward and backward (correctness.cpu_gemm), are the
  FP32 product rounded once to the inputs' dtype, as
  cuBLAS and TE's GEMM compute it on a GPU (FP32 accumulation, one rounding): torch's CPU BF16 GEMM
  on a host without BF16 hardware is emulated (slow, and its rounding depends on the host). FP32 and
  FP64 GEMMs are torch's own.
On every device `_apply_expert_bias` (decorated with Megatron's jit_fuser, torch.compile) runs
eagerly (`torch.compiler.set_stance("force_eager")`): it only adds the routing map to the buffer of
tokens per expert, under no_grad, which changes no output; compiling it would cost seconds per run.
The aux losses are off (coefficient 0, as every recipe here sets or leaves it), so no process group
is used: the groups are stand-ins that report size 1.

Negative controls are this path with one thing wrong (`mutation`, CONTROL_MUTATIONS): the expert
bias zeroed (ignored in the choice), top-k one less, the scaling factor left out, the weights not
normalised (the chosen sigmoid scores kept as they are; with softmax scoring, moe_router_pre_softmax
flipped, so that the softmax runs over all experts instead of the chosen ones), or the score
function swapped (sigmoid for softmax and back; Megatron takes an expert bias only with sigmoid, so
a sigmoid router swapped to softmax loses its bias too). The wrong implementations in BF16
(FORMAT_MUTATIONS, correctness/router/wrong.py) replace the values of the gating call's BF16 logits
and keep its backward: the FP32 product truncated to BF16, or a split-K product whose partial sums
are rounded and added in BF16.
"""

import contextlib
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch

from correctness.megatron.process_groups import TensorParallelSize
from correctness.cpu_gemm import gemm_as_cublas
from correctness.errors import require_megatron_core
from correctness.lever import ImplementationOutput
from correctness.provenance import megatron_core_version
from references.rounding import round_toward_zero

ROUTER_DTYPE_NAMES = {None: "bf16", "fp32": "fp32", "fp64": "fp64"}  # moe_router_dtype -> the logits' dtype at BF16 inputs
SPLIT_K = 16  # the gating GEMM's K splits in the split-K mutation
# Negative controls: the router with one thing wrong in its configuration or its weights.
CONTROL_MUTATIONS = ("expert bias ignored", "top-k - 1", "scaling factor left out", "weights not normalised",
                     "score function swapped")
# Wrong implementations in the candidate's own format (correctness/router/wrong.py): BF16 logits
# made otherwise than by one rounding to nearest of the FP32 product.
LOGITS_TRUNCATED = "logits truncated to BF16"
LOGITS_SPLIT_K = f"gating GEMM split-K ({SPLIT_K}) partial sums reduced in BF16"
FORMAT_MUTATIONS = (LOGITS_TRUNCATED, LOGITS_SPLIT_K)
MUTATIONS = CONTROL_MUTATIONS + FORMAT_MUTATIONS


def split_k_product(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, splits: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """hidden @ weight^T (+ bias) as a split-K GEMM whose partial sums are reduced in `dtype`: each
    of `splits` blocks of the hidden dimension is an FP32 product rounded to `dtype`, and they are
    added one by one in `dtype` (cuBLAS's reduced-precision split-K reduction, which torch allows by
    default for BF16: allow_bf16_reduced_precision_reduction); a bias is added last, in `dtype`."""
    total = None
    for h, w in zip(hidden.chunk(splits, dim=1), weight.chunk(splits, dim=1)):
        partial = torch.mm(h.float(), w.float().t()).to(dtype)
        total = partial if total is None else total + partial
    return total if bias is None else total + bias.to(dtype)


class _ForwardReplaced(torch.autograd.Function):
    """`value` in the forward, the gradient passed to `tensor` in the backward."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return value.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


@contextlib.contextmanager
def te_gemm_name() -> Iterator[bool]:
    """megatron-core's moe_utils.te_general_gemm bound to None where it left the name undefined (no TE);
    yields whether it bound it (where TE is importable megatron-core binds the name itself)."""
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "te_general_gemm"):
        yield False
        return
    with mock.patch.object(moe_utils, "te_general_gemm", None, create=True):
        yield True


@contextlib.contextmanager
def router_on_cpu() -> Iterator[None]:
    """The CPU shims of the module docstring, for the duration only."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(torch.cuda, "current_device", lambda: "cpu"))
        stack.enter_context(gemm_as_cublas())
        yield


def _te_gemm() -> bool:
    from megatron.core.transformer.moe import moe_utils

    return getattr(moe_utils, "te_general_gemm", None) is not None


@dataclass(frozen=True)
class MegatronRouter:
    """TopKRouter with moe_router_dtype `router_dtype` (None: the logits in the input's BF16), or
    with one of MUTATIONS (a negative control)."""

    router_dtype: str | None
    mutation: str | None = None
    # The dtype every judged tensor is handed over in: candidate and default must agree, so the
    # lever gives both the wider of their logits' dtypes (BF16 values upcast exactly); `details`
    # names the dtypes the router computed in.
    judged_dtype: torch.dtype = torch.float32

    def __post_init__(self):
        if self.router_dtype not in ROUTER_DTYPE_NAMES:
            raise ValueError(f"router path: moe_router_dtype {self.router_dtype!r} is not None, fp32 or fp64")
        if self.mutation is not None and self.mutation not in MUTATIONS:
            raise ValueError(f"router path: unknown mutation {self.mutation!r} (one of {', '.join(MUTATIONS)})")

    @property
    def name(self) -> str:
        base = f"megatron-router-{ROUTER_DTYPE_NAMES[self.router_dtype]}"
        return base if self.mutation is None else f"{base} ({self.mutation})"

    def config(self, settings):
        top_k = settings.top_k - 1 if self.mutation == "top-k - 1" else settings.top_k
        pre_softmax = settings.pre_softmax
        if self.mutation == "weights not normalised" and settings.score_function == "softmax":
            pre_softmax = not pre_softmax
        score_function, expert_bias = settings.score_function, settings.expert_bias
        if self.mutation == "score function swapped":
            # Megatron takes an expert bias only with sigmoid scoring, so softmax drops it too, and
            # softmax at top-1 only before the choice
            score_function = "softmax" if score_function == "sigmoid" else "sigmoid"
            expert_bias = expert_bias and score_function == "sigmoid"
            pre_softmax = score_function == "softmax" and (pre_softmax or top_k == 1)
        with warnings.catch_warnings():  # about fields no router call reads, and Megatron's advice against BF16 routing
            for message in ("moe_ffn_hidden_size is not set", "full scope is deprecated", "without fp32 routing"):
                warnings.filterwarnings("ignore", message=f".*{message}", category=UserWarning)
            return self._config(settings, top_k, pre_softmax, score_function, expert_bias)

    def _config(self, settings, top_k, pre_softmax, score_function, expert_bias):
        from megatron.core.transformer.transformer_config import TransformerConfig

        return TransformerConfig(
            num_layers=1, hidden_size=settings.hidden, num_attention_heads=1,
            num_moe_experts=settings.experts, moe_router_topk=top_k,
            moe_router_score_function=score_function,
            moe_router_enable_expert_bias=expert_bias,
            moe_router_topk_scaling_factor=None if self.mutation == "scaling factor left out" else settings.scaling_factor,
            moe_router_num_groups=settings.num_groups, moe_router_group_topk=settings.group_topk,
            moe_router_pre_softmax=pre_softmax, moe_router_dtype=self.router_dtype,
            moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_router_fusion=False,
            add_bias_linear=settings.router_bias, bf16=settings.dtype == "bf16", params_dtype=settings.torch_dtype,
            perform_initialization=False, hidden_dropout=0.0, attention_dropout=0.0,
        )

    def module(self, inputs):
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.moe.router import TopKRouter

        one = TensorParallelSize(1)
        router = TopKRouter(config=self.config(inputs.shape),
                            pg_collection=ProcessGroupCollection(tp=one, cp=one, tp_cp=one, tp_dp_cp=one))
        device = inputs.hidden.device
        router.weight.data = inputs.weight.detach().clone().to(device)
        if router.bias is not None:
            router.bias.data = inputs.router_bias.detach().clone().to(device)
        if router.expert_bias is not None:
            bias = inputs.expert_bias.detach().clone()
            router.expert_bias.data = torch.zeros_like(bias) if self.mutation == "expert bias ignored" else bias
            router.expert_bias.data = router.expert_bias.data.to(device)
            router.local_tokens_per_expert.data = router.local_tokens_per_expert.data.to(device)
        return router.train()

    def run(self, inputs) -> ImplementationOutput:
        require_megatron_core()
        on_cpu = inputs.hidden.device.type == "cpu"
        clock = time.perf_counter()
        with contextlib.ExitStack() as stack:
            if on_cpu:
                stack.enter_context(router_on_cpu())
            name_bound = stack.enter_context(te_gemm_name())
            stack.enter_context(torch.compiler.set_stance("force_eager"))
            router = self.module(inputs)
            gated = []  # the logits of the router's own gating call, kept as it returns them
            gating = router.gating
            router.gating = lambda x: gated.append(self._logits(router, x, gating(x))) or gated[-1]
            hidden = inputs.hidden.detach().clone().requires_grad_()
            probs, routing_map = router(hidden)
            logits = gated[0].detach().reshape(-1, inputs.shape.experts)
            if self.mutation == "weights not normalised" and inputs.shape.score_function == "sigmoid":
                probs = self._unnormalised(router, gated[0], routing_map)
            probs.backward(inputs.upstream.to(probs.dtype))
        gemm = "te general_gemm" if _te_gemm() and self.router_dtype != "fp64" else "torch.mm"
        if on_cpu and self.router_dtype is None:
            gemm = "torch.mm (BF16 as the FP32 product rounded once: shim)"
        details: dict[str, Any] = {
            "module": "megatron.core.transformer.moe.router.TopKRouter",
            "megatron_core": megatron_core_version(),
            "moe_router_dtype": self.router_dtype,
            "logits_dtype": str(logits.dtype).removeprefix("torch."),
            "combination_weights_dtype": str(probs.dtype).removeprefix("torch."),
            "grad_dtype": str(router.weight.grad.dtype).removeprefix("torch."),
            "gemm": gemm,
            "routing": inputs.routing_figures(routing_map, logits.dtype),
            "seconds": time.perf_counter() - clock,
            "shims": [*(["cuda current_device -> cpu", "low-precision mm as cuBLAS"] if on_cpu else []),
                      *(["te_general_gemm undefined -> None"] if name_bound else []), "jit_fuser eager"],
        }
        backend = self.name.replace(f" ({self.mutation})", "") if self.mutation else self.name
        if self.mutation:
            backend, details["mutation"] = f"{backend} (mutated: {self.mutation})", self.mutation
        return ImplementationOutput(
            tensors={name: tensor.to(self.judged_dtype) for name, tensor in (
                ("logits", logits),
                ("combination_weights", probs.detach()),
                ("grad_router_weight", router.weight.grad),
                ("grad_hidden", hidden.grad.reshape(-1, inputs.shape.hidden)),
            )},
            backend=backend, details=details,
        )

    def _logits(self, router, hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The gating call's logits; under a logits mutation, other values of the same dtype in
        their place, with Megatron's own gating backward (the forward value replaced only)."""
        if self.mutation not in (LOGITS_TRUNCATED, LOGITS_SPLIT_K):
            return logits
        h = hidden.detach().reshape(-1, hidden.shape[-1])
        weight, bias = router.weight.detach(), None if router.bias is None else router.bias.detach()
        if self.mutation == LOGITS_TRUNCATED:
            product = torch.mm(h.float(), weight.float().t()) + (0.0 if bias is None else bias.float())
            wrong = round_toward_zero(product.float(), logits.dtype)
        else:
            wrong = split_k_product(h, weight, bias, SPLIT_K, logits.dtype)
        return _ForwardReplaced.apply(logits, wrong.reshape(logits.shape))

    @staticmethod
    def _unnormalised(router, gated, routing_map):
        """The chosen sigmoid scores, scaled but not divided by their sum (Megatron's own logits and
        choice; only the normalisation left out)."""
        logits = gated.reshape(routing_map.shape)
        scores = torch.sigmoid(logits.float()).type_as(logits)
        scale = router.config.moe_router_topk_scaling_factor or 1.0
        return torch.where(routing_map, scores * scale, torch.zeros_like(scores))
