"""A case's inputs: one TP rank's linear layer (input, weight, upstream gradient) in BF16, and for
delayed scaling the amax history the scales come from.

Seeded, model-like magnitudes: the input's features have lognormal RMS (an LLM's activations
carry a few channels far larger than the rest, which is what a per-tensor scale has to cover), the
weight is normal with Megatron's init std, and the upstream gradient's tokens have lognormal RMS
(tokens with and without loss, long and short documents). Delayed scaling's history holds the
amaxes of the iterations before: the input and the gradient drawn again with the same statistics
(fresh tokens), the weight's own amax (one optimizer step at the recipes' learning rate moves it
by about 1e-5).
"""

from dataclasses import dataclass, field
from typing import Any

import torch

from correctness.fp8.scaling import Fp8Config

ACTIVATION_CHANNEL_LOG_STD = 1.0  # log of the per-feature RMS of the input
WEIGHT_STD = 0.02  # Megatron's --init-method-std default
GRAD_RMS = 1e-5
GRAD_TOKEN_LOG_STD = 1.0


@dataclass(frozen=True, kw_only=True)
class LinearTensors:
    x: torch.Tensor  # [tokens, in_features]
    weight: torch.Tensor  # [out_features, in_features]
    grad_output: torch.Tensor  # [tokens, out_features]


def _draw(generator: torch.Generator, tokens: int, in_features: int, out_features: int,
          channel_rms: torch.Tensor, weight: torch.Tensor | None) -> LinearTensors:
    x = torch.randn(tokens, in_features, generator=generator) * channel_rms
    if weight is None:
        weight = WEIGHT_STD * torch.randn(out_features, in_features, generator=generator)
    token_rms = torch.exp(GRAD_TOKEN_LOG_STD * torch.randn(tokens, 1, generator=generator))
    grad = GRAD_RMS * token_rms * torch.randn(tokens, out_features, generator=generator)
    return LinearTensors(x=x.to(torch.bfloat16), weight=weight.to(torch.bfloat16), grad_output=grad.to(torch.bfloat16))


def draw_tensors(tokens: int, in_features: int, out_features: int, seed: int,
                 history_len: int = 0) -> tuple[LinearTensors, tuple[LinearTensors, ...]]:
    """The iteration's tensors and `history_len` earlier iterations' (oldest first), on the CPU."""
    generator = torch.Generator().manual_seed(seed)
    channel_rms = torch.exp(ACTIVATION_CHANNEL_LOG_STD * torch.randn(in_features, generator=generator))
    current = _draw(generator, tokens, in_features, out_features, channel_rms, None)
    earlier = tuple(_draw(generator, tokens, in_features, out_features, channel_rms, current.weight.float())
                    for _ in range(history_len))
    return current, earlier


def amax_histories(earlier: tuple[LinearTensors, ...]) -> dict[str, torch.Tensor]:
    """Per role, the FP32 amaxes of the earlier iterations, oldest first."""
    tensors = {"input": lambda t: t.x, "weight": lambda t: t.weight, "grad": lambda t: t.grad_output}
    return {role: torch.stack([get(t).abs().amax().float() for t in earlier]) for role, get in tensors.items()}


@dataclass(frozen=True, kw_only=True)
class LinearInputs:
    shape: Any  # correctness.fp8.lever.Fp8LinearShape
    config: Fp8Config
    x: torch.Tensor
    weight: torch.Tensor
    grad_output: torch.Tensor
    wgrad_dtype: torch.dtype
    earlier: tuple[LinearTensors, ...] = ()  # delayed scaling: the iterations its history comes from
    history: dict[str, torch.Tensor] = field(default_factory=dict)
    cache: dict[str, Any] = field(default_factory=dict, compare=False)  # figures a path computes once per case

    def history_amax(self, role: str) -> torch.Tensor:
        """The amax delayed scaling takes the role's scale from: the history's most recent, or its max."""
        history = self.history[role]
        return history[-1] if self.config.amax_compute_algo == "most_recent" else history.max()
