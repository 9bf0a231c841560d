"""Wrong masked softmaxes for the attention-softmax-precision lever, each Megatron's own core
attention (`MegatronAttention`, the lever's candidate: softmax in BF16, FusedScaleMaskSoftmax's
torch path) with one thing done wrong in its softmax, to show what the lever's evidence catches
(tests/test_evidence_power.py, benchmarks/evidence_power.py, docs/evidence-power.md). The attention
backend lever's own mistakes are declared in correctness/wrong_implementations.py.

- The mask applied after the softmax: the softmax taken over every key, the later (and, in a
  window, the too-early) ones included, and the masked probabilities then set to zero, without
  renormalising, as a kernel that masks its output tile rather than its scores would. Each row's
  probabilities then sum to less than one.
- The causal mask's diagonal masked too: each query blind to its own key (the mask built with
  `triu(diagonal=0)` where Megatron's uses 1); the first query of a row sees no key at all and, the
  mask filling -10000 rather than -inf, spreads its weight evenly over every key.
"""

from dataclasses import dataclass

import torch

from correctness.attention.megatron_softmax import MegatronAttention
from correctness.attention.softmax_precision_lever import NAME
from correctness.lever import ImplementationOutput, WrongImplementation

MASK_AFTER_SOFTMAX = "the mask applied after the softmax"
DIAGONAL_MASKED = "the causal mask's diagonal masked too"
MISTAKES = (MASK_AFTER_SOFTMAX, DIAGONAL_MASKED)


def _mask_after_softmax(softmax) -> None:
    """FusedScaleMaskSoftmax's torch path with its mask function filling nothing and the mask
    applied to its probabilities instead (zeros)."""
    masks = []

    def remember(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        masks.append(mask)
        return scores

    def forward_torch_softmax(input, mask, softmax_offset=None):
        probs = type(softmax).forward_torch_softmax(softmax, input, mask, softmax_offset)
        return probs.masked_fill(masks.pop(), 0.0) if masks else probs

    softmax.mask_func = remember
    softmax.forward_torch_softmax = forward_torch_softmax


def _diagonal_masked(softmax) -> None:
    mask_func = softmax.mask_func

    def with_diagonal(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        diagonal = torch.eye(mask.shape[-2], mask.shape[-1], dtype=torch.bool, device=mask.device)
        return mask_func(scores, mask | diagonal)

    softmax.mask_func = with_diagonal


SOFTMAX_CHANGES = {MASK_AFTER_SOFTMAX: _mask_after_softmax, DIAGONAL_MASKED: _diagonal_masked}


@dataclass(frozen=True)
class WrongMaskedSoftmax(MegatronAttention):
    """Megatron's DotProductAttention with `mistake` (one of MISTAKES) made in its softmax module."""

    mistake: str = MASK_AFTER_SOFTMAX

    @property
    def name(self) -> str:
        return f"{super().name} ({self.mistake})"

    def module(self, inputs):
        module = super().module(inputs)
        SOFTMAX_CHANGES[self.mistake](module.scale_mask_softmax)
        return module

    def run(self, inputs) -> ImplementationOutput:
        output = super().run(inputs)
        return ImplementationOutput(tensors=output.tensors, backend=f"{output.backend} (wrong: {self.mistake})",
                                    details={**output.details, "mistake": self.mistake})


def _wrong_softmax(mistake: str):
    def build(honest):
        if not isinstance(honest, MegatronAttention) or honest.masked_softmax_fusion:
            raise TypeError(f"{mistake}: built on Megatron's attention on its torch softmax path, got {honest.name}")
        return WrongMaskedSoftmax(softmax_in_fp32=honest.softmax_in_fp32, mistake=mistake)

    return build


WRONG_IMPLEMENTATIONS = tuple(
    WrongImplementation(name=mistake, lever=NAME, build=_wrong_softmax(mistake)) for mistake in MISTAKES
)
