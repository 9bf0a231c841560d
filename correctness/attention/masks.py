"""The visibility mask the working-precision paths share (the FP64 reference builds its own)."""

import torch

from correctness.attention.shapes import AttentionShape


def visible_keys(shape: AttentionShape, device: torch.device) -> torch.Tensor:
    """Boolean [n, n], True where query i may attend key j; n = seq_len (BSHD) or the packed tokens (THD).

    Causal: j <= i. Window (left, right), inclusive, -1 unbounded: i - left <= j <= i + right.
    THD: only within the same row, positions counted from the row's start (shape.cu_seqlens).
    """
    token = torch.arange(shape.tokens, device=device)
    if shape.qkv_format == "thd":
        starts = torch.tensor(shape.cu_seqlens[:-1], device=device)
        row = torch.searchsorted(starts, token, right=True) - 1
        position = token - starts[row]
    else:
        row, position = torch.zeros_like(token), token
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
