"""Wrong deterministic modes for the deterministic-mode lever's attention, its candidate with one
thing done wrong, to show what its evidence catches (tests/test_evidence_power.py,
benchmarks/evidence_power.py, docs/evidence-power.md). Its controls (one last bit moved each run; the
ranks summed in another order each run; the wrong softmax scale; a rank dropped) stand for the rest.

- The key and value gradients accumulated in an order that varies between runs: the backward split
  over QUERY_BLOCKS blocks of queries (as a sequence-parallel backward splits it), each block's dk and
  dv added into the result in the dtype of the gradients (BF16), in an order that moves with the run,
  as atomic adds in arrival order would. Each block's gradients are the candidate's own, from its run
  on the block's output gradient alone (the others' zero); dq (each query's own) and the output are
  exact either way. Only the run-to-run spread is meant to give it away: the rule's repeat half.
- Atomics left in one reduction: the same, for dv alone (dk from the candidate's one run), as a
  backward whose dk kernel was made deterministic and whose dv accumulation was missed.
"""

import itertools
from dataclasses import dataclass, field, replace

import torch

from correctness.attention.inputs import AttentionInputs
from correctness.composites.determinism.lever import NAME
from correctness.lever import Case, Implementation, ImplementationOutput, WrongImplementation

ORDER_VARIES = "dk and dv accumulated over query blocks in an order that varies between runs"
ONE_REDUCTION_LEFT = "dv alone accumulated over query blocks in an order that varies between runs"
QUERY_BLOCKS = 3  # the fewest for which the order of a sum changes its bits (a + b is b + a)
ORDERS = tuple(itertools.permutations(range(QUERY_BLOCKS)))


@dataclass(eq=False)
class QueryBlocksInArrivalOrder:
    """`base`'s forward; its gradients summed over QUERY_BLOCKS runs, one per block of queries, in
    the dtype of the gradients, in another order on each call."""

    base: Implementation
    calls: int = field(default=0)
    accumulated: tuple[str, ...] | None = None  # those summed over the blocks; None: every gradient
    mistake: str = ORDER_VARIES

    @property
    def name(self) -> str:
        return f"{self.base.name} ({self.mistake})"

    def _block_inputs(self, inputs: AttentionInputs, block: int) -> AttentionInputs:
        dim = 0 if inputs.shape.qkv_format == "thd" else 1
        edges = torch.linspace(0, inputs.grad_out.shape[dim], QUERY_BLOCKS + 1).round().long().tolist()
        grad = torch.zeros_like(inputs.grad_out)
        kept = [slice(None)] * grad.dim()
        kept[dim] = slice(edges[block], edges[block + 1])
        grad[tuple(kept)] = inputs.grad_out[tuple(kept)]
        return replace(inputs, grad_out=grad)

    def run(self, inputs: AttentionInputs) -> ImplementationOutput:
        whole = self.base.run(inputs)
        parts = [self.base.run(self._block_inputs(inputs, block)).tensors for block in range(QUERY_BLOCKS)]
        order = ORDERS[self.calls % len(ORDERS)]
        self.calls += 1
        tensors = dict(whole.tensors)
        for name in tensors:
            if name == "out" or (self.accumulated is not None and name not in self.accumulated):
                continue
            total = parts[order[0]][name].clone()
            for block in order[1:]:
                total = total + parts[block][name]  # in the gradient's own dtype, rounded at each add
            tensors[name] = total
        return ImplementationOutput(tensors=tensors, backend=f"{whole.backend} (wrong: {self.mistake})",
                                    details={**whole.details, "mistake": self.mistake, "order": list(order)})


def _attention(case: Case) -> bool:
    return hasattr(case.shape, "qkv_format")


WRONG_IMPLEMENTATIONS = (
    WrongImplementation(name=ORDER_VARIES, lever=NAME, build=QueryBlocksInArrivalOrder,
                        changes=_attention, caught_on=_attention),
    WrongImplementation(name=ONE_REDUCTION_LEFT, lever=NAME,
                        build=lambda honest: QueryBlocksInArrivalOrder(honest, accumulated=("dv",),
                                                                       mistake=ONE_REDUCTION_LEFT),
                        changes=_attention, caught_on=_attention),
)
