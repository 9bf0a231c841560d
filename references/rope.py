"""FP64 rotary position embedding (RoPE) from its formula, forward and backward.

A head vector x of d dims rotates its first r dims (r = rotary dims, the rest pass unchanged) in
r / 2 pairs (a, b), pair i by the angle theta_i of its token's position p:

    a' = a cos(theta_i) - b sin(theta_i)
    b' = b cos(theta_i) + a sin(theta_i)
    theta_i = p * base ** (-2 i / r)             (the angles of the formula; `rope_angles`)

Pairs are the halves (x[i], x[i + r/2]) or, interleaved, adjacent dims (x[2i], x[2i + 1]). A
rotation's transpose is the rotation by minus the angle, so the gradient of x for an upstream
gradient g is the rotation of g by -theta (`rope_backward`). Everything is computed in FP64 from
the inputs as given (already rounded to their dtype).

Layout: x [positions, ..., d] (any middle dims: batch, heads), angles [positions, r / 2].
"""

import torch


def rope_angles(positions: torch.Tensor, rotary_dims: int, base: float) -> torch.Tensor:
    """theta[p, i] = positions[p] * base ** (-2 i / rotary_dims), FP64 [len(positions), rotary_dims / 2]."""
    if rotary_dims <= 0 or rotary_dims % 2:
        raise ValueError(f"rotary dims must be a positive even number, got {rotary_dims}")
    if not base > 0:
        raise ValueError(f"rotary base must be positive, got {base}")
    exponents = torch.arange(0, rotary_dims, 2, dtype=torch.float64) / rotary_dims
    inverse = torch.tensor(float(base), dtype=torch.float64) ** -exponents
    return positions.to(torch.float64).reshape(-1, 1) * inverse.to(positions.device).reshape(1, -1)


def rope_forward(x: torch.Tensor, angles: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x rotated by `angles` (the formula above), FP64, x's shape."""
    positions, pairs = angles.shape
    rotary = 2 * pairs
    if x.dim() < 2 or x.shape[0] != positions or x.shape[-1] < rotary:
        raise ValueError(f"x {tuple(x.shape)} must be [positions={positions}, ..., d >= {rotary}] for angles"
                         f" {tuple(angles.shape)}")
    x = x.to(torch.float64)
    theta = angles.to(torch.float64).reshape(positions, *([1] * (x.dim() - 2)), pairs)
    cos, sin = torch.cos(theta), torch.sin(theta)
    rotated, passed = x[..., :rotary], x[..., rotary:]
    if interleaved:
        a, b = rotated[..., 0::2], rotated[..., 1::2]
    else:
        a, b = rotated[..., :pairs], rotated[..., pairs:]
    a2, b2 = a * cos - b * sin, b * cos + a * sin
    if interleaved:
        rotated = torch.stack((a2, b2), dim=-1).flatten(-2)
    else:
        rotated = torch.cat((a2, b2), dim=-1)
    return torch.cat((rotated, passed), dim=-1)


def rope_backward(grad: torch.Tensor, angles: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The gradient of x for the upstream gradient `grad`: grad rotated by -angles, FP64."""
    return rope_forward(grad, -angles.to(torch.float64), interleaved)
