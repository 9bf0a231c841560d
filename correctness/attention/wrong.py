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

Packed rows (the thd-packing lever, on its packed candidate, SDPA's flash CPU kernel or the eager path):
- The first boundary one token early: cu_seqlens built with an off-by-one (the first row's length
  less one), so the first row's last token is taken as the second row's first: that query loses its
  own row, and every query of the second row sees one key of the first. (The lever's control "boundary
  one token late" is the mirror mistake.)
- The backward run without the row boundary: the forward attends each row on its own, the backward
  (dq, dk, dv) is computed as if the packed rows were one causal sequence, as a kernel whose backward
  is not handed cu_seqlens would; `out` is right.
"""

from dataclasses import dataclass

import torch

from correctness.attention import thd_packing_lever as packing
from correctness.attention.inputs import AttentionInputs
from correctness.attention.megatron_softmax import MegatronAttention
from correctness.attention.softmax_precision_lever import NAME
from correctness.lever import Case, Implementation, ImplementationOutput, Mutated, WrongImplementation

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


BOUNDARY_EARLY = "the first row boundary one token early"
BACKWARD_UNPACKED = "the backward run without the row boundary"


def boundary_one_early(shape) -> tuple[int, ...]:
    bounds = list(shape.cu_seqlens)
    bounds[1] -= 1
    return tuple(bounds)


def _boundary_early(inputs: AttentionInputs) -> AttentionInputs:
    return inputs.with_shape(boundaries=boundary_one_early(inputs.shape))


@dataclass(frozen=True)
class BackwardWithoutBoundary:
    """`base`'s forward on the packed rows, its gradients from a run with no row boundary."""

    base: Implementation

    @property
    def name(self) -> str:
        return f"{self.base.name} ({BACKWARD_UNPACKED})"

    def run(self, inputs: AttentionInputs) -> ImplementationOutput:
        right = self.base.run(inputs)
        unpacked = self.base.run(inputs.with_shape(boundaries=packing.without_boundary(inputs.shape)))
        tensors = {name: tensor if name == "out" else unpacked.tensors[name] for name, tensor in right.tensors.items()}
        return ImplementationOutput(tensors=tensors, backend=f"{right.backend} (wrong: {BACKWARD_UNPACKED})",
                                    details={**right.details, "mistake": BACKWARD_UNPACKED})


def _two_rows(case: Case) -> bool:
    return packing.needs_two_rows(case) is None


PACKING_WRONG = (
    WrongImplementation(
        name=BOUNDARY_EARLY, lever=packing.NAME, changes=_two_rows, caught_on=_two_rows,
        build=lambda honest: Mutated(base=honest, mutation="first boundary one token early", mutate=_boundary_early),
    ),
    WrongImplementation(name=BACKWARD_UNPACKED, lever=packing.NAME, build=BackwardWithoutBoundary,
                        changes=_two_rows, caught_on=_two_rows),
)
