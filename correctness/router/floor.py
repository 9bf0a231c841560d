"""The router lever's FP64 paths: the reference (FP64 routing from the formula, references/router.py)
and the format floor of BF16 logits, the same routing from the logits rounded to BF16.

The floor is what the best router in BF16 can do: the logits rounded to nearest even in BF16, once;
the scores the score function makes over all experts (sigmoid, or a softmax before the choice)
rounded to BF16 too, as a BF16 router's score tensor is (Megatron: `sigmoid(logits.float())
.type_as(logits)`: near a sigmoid router's top-k boundary, scores about 0.85, that rounding moves a
score about four times as far as the logits' own, so a floor without it would judge the format's
own score tensor as the candidate's defect); and everything else exact in FP64 from those: the score function,
the expert bias, the top-k choice (so a token whose FP64 boundary gap is below the rounding may
choose another expert set, as any BF16-logit router may), the normalisation and the scaling of the
chosen weights, and the gradients (the rounding's own gradient passed straight through, as a
cast's is). Its outputs are in the candidate's dtypes: the logits, the combination weights
(Megatron's routing_probs are in the logits' dtype) and both gradients (the gating linear's backward
casts them to the input's and the weight's dtype) rounded to BF16 once at the end.

Its choice is judged as the candidate's is: a token whose expert set differs from FP64's is
compared with FP64's own routing, so each swapped expert is an error of its weight at two columns,
and the floor's own near-ties set how many such tokens the format forces.
"""

from dataclasses import dataclass

import torch

from correctness.lever import FormatFloor, ImplementationOutput
from correctness.router.inputs import RouterInputs

FORMAT_NAMES = {torch.bfloat16: "BF16", torch.float16: "FP16"}


def roundings(format_name: str) -> tuple[str, ...]:
    return (
        f"the router logits to {format_name} (round to nearest even), once, before the score function and the"
        " top-k choice",
        f"the scores over all experts (sigmoid, or softmax before the choice) to {format_name}, as the router's"
        " score tensor is, before the expert bias and the top-k choice",
        f"the combination weights to {format_name} (Megatron's routing_probs are in the logits' dtype)",
        f"the gradients of the router weight and of the hidden states to {format_name}, as the default's are",
    )


@dataclass(frozen=True)
class Fp64Routing:
    """FP64 routing of the case's inputs; with `logits_in`, the format floor (module docstring):
    the logits rounded to that dtype before the routing, and every output rounded to it, then
    handed over in `judged_dtype`, as the candidate hands its values over."""

    logits_in: torch.dtype | None = None
    judged_dtype: torch.dtype = torch.float64

    @property
    def name(self) -> str:
        return "fp64-routing" if self.logits_in is None else f"fp64-routing from {FORMAT_NAMES[self.logits_in]} logits"

    def run(self, inputs: RouterInputs) -> ImplementationOutput:
        narrow = self.logits_in
        routed = inputs.reference if narrow is None else inputs.routed(round_logits=lambda logits: logits.to(narrow),
                                                                      round_scores=lambda scores: scores.to(narrow))
        tensors = {
            "logits": routed["logits"], "combination_weights": routed["weights"],
            "grad_router_weight": routed["grad_weight"], "grad_hidden": routed["grad_hidden"],
        }
        if narrow is not None:
            tensors = {name: tensor.to(narrow).to(self.judged_dtype) for name, tensor in tensors.items()}
        return ImplementationOutput(tensors=tensors, backend=self.name)


def logits_floor(logits_in: torch.dtype, judged_dtype: torch.dtype) -> FormatFloor:
    """The format floor of a candidate whose router logits (and so its outputs) are in `logits_in`."""
    name = FORMAT_NAMES[logits_in]
    return FormatFloor(format=name, roundings=roundings(name), implementation=Fp64Routing(logits_in, judged_dtype))
