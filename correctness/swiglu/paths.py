"""The paths of the bias-swiglu-fusion lever: Megatron's MLP activation with and without
`bias_activation_fusion`, the FP64 reference, and the deliberately wrong variants.

What megatron-core 0.16.1 runs (transformer/mlp.py `MLP.forward`, lines 155-250; shared experts
run the same forward, transformer/moe/shared_experts.py), for `activation_func` F.silu and
`gated_linear_unit` (Megatron-LM's `--swiglu`), on fc1's output x = [gate | up] per TP rank:
- with `bias_activation_fusion` (Megatron-LM's default; `--no-bias-swiglu-fusion` turns it off):
  `bias_swiglu_impl(x, bias, fp8_input_store=False, cpu_offload_input=False)`
  (fusions/fused_bias_swiglu.py): x viewed as [tokens, 2F], `BiasSwiGLUFunction` (bias given) or
  `SwiGLUFunction` (bias None, the recipes' `--disable-bias-linear`), whose forward `silu(a) * b`
  and hand-written backward `swiglu_back` are `jit_fuser` functions: torch.compile (megatron/core/
  jit.py), so on a CPU inductor's C++ kernels and on a GPU its Triton kernels;
- without it: `x + bias` where there is one, then `glu`: `F.silu(a) * (b + glu_linear_offset)`
  (offset 0.0) in the inputs' dtype, its gradient by autograd.
The dense and shared-expert paths run Megatron's own `MLP.forward`, with its two linear layers
replaced by stand-ins (`_Fc1`: returns the case's fc1 output and bias; `_Fc2`: returns its input):
the branch the flag selects, and the function it calls, are Megatron's.

The routed experts (transformer/moe/experts.py `TEGroupedMLP.forward`, `bias_act_func`, lines
680-733) multiply by the router's per-token weights: fused, `weighted_bias_swiglu_impl(x, None,
probs)` (`swiglu(x) * probs` then cast back, with its own backward `weighted_swiglu_back`; Megatron
raises NotImplementedError for a bias); unfused, `glu(x) * probs` cast back to x's dtype. That
closure cannot be called alone, so `_unfused_experts` writes its unfused branch out (the same
operations in the same order); the fused path calls Megatron's function as the closure does.
"""

import time
import types
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from correctness.errors import ImplementationUnavailable
from correctness.lever import ImplementationOutput
from correctness.provenance import megatron_core_version
from references.swiglu import gated_unit, gated_unit_backward

FUSED = "megatron-bias-swiglu-fused"
UNFUSED = "megatron-swiglu-unfused"


@dataclass(frozen=True, kw_only=True)
class SwigluInputs:
    x: torch.Tensor  # fc1's output [sequence, batch, 2F] (dense, shared expert) or [tokens, 2F] (experts)
    grad: torch.Tensor  # the upstream gradient of the activation's output, like x with F columns
    bias: torch.Tensor | None  # fc1's bias [2F], or None (the recipes' --disable-bias-linear)
    probs: torch.Tensor | None  # the router's weights [tokens, 1] (experts), or None


def fuser() -> str:
    """How Megatron's `jit_fuser` functions of fused_bias_swiglu run in this process."""
    from torch import _dynamo

    from megatron.core.fusions import fused_bias_swiglu

    if not hasattr(fused_bias_swiglu.swiglu, "_torchdynamo_orig_callable"):
        return "eager (Megatron's jit_fuser is not torch.compile)"
    if _dynamo.config.disable:
        return "eager (torch.compile disabled: TORCH_COMPILE_DISABLE)"
    return "torch.compile"


_COMPILED_FOR: list[Any] = [None]  # a weak reference to the inputs the process's graphs were last compiled for


def _compile_afresh_for(inputs: SwigluInputs) -> None:
    """Give a case's inputs graphs compiled for them alone, as a fresh process would. Dynamo's
    graphs are the process's: compiled for one shape, Megatron's fused functions are recompiled
    with dynamic shapes once another shape comes (automatic dynamic shapes), so the kernel a case
    judged would depend on the cases, or the tests, the process ran before it (seen: two runs of the
    same component tests gave Llama's bias-SwiGLU case different records). Dynamo's caches are
    reset when new inputs arrive; the runs on the same inputs (repeats, controls) reuse the graph."""
    from torch import _dynamo

    last = _COMPILED_FOR[0]
    if last is None or last() is not inputs:
        _dynamo.reset()
        _COMPILED_FOR[0] = weakref.ref(inputs)


