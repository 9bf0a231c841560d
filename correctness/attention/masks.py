"""The visibility mask the working-precision paths share (the FP64 reference builds its own)."""

import torch

from correctness.shapes import AttentionShape


def visible_keys(shape: AttentionShape, device: torch.device) -> torch.Tensor:
    """Boolean [n, n], True where query i may attend key j; n = seq_len (BSHD) or batch * seq_len (THD).

    Causal: j <= i. Window (left, right), inclusive, -1 unbounded: i - left <= j <= i + right.
    THD: only within the same row.
    """
    n = shape.batch * shape.seq_len if shape.qkv_format == "thd" else shape.seq_len
    token = torch.arange(n, device=device)
    row, position = token // shape.seq_len, token % shape.seq_len
    i, j = position[:, None], position[None, :]
    visible = row[:, None] == row[None, :]
    if shape.causal:
        visible &= j <= i
    if shape.window is not None:
        left, right = shape.window
        if left >= 0:
            visible &= j >= i - left
        if right >= 0:
            visible &= j <= i + right
    return visible


def to_heads_first(shape: AttentionShape, x: torch.Tensor) -> torch.Tensor:
    """[B, S, H, D] (THD: [T, H, D], one packed row) to [B, H, S, D]."""
    return (x.unsqueeze(0) if shape.qkv_format == "thd" else x).transpose(1, 2)


def from_heads_first(shape: AttentionShape, x: torch.Tensor) -> torch.Tensor:
    """Inverse of to_heads_first."""
    x = x.transpose(1, 2)
    return x.squeeze(0) if shape.qkv_format == "thd" else x
