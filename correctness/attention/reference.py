"""The FP64 reference (references.attention) as a path of the attention lever."""

from dataclasses import dataclass

from correctness.attention.inputs import AttentionInputs
from correctness.lever import ImplementationOutput
from references.attention import attention


@dataclass(frozen=True)
class Fp64Reference:
    name: str = "fp64-reference"

    def run(self, inputs: AttentionInputs) -> ImplementationOutput:
        shape = inputs.shape
        tensors = attention(
            inputs.q,
            inputs.k,
            inputs.v,
            inputs.grad_out,
            softmax_scale=shape.softmax_scale,
            causal=shape.causal,
            window=shape.window,
            cu_seqlens=shape.cu_seqlens,
            softcap=shape.softcap,
            sinks=inputs.sinks,
        )
        return ImplementationOutput(
            tensors=tensors, backend="fp64-reference (query-blocked)", details={"dtype": "float64"})