def _compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class _Fc1:
    """Stands in for MLP.linear_fc1 (a column-parallel linear with skip_bias_add): returns the
    case's fc1 output and bias."""

    def __init__(self, x: torch.Tensor, bias: torch.Tensor | None):
        self.x, self.bias = x, bias

    def __call__(self, hidden_states: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.x, self.bias


def _fc2(intermediate: torch.Tensor) -> tuple[torch.Tensor, None]:
    """Stands in for MLP.linear_fc2: the activation's output, unchanged, and no bias."""
    return intermediate, None


def megatron_mlp(fused: bool, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Megatron's MLP.forward on the fc1 output `x` (and `bias`), configured as `--swiglu` with
    `bias_activation_fusion` = `fused`: its activation's output."""
    from megatron.core.transformer.mlp import MLP

    config = types.SimpleNamespace(
        use_te_activation_func=False, bias_activation_fusion=fused, gated_linear_unit=True,
        activation_func=F.silu, activation_func_fp8_input_store=False, cpu_offloading=False,
        cpu_offloading_activations=False, activation_func_clamp_value=None, glu_linear_offset=0.0,
    )
    mlp = MLP.__new__(MLP)  # its __init__ builds TP linear layers; forward reads only these attributes
    torch.nn.Module.__init__(mlp)
    mlp.config, mlp.activation_func = config, F.silu
    mlp.linear_fc1, mlp.linear_fc2 = _Fc1(x, bias), _fc2
    output, output_bias = mlp.forward(hidden_states=None)
    assert output_bias is None
    return output


def _unfused_experts(x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """TEGroupedMLP's bias_act_func without the fusion, for SiLU, gated, no clamp, offset 0."""
    gate, linear = torch.chunk(x, 2, dim=-1)
    out = F.silu(gate) * (linear + 0.0)
    return (out * probs).to(out.dtype)


def _fused_experts(x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl

    return weighted_bias_swiglu_impl(x, None, probs, False)


def _leaves(inputs: SwigluInputs) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    fresh = (None if t is None else t.detach().clone().requires_grad_() for t in (inputs.x, inputs.bias, inputs.probs))
    return tuple(fresh)


def _gradients(out: torch.Tensor, grad: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None,
               probs: torch.Tensor | None) -> dict[str, torch.Tensor]:
    out.backward(grad)
    tensors = {"out": out.detach(), "grad_fc1_output": x.grad}
    if bias is not None:
        tensors["grad_bias"] = bias.grad
    if probs is not None:
        tensors["grad_probs"] = probs.grad
    return tensors


@dataclass(frozen=True)
class MegatronSwiglu:
    """Megatron's gated SiLU with (`fused`) or without bias_activation_fusion, as the module
    docstring says; the fused one's backend names how its jit_fuser ran."""

    name: str
    fused: bool

    def run(self, inputs: SwigluInputs) -> ImplementationOutput:
        if self.fused:
            _compile_afresh_for(inputs)
        x, bias, probs = _leaves(inputs)
        before = _compiled_graphs()
        started = time.perf_counter()
        try:
            if probs is None:
                out = megatron_mlp(self.fused, x, bias)
                function = "MLP.forward -> " + ("bias_swiglu_impl" if self.fused else "glu (unfused)")
            else:
                if bias is not None and self.fused:
                    raise ImplementationUnavailable(
                        "Megatron's weighted_bias_swiglu_impl takes no bias (NotImplementedError)")
                out = (_fused_experts if self.fused else _unfused_experts)(x, probs)
                function = "TEGroupedMLP bias_act_func -> " + ("weighted_bias_swiglu_impl" if self.fused else "glu * probs")
            tensors = _gradients(out, inputs.grad, x, bias, probs)
        except ImportError as error:
            raise ImplementationUnavailable(
                f"megatron-core is not usable here: {type(error).__name__}: {error}") from error
        details: dict[str, Any] = {"function": function, "megatron_core": megatron_core_version(),
                                   "seconds": time.perf_counter() - started}
        backend = self.name
        if self.fused:
            details["jit_fuser"] = fuser()
            details["graphs_compiled"] = _compiled_graphs() - before  # 0 on the case's later runs
            backend = f"{self.name} ({details['jit_fuser']})"
        return ImplementationOutput(tensors=tensors, backend=backend, details=details)


class _SiluWrongDerivative(torch.autograd.Function):
    """silu(a) * b forward; backward with SiLU's derivative taken as sigmoid(a) (its second term,
    a * s * (1 - s), dropped)."""

    @staticmethod
    def forward(ctx, gate, linear):
        ctx.save_for_backward(gate, linear)
        return F.silu(gate) * linear

    @staticmethod
    def backward(ctx, grad):
        gate, linear = ctx.saved_tensors
        return grad * torch.sigmoid(gate) * linear, grad * F.silu(gate)


@dataclass(frozen=True)
class WrongGatedUnit:
    """An eager gated unit in the inputs' dtype that is wrong on purpose: `mistake` "sigmoid gate"
    (sigmoid(a) * b: SiLU's factor a missing) or "sigmoid derivative" (the right forward, SiLU's
    derivative taken as sigmoid(a) in the backward)."""

    name: str
    mistake: str

    def run(self, inputs: SwigluInputs) -> ImplementationOutput:
        x, bias, probs = _leaves(inputs)
        summed = x if bias is None else x + bias
        gate, linear = torch.chunk(summed, 2, dim=-1)
        if self.mistake == "sigmoid gate":
            out = torch.sigmoid(gate) * linear
        elif self.mistake == "sigmoid derivative":
            out = _SiluWrongDerivative.apply(gate, linear)
        else:
            raise ValueError(f"wrong gated unit: unknown mistake {self.mistake!r}")
        if probs is not None:
            out = (out * probs).to(out.dtype)
        return ImplementationOutput(tensors=_gradients(out, inputs.grad, x, bias, probs), backend=self.name,
                          details={"mistake": self.mistake})


def swap_halves(tensor: torch.Tensor | None) -> torch.Tensor | None:
    if tensor is None:
        return None
    gate, linear = torch.chunk(tensor, 2, dim=-1)
    return torch.cat((linear, gate), dim=-1)


def swapped_inputs(inputs: SwigluInputs) -> SwigluInputs:
    """The gate and linear halves of fc1's output (and bias) exchanged: silu(b) * a."""
    return SwigluInputs(x=swap_halves(inputs.x), grad=inputs.grad, bias=swap_halves(inputs.bias), probs=inputs.probs)


def unswapped_gradients(inputs: SwigluInputs, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The swapped run's gradients laid back onto the original halves, so that only the swap's
    arithmetic is wrong, not the layout of its gradient."""
    return {name: swap_halves(t) if name in ("grad_fc1_output", "grad_bias") else t for name, t in tensors.items()}


def unweighted_inputs(inputs: SwigluInputs) -> SwigluInputs:
    """The router's weights replaced by ones (a kernel that ignores them)."""
    return SwigluInputs(x=inputs.x, grad=inputs.grad, bias=inputs.bias, probs=torch.ones_like(inputs.probs))


def unbiased_inputs(inputs: SwigluInputs) -> SwigluInputs:
    """fc1's bias replaced by zeros (a kernel that does not add it)."""
    return SwigluInputs(x=inputs.x, grad=inputs.grad, bias=torch.zeros_like(inputs.bias), probs=inputs.probs)


@dataclass(frozen=True)
class Fp64Swiglu:
    """references/swiglu.py: the gated SiLU and its gradients from the formula, in FP64."""

    name: str = "fp64-swiglu"

    def run(self, inputs: SwigluInputs) -> ImplementationOutput:
        out = gated_unit(inputs.x, inputs.bias, inputs.probs)
        dx, dbias, dprobs = gated_unit_backward(inputs.x, inputs.grad, inputs.bias, inputs.probs)
        tensors = {"out": out, "grad_fc1_output": dx}
        if dbias is not None:
            tensors["grad_bias"] = dbias
        if dprobs is not None:
            tensors["grad_probs"] = dprobs
        return ImplementationOutput(tensors=tensors, backend=self.name)
