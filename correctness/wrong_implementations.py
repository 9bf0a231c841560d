"""A catalogue of realistic wrong implementations, each one small declaration, run as candidates
through the levers' own CPU tiers to show what the evidence catches (tests/test_evidence_power.py,
benchmarks/evidence_power.py, the README's "What the bound cannot see").

Each is built on a lever's honest path: the attention backend's on the eager unfused path (the
default's numerics, so that what fails is the wrong computation and nothing else; their backend
names the mutation, so none is taken for the default's own kernel), the optimizer's on the offload
split, and the fused kernels' (cross entropy, RoPE, SwiGLU, the MoE permutation, the softmax's
precision), the packing levers' and the offload's second on each lever's own candidate, declared in
its kind's `wrong.py`. `changes(case)` says
whether the mistake changes the computation on a case (a window mistake changes nothing on a layer
without a window), `caught_on(case)` where the suite claims to catch it: there the case must fail,
or for a scale error be flagged `systematic`. A window one key
off changes a model-like case's output by about the BF16 default's own error or less (each query
spreads its weight over a thousand keys, so one key more or less at the edge moves a few rows at
most), so only the window-edge case, built to expose it, claims it.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from correctness.adam_precision import wrong as adam_wrong
from correctness.attention import wrong as softmax_wrong
from correctness.attention.eager import EagerUnfused
from correctness.attention.backend_lever import window_changed, window_too_narrow, window_too_wide
from correctness.composites.determinism import wrong as determinism_wrong
from correctness.cross_entropy import wrong as cross_entropy_wrong
from correctness.fp8 import wrong as fp8_wrong
from correctness.grad_accumulation import wrong as accumulation_wrong
from correctness.lever import Case, Implementation, Mutated, WrongImplementation
from correctness.grad_reduction import wrong as reduction_wrong
from correctness.loss import wrong as loss_wrong
from correctness.moe import wrong as permute_wrong
from correctness.optimizer import wrong as offload_wrong
from correctness.rope import wrong as rope_wrong
from correctness.router import wrong as router_wrong
from correctness.swiglu import wrong as swiglu_wrong

LAST_BLOCK = 64  # rows: the last block of a 64-row kernel tile
ONE_BF16_ULP = 2.0**-8  # an output scaled by 1 + 2^-8, one BF16 unit roundoff


@dataclass(frozen=True)
class HiddenLastKeys(EagerUnfused):
    """The eager path with the last `keys` keys of each row masked out, as a kernel that drops its
    last tile of keys would."""

    keys: int = LAST_BLOCK
    name: str = "eager-unfused"

    def visible(self, shape, device: torch.device) -> torch.Tensor:
        visible = super().visible(shape, device)
        token = torch.arange(shape.tokens, device=device)
        ends = torch.tensor(shape.cu_seqlens[1:] if shape.cu_seqlens else (shape.seq_len,), device=device)
        row_end = ends[torch.searchsorted(ends, token, right=True)]
        hidden = token >= row_end - self.keys
        return visible & ~hidden[None, :]


def _scaled_out(inputs, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = tensors["out"]
    return {**tensors, "out": (out.float() * (1.0 + ONE_BF16_ULP)).to(out.dtype)}


def _stale_bf16(unit, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each parameter's BF16 weights left as they were before the steps."""
    return {
        name: (unit.weights.to(tensor.dtype) if name.endswith(":bf16") and name.startswith(f"{unit.param.name}:")
               else tensor)
        for name, tensor in tensors.items()
    }


def _has_window(case: Case) -> bool:
    return case.shape.window is not None


def _window_edge(case: Case) -> bool:
    return case.variant == "window-edge"


def _attention(mutation: str, **changes) -> Callable[[Implementation], Implementation]:
    return lambda base: Mutated(base=base, mutation=mutation, **changes)


_ATTENTION_AND_OFFLOAD = (
    WrongImplementation(
        name="window one key too narrow", lever="attention-backend", changes=_has_window, caught_on=_window_edge,
        build=_attention("window one key too narrow", mutate=window_changed(window_too_narrow)),
    ),
    WrongImplementation(
        name="window one key too wide", lever="attention-backend", changes=_has_window, caught_on=_window_edge,
        build=_attention("window one key too wide", mutate=window_changed(window_too_wide)),
    ),
    WrongImplementation(
        name=f"keys of the last {LAST_BLOCK}-row block masked out", lever="attention-backend",
        build=lambda base: Mutated(base=HiddenLastKeys(), mutation=f"last {LAST_BLOCK} keys masked out"),
    ),
    WrongImplementation(
        name="output scaled by one BF16 ulp (1 + 2^-8)", lever="attention-backend", expected="systematic",
        build=_attention("output x (1 + 2^-8)", change_outputs=_scaled_out),
    ),
    WrongImplementation(
        name="BF16 weights not refreshed from the FP32 masters", lever="optimizer-offload",
        build=lambda base: Mutated(base=base, mutation="BF16 weights not refreshed", change_outputs=_stale_bf16),
    ),
)

# Realistic mistakes of the fused kernels, declared beside each lever (its kind's wrong.py): each must
# fail on every case it changes, or be written up in docs/evidence-power.md (tests/test_evidence_power.py).
FUSED_KERNELS = (
    *cross_entropy_wrong.WRONG_IMPLEMENTATIONS,
    *rope_wrong.WRONG_IMPLEMENTATIONS,
    *swiglu_wrong.WRONG_IMPLEMENTATIONS,
    *permute_wrong.WRONG_IMPLEMENTATIONS,
    *softmax_wrong.WRONG_IMPLEMENTATIONS,
)

# A second offload mistake, the packing levers' (THD attention, the packed loss), the grouped GEMM's and
# deterministic mode's, declared in their kinds' wrong.py, under the same rule as the fused kernels'
# (tests/test_evidence_power.py).
MORE_LEVERS = (
    *offload_wrong.WRONG_IMPLEMENTATIONS,
    *softmax_wrong.PACKING_WRONG,
    *loss_wrong.WRONG_IMPLEMENTATIONS,
    *permute_wrong.GROUPED_GEMM_WRONG,
    *determinism_wrong.WRONG_IMPLEMENTATIONS,
)

# The precision levers' wrong implementations in their candidate's own format (truncation instead of
# round to nearest, a dropped rank or microbatch, a second rounding), declared beside each lever:
# each must fail where the honest candidate is format-limited (their levers' tests).
CATALOGUE = (
    *_ATTENTION_AND_OFFLOAD,
    *FUSED_KERNELS,
    *MORE_LEVERS,
    *reduction_wrong.WRONG_IMPLEMENTATIONS,
    *accumulation_wrong.WRONG_IMPLEMENTATIONS,
    *router_wrong.WRONG_IMPLEMENTATIONS,
    *fp8_wrong.WRONG_IMPLEMENTATIONS,
    *adam_wrong.WRONG_IMPLEMENTATIONS,
)
