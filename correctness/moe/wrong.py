"""Wrong token permutations for the permute-fusion levers (`moe-permute-fusion`, the gathers, and
`moe-permute-fusion-sums`, the top-k sums), each the lever's honest candidate with one thing done
wrong, to show what their evidence catches (tests/test_evidence_power.py,
benchmarks/evidence_power.py, docs/evidence-power.md).

- Tokens unpermuted with another routing's indices: the combine (unpermute, with and without merging
  probs, and its backward) run with the routing of the tokens one position on (token t's experts and
  weights are token t+1's), as a combine handed another microbatch's or layer's row map would be.
  Every expert keeps its number of rows, so no shape gives it away. The permute's own tensors are
  right. Declared for both levers: on the gathers it moves the combine's row gradient (`grad_rows`),
  on the sums every combine.
- The probs gathered token-major: the permuted probs taken from the routing map in its token-major
  order (`probs.masked_select(routing_map)`, the transpose Megatron's torch permute takes first
  forgotten) while the rows are grouped by expert, and the probs' gradient put back the same way;
  the tokens' rows are right. The gathers lever's `permuted_probs` and `grad_probs` change.
- Probabilities applied twice: the weighted combine multiplies each row by its routing weight twice
  (p^2 x row, as a kernel that scales a row when it gathers it and again when it adds it), and its
  backward gives each row p^2 x its token's gradient; the weights' own gradient is left right. Only
  the sums lever's weighted combine and its rows' gradient change.

The grouped GEMM (`moe-grouped-gemm`, on its candidate, torch's grouped matmul):
- The offsets shifted by one expert: each expert's row count taken from the expert before it
  (tokens_per_expert rolled by one, the first expert taking the last's), as offsets built from a
  count array read one slot off. The counts still sum to the rows, so no shape gives it away; rows
  meet the wrong expert's weights wherever two neighbouring counts differ (every case: one local
  expert receives no token).
- An empty expert's weight gradients not written: a grouped GEMM that skips an empty group leaves its
  weight-gradient buffers holding what was there, here the gradients of the expert before it (a
  reused buffer), where they must be zero. It changes every case with an empty local expert.
"""

from dataclasses import dataclass, replace

import torch

from correctness.lever import Case, Implementation, ImplementationOutput, Mutated, WrongImplementation
from correctness.moe import grouped_gemm_lever as grouped_gemm
from correctness.moe.experts import EMPTY_LOCAL_EXPERT, ExpertsInputs
from correctness.moe.permutation import PermuteInputs
from correctness.moe.permute_lever import EXACT_NAME, SUMS_NAME

ANOTHER_ROUTING = "tokens unpermuted with another routing's indices"
PROBS_TWICE = "probabilities applied twice"
PROBS_TOKEN_MAJOR = "probs gathered token-major while the rows are grouped by expert"
COMBINE_TENSORS = ("grad_rows", "combined", "combined_weighted", "grad_rows_weighted", "grad_merging_probs")
WEIGHTED_TENSORS = ("combined_weighted", "grad_rows_weighted")


def _next_tokens_routing(inputs: PermuteInputs) -> PermuteInputs:
    """The routing map and probs of the tokens one position on (the last token takes the first's)."""
    return replace(inputs, routing_map=inputs.routing_map.roll(-1, dims=0), probs=inputs.probs.roll(-1, dims=0))


def _probs_squared(inputs: PermuteInputs) -> PermuteInputs:
    return replace(inputs, probs=inputs.probs * inputs.probs)


@dataclass(frozen=True)
class CombineWrong:
    """`base` on the case's inputs, except the tensors of `taken` (those the mistake reaches), which
    come from a run of `base` on `mistaken(inputs)`."""

    base: Implementation
    mistake: str
    mistaken: object  # (PermuteInputs) -> PermuteInputs
    taken: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"{self.base.name} ({self.mistake})"

    def run(self, inputs: PermuteInputs) -> ImplementationOutput:
        right = self.base.run(inputs)
        wrong = self.base.run(self.mistaken(inputs))
        tensors: dict[str, torch.Tensor] = {
            name: wrong.tensors[name] if name in self.taken else tensor for name, tensor in right.tensors.items()
        }
        return ImplementationOutput(tensors=tensors, backend=f"{right.backend} (wrong: {self.mistake})",
                                    details={**right.details, "mistake": self.mistake})


def _probs_token_major(inputs: PermuteInputs, tensors) -> dict[str, torch.Tensor]:
    grad_probs = torch.zeros_like(inputs.probs)
    grad_probs[inputs.routing_map] = inputs.grad_permuted_probs.to(grad_probs.dtype)
    permuted_probs = inputs.probs.masked_select(inputs.routing_map).to(tensors["permuted_probs"].dtype)
    return {**tensors, "permuted_probs": permuted_probs, "grad_probs": grad_probs}


def _combining(mistake: str, mistaken, taken: tuple[str, ...]):
    return lambda honest: CombineWrong(base=honest, mistake=mistake, mistaken=mistaken, taken=taken)


WRONG_IMPLEMENTATIONS = (
    WrongImplementation(name=ANOTHER_ROUTING, lever=EXACT_NAME,
                        build=_combining(ANOTHER_ROUTING, _next_tokens_routing, COMBINE_TENSORS)),
    WrongImplementation(name=PROBS_TOKEN_MAJOR, lever=EXACT_NAME,
                        build=lambda honest: Mutated(base=honest, mutation=PROBS_TOKEN_MAJOR,
                                                     change_outputs=_probs_token_major)),
    WrongImplementation(name=ANOTHER_ROUTING, lever=SUMS_NAME,
                        build=_combining(ANOTHER_ROUTING, _next_tokens_routing, COMBINE_TENSORS)),
    WrongImplementation(name=PROBS_TWICE, lever=SUMS_NAME,
                        build=_combining(PROBS_TWICE, _probs_squared, WEIGHTED_TENSORS)),
)


OFFSETS_SHIFTED = "the grouped GEMM's offsets shifted by one expert"
EMPTY_EXPERT_STALE = "an empty expert's weight gradients not written"


def _counts_shifted(inputs: ExpertsInputs) -> ExpertsInputs:
    return replace(inputs, counts=inputs.counts[-1:] + inputs.counts[:-1])


def _empty_experts_stale(inputs: ExpertsInputs, tensors) -> dict[str, torch.Tensor]:
    """Each expert with no row given the weight gradients of the expert before it (the first, the one after)."""
    stale = dict(tensors)
    for expert, count in enumerate(inputs.counts):
        if count == 0:
            source = expert - 1 if expert > 0 else expert + 1
            for fc in ("fc1", "fc2"):
                stale[f"grad_{fc}_weight{expert}"] = tensors[f"grad_{fc}_weight{source}"].clone()
    return stale


def _has_empty_expert(case: Case) -> bool:
    return case.shape.local_experts > EMPTY_LOCAL_EXPERT


GROUPED_GEMM_WRONG = (
    WrongImplementation(name=OFFSETS_SHIFTED, lever=grouped_gemm.NAME, changes=_has_empty_expert,
                        caught_on=_has_empty_expert,
                        build=lambda honest: Mutated(base=honest, mutation="offsets one expert off",
                                                     mutate=_counts_shifted)),
    WrongImplementation(name=EMPTY_EXPERT_STALE, lever=grouped_gemm.NAME, changes=_has_empty_expert,
                        caught_on=_has_empty_expert,
                        build=lambda honest: Mutated(base=honest, mutation="empty expert's wgrad stale",
                                                     change_outputs=_empty_experts_stale)),
)
