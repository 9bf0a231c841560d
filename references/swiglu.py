"""FP64 gated linear units (SwiGLU, GeGLU with GELU's tanh approximation) and their gradients,
from the formulas.

Layout: `x` [..., 2F], its last dimension the gate half a = x[..., :F] then the linear half
b = x[..., F:] (Megatron's fc1 output per TP rank); `bias` [2F] or None, added to x first;
`probs` [..., 1] or None, per-token weights (an MoE router's) that scale the output.

    out = act(a) * b * p
    d out / d a = act'(a) * b * p        d out / d b = act(a) * p        d out / d p = act(a) * b

with upstream gradient g [..., F]: dx = [g * act'(a) * b * p, g * act(a) * p], dbias = dx summed
over every leading dimension, dprobs = sum over F of g * act(a) * b.

    silu(a) = a * s,  s = 1 / (1 + exp(-a))              silu'(a) = s * (1 + a * (1 - s))
    gelu_tanh(a) = a / 2 * (1 + t),  t = tanh(u),  u = sqrt(2 / pi) * (a + 0.044715 a^3)
    gelu_tanh'(a) = (1 + t) / 2 + a / 2 * (1 - t^2) * sqrt(2 / pi) * (1 + 3 * 0.044715 a^2)

Everything is computed in FP64 from the inputs' values, with torch's elementwise operations only
(no autograd).
"""

import math

import torch

GELU_CUBIC = 0.044715
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def silu_and_derivative(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = torch.sigmoid(a)
    return a * s, s * (1.0 + a * (1.0 - s))


def gelu_tanh_and_derivative(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.tanh(SQRT_2_OVER_PI * (a + GELU_CUBIC * a * a * a))
    value = 0.5 * a * (1.0 + t)
    derivative = 0.5 * (1.0 + t) + 0.5 * a * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_CUBIC * a * a)
    return value, derivative


ACTIVATIONS = {"silu": silu_and_derivative, "gelu_tanh": gelu_tanh_and_derivative}


def _halves(x: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.double()
    if x.shape[-1] % 2:
        raise ValueError(f"gated unit: the last dimension ({x.shape[-1]}) must hold two equal halves")
    if bias is not None:
        if bias.shape != x.shape[-1:]:
            raise ValueError(f"gated unit: bias of shape {tuple(bias.shape)} for inputs of width {x.shape[-1]}")
        x = x + bias.double()
    return x.chunk(2, dim=-1)


def gated_unit(x: torch.Tensor, bias: torch.Tensor | None = None, probs: torch.Tensor | None = None,
               activation: str = "silu") -> torch.Tensor:
    """act(a) * b (* probs) in FP64."""
    a, b = _halves(x, bias)
    out = ACTIVATIONS[activation](a)[0] * b
    return out if probs is None else out * probs.double()


def gated_unit_backward(x: torch.Tensor, grad: torch.Tensor, bias: torch.Tensor | None = None,
                        probs: torch.Tensor | None = None, activation: str = "silu"
                        ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(dx, dbias or None, dprobs or None) in FP64, for the upstream gradient `grad` of the output."""
    a, b = _halves(x, bias)
    value, derivative = ACTIVATIONS[activation](a)
    g = grad.double()
    dprobs = None if probs is None else (g * value * b).sum(dim=-1, keepdim=True)
    if probs is not None:
        g = g * probs.double()
    dx = torch.cat((g * derivative * b, g * value), dim=-1)
    dbias = None if bias is None else dx.reshape(-1, dx.shape[-1]).sum(dim=0)
    return dx, dbias, dprobs
