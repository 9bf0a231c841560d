"""How attention outputs are judged beyond the whole-tensor rule: the slices each tensor is also
judged by, and the invariant a correct kernel holds exactly.

Slices: each head (key-value group for dk and dv) and each block of 128 positions (query rows for
out and dq, keys for dk and dv), 128 being a common kernel tile: a kernel that mishandles one tile
(the last block masked, one window edge) moves its slices by many times the error it adds to the
whole tensor. Not per query row (issue 29, measured by benchmarks/per_query_judging.py; see
docs/evidence-power.md, "Per-query judging"): judged one row of one head at a time, 79 of 140
honest cases of the fixture recipes at five seeds fail, all in dq, dk or dv (flash's delta from
its BF16 output on near-one-hot rows, a BF16 softmax against FP32); `out` alone stays within
0.77 x but would catch one window mistake of ten more than these slices do.

Invariant: a query the mask leaves a single key (the first token of each row under a causal mask;
every token under a window of one) attends that key with probability exactly 1, so its output is
that key's value (not with sinks: the sink takes part of that probability). A kernel may rescale
by exp(s - max) and 1/l with FP32 rounding (relative 1e-7), which a BF16 or FP16 output rounds back
to the value itself, so the check is exact there; an FP32 output is not checked. A wrong
head-to-group mapping, a wrong mask at a row start or a softmax that leaks weight to masked keys
breaks it.

Not checked: packed rows equal to the same rows run alone. No kernel here promises it (torch's
flash CPU kernel splits a packed sequence's keys into other blocks than a lone row's, and its dk
and dv differ in the last bits; the eager path's products differ likewise), so the thd-packing
lever bounds the difference instead.
"""

from collections.abc import Mapping

import torch

from correctness.attention.inputs import AttentionInputs
from correctness.compare import Slicing
from correctness.lever import Invariant

SLICING = Slicing(block=128)
EXACT_DTYPES = ("bf16", "fp16")


def single_key_positions(shape) -> list[int] | None:
    """Tokens (in the layout's sequence: per batch row for BSHD, packed for THD) that see only
    themselves; None where no such rule applies (not causal, keys to the right visible, or sinks)."""
    if not shape.causal or (shape.window is not None and shape.window[1] > 0) or shape.sinks:
        return None
    starts = shape.cu_seqlens[:-1] if shape.qkv_format == "thd" else (0,)
    ends = shape.cu_seqlens[1:] if shape.qkv_format == "thd" else (shape.seq_len,)
    if shape.window is not None and shape.window[0] == 0:
        return [token for start, end in zip(starts, ends) for token in range(start, end)]
    return [start for start, end in zip(starts, ends) if end > start]


def single_key_rows_give_their_value(inputs: AttentionInputs, tensors: Mapping[str, torch.Tensor]) -> str | None:
    shape = inputs.shape
    positions = single_key_positions(shape)
    if shape.dtype not in EXACT_DTYPES or positions is None or "out" not in tensors:
        return None
    index = torch.tensor(positions)
    out, v = tensors["out"].cpu(), inputs.v.cpu()
    if shape.qkv_format == "thd":
        got, value = out[index], v[index]  # [n, heads, d], [n, groups, d]
    else:
        got, value = out[:, index], v[:, index]  # [b, n, heads, d], [b, n, groups, d]
    expected = value.repeat_interleave(shape.gqa_ratio, dim=-2)
    differ = got != expected
    if not bool(differ.any()):
        return None
    where = [int(i) for i in torch.nonzero(differ)[0]]
    token = positions[where[0] if shape.qkv_format == "thd" else where[1]]
    return (
        f"out at token {token}, head {where[-2]} (a single visible key) is not that key's value:"
        f" {int(differ.any(dim=-1).sum())} of {got[..., 0].numel()} such rows and heads differ"
    )


SINGLE_KEY_ROWS = Invariant(name="a single visible key gives its value", check=single_key_rows_give_their_value)
