"""Wrong gated SiLUs, to show what the bias-swiglu-fusion lever's evidence catches
(tests/test_evidence_power.py, benchmarks/evidence_power.py, docs/evidence-power.md).

- The bias added after the activation: the gate's half of fc1's bias added to SiLU's output instead
  of its input, (silu(a) + bias_a) * (b + bias_b) where Megatron computes silu(a + bias_a) *
  (b + bias_b), as a fused kernel that adds the bias in its epilogue would. An eager path in the
  inputs' dtype, its gradients by autograd (the unfused default's numerics, so that what fails is
  the mistake). It changes only a site with a bias: every SwiGLU recipe among the fixtures gives
  `--disable-bias-linear`, so `with_bias` makes the lever's cases with fc1's bias (std 0.5, as the
  lever draws one), as a model without that flag runs them.
- Gate and up read interleaved: the kernel takes the even columns of fc1's output as the gate and
  the odd ones as the up projection, where Megatron's fc1 lays out two halves [gate | up] (the
  layout of checkpoints that interleave them, GPT-OSS's, taken for Megatron's). Built on the
  honest fused candidate: its inputs' columns (and the bias's) reordered so that it reads them so,
  and the gradients laid back onto fc1's columns, so that only the pairing is wrong. It changes
  every case.
"""

from dataclasses import asdict, dataclass, replace
from functools import partial

import torch
import torch.nn.functional as F

from correctness.lever import Case, Implementation, ImplementationOutput, Lever, Mutated, WrongImplementation
from correctness.swiglu.lever import NAME, SwigluShape, make_inputs
from correctness.swiglu.paths import SwigluInputs

BIAS_AFTER_ACTIVATION = "the bias added after the activation"
INTERLEAVED_HALVES = "gate and up read interleaved instead of as halves"


@dataclass(frozen=True)
class BiasAfterActivation:
    """The gated SiLU with the gate's bias added after SiLU, in the inputs' dtype (the module's
    docstring)."""

    name: str = "eager-swiglu-bias-after-activation"

    def run(self, inputs: SwigluInputs) -> ImplementationOutput:
        x, bias = (None if t is None else t.detach().clone().requires_grad_() for t in (inputs.x, inputs.bias))
        probs = None if inputs.probs is None else inputs.probs.detach().clone().requires_grad_()
        gate, linear = torch.chunk(x, 2, dim=-1)
        gate_bias, linear_bias = torch.chunk(bias, 2, dim=-1)
        out = (F.silu(gate) + gate_bias) * (linear + linear_bias)
        if probs is not None:
            out = (out * probs).to(out.dtype)
        out.backward(inputs.grad)
        tensors = {"out": out.detach(), "grad_fc1_output": x.grad, "grad_bias": bias.grad}
        if probs is not None:
            tensors["grad_probs"] = probs.grad
        return ImplementationOutput(tensors=tensors, backend=self.name, details={"mistake": BIAS_AFTER_ACTIVATION})


def _interleaved_order(width: int, device: torch.device) -> torch.Tensor:
    """The columns of fc1's output in the order a kernel reading them interleaved takes as [gate | up]."""
    columns = torch.arange(width, device=device)
    return torch.cat((columns[0::2], columns[1::2]))


def _read_interleaved(inputs: SwigluInputs) -> SwigluInputs:
    order = _interleaved_order(inputs.x.shape[-1], inputs.x.device)
    return replace(inputs, x=inputs.x[..., order], bias=None if inputs.bias is None else inputs.bias[order])


def _gradients_on_fc1_columns(inputs: SwigluInputs, tensors) -> dict[str, torch.Tensor]:
    order = _interleaved_order(inputs.x.shape[-1], inputs.x.device)
    laid_back = dict(tensors)
    for name in ("grad_fc1_output", "grad_bias"):
        if name in tensors:
            laid_back[name] = torch.empty_like(tensors[name])
            laid_back[name][..., order] = tensors[name]
    return laid_back


def _has_bias(case: Case) -> bool:
    return case.shape.bias


def with_bias(lever: Lever) -> Lever:
    """The lever with each of its dense and shared-expert cases that has no bias made again with
    fc1's bias, as a model without --disable-bias-linear runs it (the same seed, so the same fc1
    output and gradient); the routed experts keep none (Megatron's fused function refuses one)."""
    cases = []
    for case in lever.cases:
        if case.shape.bias or case.shape.site == "experts":
            cases.append(case)
            continue
        shape = SwigluShape(**{**asdict(case.shape), "bias": True})
        cases.append(replace(case, id=f"{shape.id}-seed{case.seed}", shape=shape,
                             make_inputs=partial(make_inputs, shape, case.seed)))
    return replace(lever, cases=tuple(cases))


def _interleaved(honest: Implementation) -> Implementation:
    return Mutated(base=honest, mutation=INTERLEAVED_HALVES, mutate=_read_interleaved,
                   change_outputs=_gradients_on_fc1_columns)


WRONG_IMPLEMENTATIONS = (
    WrongImplementation(name=BIAS_AFTER_ACTIVATION, lever=NAME, build=lambda honest: BiasAfterActivation(),
                        changes=_has_bias, caught_on=_has_bias),
    WrongImplementation(name=INTERLEAVED_HALVES, lever=NAME, build=_interleaved),
)
