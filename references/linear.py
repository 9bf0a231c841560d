"""FP64 reference for a linear layer without bias, forward and backward, as Megatron's (and
Transformer Engine's) Linear computes it: the weight is [out_features, in_features].

For an input x [tokens, in], a weight W [out, in] and an upstream gradient dy [tokens, out]:

    y     = x W^T        [tokens, out]     (fprop)
    dgrad = dy W         [tokens, in]      (the gradient of the input)
    wgrad = dy^T x       [out, in]         (the gradient of the weight)

Every input is upcast to FP64 (exact for BF16, FP32 and FP8 values) and multiplied in FP64:
each output element is a sum of FP64 products, 2^-53 relative per operation.

`operand`, where given, is what each GEMM reads in place of an input: operand(gemm, name, t)
with gemm "y", "dgrad" or "wgrad", name "x", "weight" or "grad_output", and t that input in FP64
in the layout above; it returns a tensor of t's shape (a rounding of t: an FP8 quantisation with
its scales, dequantised). The products are then those of the rounded operands, still exact in
FP64: a format floor's GEMMs.
"""

from collections.abc import Callable

import torch

Operand = Callable[[str, str, torch.Tensor], torch.Tensor]


def _as_is(gemm: str, name: str, t: torch.Tensor) -> torch.Tensor:
    return t


def linear_forward_backward(
    x: torch.Tensor, weight: torch.Tensor, grad_output: torch.Tensor, operand: Operand = _as_is
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, dgrad, wgrad) in FP64, on the inputs' device; each GEMM's operands through `operand`."""
    if x.dim() != 2 or weight.dim() != 2 or grad_output.dim() != 2:
        raise ValueError(f"linear: expected 2-D x, weight and grad_output, got {x.dim()}-D, {weight.dim()}-D"
                         f" and {grad_output.dim()}-D")
    tokens, in_features = x.shape
    out_features = weight.shape[0]
    if weight.shape[1] != in_features:
        raise ValueError(f"linear: weight {tuple(weight.shape)} does not take inputs of {in_features} features")
    if tuple(grad_output.shape) != (tokens, out_features):
        raise ValueError(f"linear: grad_output {tuple(grad_output.shape)} is not [tokens, out] = {(tokens, out_features)}")
    x64, w64, dy64 = x.double(), weight.double(), grad_output.double()

    def read(gemm: str, name: str, t: torch.Tensor) -> torch.Tensor:
        rounded = operand(gemm, name, t).double()
        if rounded.shape != t.shape:
            raise ValueError(f"linear: the {gemm} GEMM's {name} is {tuple(rounded.shape)}, expected {tuple(t.shape)}")
        return rounded

    y = read("y", "x", x64) @ read("y", "weight", w64).t()
    dgrad = read("dgrad", "grad_output", dy64) @ read("dgrad", "weight", w64)
    wgrad = read("wgrad", "grad_output", dy64).t() @ read("wgrad", "x", x64)
    return y, dgrad, wgrad
