"""FP64 reference for a linear layer without bias, forward and backward, as Megatron's (and
Transformer Engine's) Linear computes it: the weight is [out_features, in_features].

For an input x [tokens, in], a weight W [out, in] and an upstream gradient dy [tokens, out]:

    y     = x W^T        [tokens, out]     (fprop)
    dgrad = dy W         [tokens, in]      (the gradient of the input)
    wgrad = dy^T x       [out, in]         (the gradient of the weight)

Every input is upcast to FP64 (exact for BF16, FP32 and FP8 values) and multiplied in FP64:
each output element is a sum of FP64 products, 2^-53 relative per operation.
"""

import torch


def linear_forward_backward(
    x: torch.Tensor, weight: torch.Tensor, grad_output: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, dgrad, wgrad) in FP64, on the inputs' device."""
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
    return x64 @ w64.t(), dy64 @ w64, dy64.t() @ x64
