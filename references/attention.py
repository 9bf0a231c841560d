"""FP64 reference for masked, grouped-query self-attention: forward and backward.

For every query head h, whose key-value group is g = h // (H // G) (Transformer
Engine's grouping), and every query position i of a sequence:

    X_ij = softmax_scale * q_i . k_j          for the keys j visible to query i
    S_ij = c tanh(X_ij / c)                   with a logit softcap c (Gemma 2), else X_ij
    P_ij = exp(S_ij) / (exp(a_h) + sum_j exp(S_ij))   with a sink logit a_h per query head
                                                      (GPT-OSS), else without exp(a_h)
    O_i  = sum_j P_ij v_j

(computed after subtracting max(a_h, max_j S_ij)), and, given the upstream gradient dO = grad_out:

    D_i   = dO_i . O_i
    dP_ij = dO_i . v_j
    dS_ij = P_ij (dP_ij - D_i)
    dX_ij = dS_ij (1 - (S_ij / c)^2)          with a softcap, else dS_ij
    dq_i  = softmax_scale * sum_j dX_ij k_j
    dk_j  = softmax_scale * sum_i dX_ij q_i   (also summed over the query heads of group g)
    dv_j  = sum_i P_ij dO_i                   (also summed over the query heads of group g)
    da_h  = -sum_i P_i,sink D_i               (over every query of head h), P_i,sink = exp(a_h) / (the
                                              denominator above): the sink has no value, so dP = 0 there

q and k share a head dim; v (and so O and dO) may have another (MLA: 192 and 128).

Key j is visible to query i (positions within one sequence) iff

    (not causal or j <= i)
    and (left < 0 or j >= i - left)
    and (right < 0 or j <= i + right)

with window = (left, right) in Transformer Engine's inclusive convention, -1 meaning
unbounded on that side; Hugging Face's sliding_window=W is window (W - 1, 0).  Every
query sees at least itself, so every softmax row has a visible key.

Layouts:
    BSHD (cu_seqlens None): q [B, S, H, D]; k [B, S, G, D]; v [B, S, G, Dv]; grad_out [B, S, H, Dv].
    THD (cu_seqlens [n + 1] given): q [T, H, D]; k [T, G, D]; v [T, G, Dv]; grad_out [T, H, Dv];
        sequence s is tokens cu_seqlens[s]:cu_seqlens[s + 1] and attends only within itself.
    sinks: [H], one logit per query head, the same for every sequence and query.

Memory: the score-sized arrays (P and dP/dS) are only ever built for one block of
query rows against the contiguous range of keys that block can see (causal bound,
window bounds, sequence boundaries); the mask is applied elementwise inside that range.
With the default block size they take about WORKING_SET_BYTES whatever the sequence
length (a softcap keeps one more such array, its slope 1 - (S / c)^2); everything else is
O(tokens x heads x D).
"""

import math
import numbers

import torch

WORKING_SET_BYTES = 64 * 2**20
"""Bytes the score-sized arrays of one query block may take under the default block size."""

_SCORE_ARRAYS = 2
"""FP64 score-sized arrays alive per block: the probabilities P and the gradient dP/dS."""

_MIN_ROWS = 128
"""Default blocks are not cut below this many rows for speed alone (per-block overhead)."""


def attention(
    q,
    k,
    v,
    grad_out=None,
    *,
    softmax_scale: float,
    causal: bool = True,
    window: tuple[int, int] | None = None,
    cu_seqlens=None,
    block_size: int | None = None,
    softcap: float | None = None,
    sinks=None,
) -> dict[str, torch.Tensor]:
    """Attention output and, when grad_out is given, its gradients, all computed in FP64.

    Inputs may have any floating dtype; they are upcast to FP64.  Returns FP64 tensors on
    the input's device in the input layout: {"out"} without grad_out, otherwise
    {"out", "dq", "dk", "dv"}, and "dsink" ([H]) where sinks are given.  softcap: c, or
    None for none.  sinks: [H] logits, or None for none.  block_size is the number of query
    rows per block; it changes memory and speed, not the result (beyond rounding).  By
    default default_block_size() picks it per sequence.  See the module docstring for the
    formula, the mask and the layouts.
    """
    packed = cu_seqlens is not None
    _check_tensors(q, k, v, grad_out, packed)
    scale = _checked_scale(softmax_scale)
    cap = _checked_softcap(softcap)
    _check_sinks(sinks, q.shape[-2])
    left, right = _checked_window(window)
    _check_block_size(block_size)

    if packed:
        sequences = _checked_sequences(cu_seqlens, q.shape[0])
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
        grad_out = None if grad_out is None else grad_out.unsqueeze(0)
    else:
        sequences = [(0, q.shape[1])]
    batch, _, heads, _ = q.shape
    groups = k.shape[2]
    per_group = heads // groups

    # Internal layout, still in the input dtype (each block is upcast as it is used):
    # [batch * G, tokens, H // G, D] for q and dO, [batch * G, tokens, D] for k and v.
    q, k, v = _grouped(q, groups), _grouped(k, groups)[:, :, 0], _grouped(v, groups)[:, :, 0]
    out = torch.empty((*q.shape[:-1], v.shape[-1]), dtype=torch.float64, device=q.device)
    if grad_out is not None:
        grad_out = _grouped(grad_out, groups)
        dq = torch.empty(q.shape, dtype=torch.float64, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float64, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float64, device=v.device)
    if sinks is not None:
        # [batch * G, H // G]: the sink logit of each (group, head within the group), as q's rows
        sink_logits = sinks.to(device=q.device, dtype=torch.float64).reshape(groups, per_group).repeat(batch, 1)
        dsink = torch.zeros_like(sink_logits)

    for start, end in sequences:
        seq_len = end - start
        rows = block_size or default_block_size(
            seq_len, batch * heads, causal=causal, window=(left, right),
            score_arrays=_SCORE_ARRAYS + (cap is not None),
        )
        for i0 in range(start, end, rows):
            i1 = min(i0 + rows, end)
            # The keys this query block can see: the window clipped to the sequence.
            j0 = start if left < 0 else max(start, i0 - left)
            j1 = end if right < 0 else min(end, i1 + right)
            if causal:
                j1 = min(j1, i1)
            hidden = ~_visible(i0, i1, j0, j1, causal, left, right, q.device)

            # Rows of a block are (query position, head within the group) pairs, so one
            # batched matmul per group covers all its query heads and sums dk, dv over them.
            # q_rows carries the softmax scale: S = (scale q) k^T and dk = dS^T (scale q).
            q_rows = q[:, i0:i1].flatten(1, 2).to(torch.float64) * scale
            keys, values = k[:, j0:j1].to(torch.float64), v[:, j0:j1].to(torch.float64)

            probs = torch.matmul(q_rows, keys.mT)  # X, then S, then P in place
            if cap is not None:
                probs.div_(cap).tanh_()
                cap_slope = 1.0 - probs.square()  # dS/dX = 1 - tanh^2
                probs.mul_(cap)
            probs.unflatten(1, (i1 - i0, per_group)).masked_fill_(hidden[:, None, :], -math.inf)
            row_max = probs.amax(dim=-1, keepdim=True)
            if sinks is not None:
                sink_rows = sink_logits[:, None, :].expand(-1, i1 - i0, -1).reshape(row_max.shape)
                row_max = torch.maximum(row_max, sink_rows)
                sink_probs = (sink_rows - row_max).exp_()
            probs.sub_(row_max).exp_()
            denominator = probs.sum(dim=-1, keepdim=True)
            if sinks is not None:
                denominator += sink_probs
                sink_probs /= denominator
            probs.div_(denominator)
            out_rows = out[:, i0:i1].flatten(1, 2)
            torch.matmul(probs, values, out=out_rows)  # O = P v

            if grad_out is None:
                continue
            grad_rows = grad_out[:, i0:i1].flatten(1, 2).to(torch.float64)
            delta = (grad_rows * out_rows).sum(dim=-1, keepdim=True)  # D = dO . O
            grad_scores = torch.matmul(grad_rows, values.mT)  # dP = dO v^T, then dS in place
            grad_scores.sub_(delta).mul_(probs)
            if cap is not None:
                grad_scores.mul_(cap_slope)
            if sinks is not None:
                dsink -= (sink_probs * delta).unflatten(1, (i1 - i0, per_group)).sum(dim=(1, 3))
            torch.matmul(grad_scores, keys, out=dq[:, i0:i1].flatten(1, 2)).mul_(scale)
            dk[:, j0:j1].baddbmm_(grad_scores.mT, q_rows)
            dv[:, j0:j1].baddbmm_(probs.mT, grad_rows)

    result = {"out": _ungrouped(out, batch, groups, packed)}
    if grad_out is not None:
        result["dq"] = _ungrouped(dq, batch, groups, packed)
        result["dk"] = _ungrouped(dk.unsqueeze(2), batch, groups, packed)
        result["dv"] = _ungrouped(dv.unsqueeze(2), batch, groups, packed)
        if sinks is not None:
            result["dsink"] = dsink.reshape(batch, heads).sum(dim=0)
    return result


def default_block_size(
    seq_len: int, heads: int, *, causal: bool, window: tuple[int, int] | None, score_arrays: int = _SCORE_ARRAYS
) -> int:
    """Query rows per block so that a block's score-sized arrays fit in WORKING_SET_BYTES.

    heads counts the query heads computed together (batch x H for BSHD, H for one THD
    sequence).  A block of b rows sees at most min(seq_len, b + below + above) keys,
    where below and above are how far the mask reaches before and after the diagonal
    (seq_len when unbounded), and it keeps score_arrays FP64 arrays of
    heads x b x that many keys.  Under a window, a block taller than a quarter of the
    mask's reach (below + above) mostly computes hidden scores, so b is also kept to that
    (but not below _MIN_ROWS).  The result is at least 1 and at most seq_len.
    """
    left, right = (-1, -1) if window is None else window
    below = seq_len if left < 0 else left
    above = 0 if causal else (seq_len if right < 0 else right)
    extra = below + above
    elements_per_head = WORKING_SET_BYTES // (8 * score_arrays * max(heads, 1))
    # Largest b with b * (b + extra) <= elements_per_head (the block sees its full window) ...
    rows_in_window = (math.isqrt(extra * extra + 4 * elements_per_head) - extra) // 2
    # ... or with b * seq_len <= elements_per_head (the block sees the whole sequence).
    rows_of_full_length = elements_per_head // max(seq_len, 1)
    rows = min(max(rows_in_window, rows_of_full_length), max(extra // 4, _MIN_ROWS))
    return max(1, min(seq_len, rows))


def _visible(i0, i1, j0, j1, causal, left, right, device):
    """Boolean [i1 - i0, j1 - j0]: which keys j0:j1 the queries i0:i1 see (same sequence)."""
    i = torch.arange(i0, i1, device=device)[:, None]
    j = torch.arange(j0, j1, device=device)[None, :]
    visible = torch.ones(i1 - i0, j1 - j0, dtype=torch.bool, device=device)
    if causal:
        visible &= j <= i
    if left >= 0:
        visible &= j >= i - left
    if right >= 0:
        visible &= j <= i + right
    return visible


def _grouped(x, groups):
    """[B, S, heads, D] as [B * groups, S, heads // groups, D] (a view when groups == 1)."""
    batch, tokens, heads, head_dim = x.shape
    x = x.reshape(batch, tokens, groups, heads // groups, head_dim).transpose(1, 2)
    return x.contiguous().flatten(0, 1)


def _ungrouped(x, batch, groups, packed):
    """Inverse of _grouped: [B * G, S, heads // G, D] to [B, S, heads, D], or [T, heads, D] if packed."""
    x = x.unflatten(0, (batch, groups)).transpose(1, 2).flatten(2, 3)
    return x[0] if packed else x


def _check_tensors(q, k, v, grad_out, packed):
    layout, rank = ("THD [T, heads, D]", 3) if packed else ("BSHD [B, S, heads, D]", 4)
    named = {"q": q, "k": k, "v": v}
    if grad_out is not None:
        named["grad_out"] = grad_out
    for name, x in named.items():
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name} must be a floating-point torch.Tensor, got {got}")
        if x.dim() != rank:
            raise ValueError(f"{name} must be {rank}-D {layout}, got shape {tuple(x.shape)}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(
            f"k and v must have the same shape but for the head dim, got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if k.shape[:-2] != q.shape[:-2] or k.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"k must match q in tokens and head dim (self-attention), "
            f"got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )
    heads, groups = q.shape[-2], k.shape[-2]
    if groups == 0 or heads % groups != 0:
        raise ValueError(f"query heads ({heads}) must be a multiple of key-value groups ({groups})")
    out_shape = (*q.shape[:-1], v.shape[-1])
    if grad_out is not None and grad_out.shape != out_shape:
        raise ValueError(
            f"grad_out must have q's shape with v's head dim, {out_shape}, got {tuple(grad_out.shape)}"
        )


def _check_block_size(block_size):
    if block_size is None:
        return
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be a positive int or None, got {block_size!r}")


def _checked_scale(softmax_scale):
    real = isinstance(softmax_scale, numbers.Real) and not isinstance(softmax_scale, bool)
    if not real or not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be a finite real number, got {softmax_scale!r}")
    return float(softmax_scale)


def _checked_softcap(softcap):
    if softcap is None:
        return None
    real = isinstance(softcap, numbers.Real) and not isinstance(softcap, bool)
    if not real or not math.isfinite(softcap) or softcap <= 0:
        raise ValueError(f"softcap must be None or a finite positive number, got {softcap!r}")
    return float(softcap)


def _check_sinks(sinks, heads):
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point() or sinks.shape != (heads,):
        got = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise ValueError(f"sinks must be a floating-point torch.Tensor of shape ({heads},), one per query head, got {got}")
    if not bool(torch.isfinite(sinks).all()):
        raise ValueError("sinks must be finite")


def _checked_window(window):
    if window is None:
        return -1, -1
    pair = isinstance(window, (tuple, list)) and len(window) == 2
    if not pair or not all(isinstance(side, numbers.Integral) and type(side) is not bool for side in window):
        raise ValueError(f"window must be a pair of ints (left, right), got {window!r}")
    left, right = int(window[0]), int(window[1])
    if left < -1 or right < -1:
        raise ValueError(f"window entries must be >= -1 (-1 means unbounded), got {(left, right)}")
    return left, right


def _checked_sequences(cu_seqlens, tokens):
    """[(start, end)] of each packed sequence."""
    bounds = torch.as_tensor(cu_seqlens)
    integer = not (bounds.is_floating_point() or bounds.is_complex() or bounds.dtype == torch.bool)
    if not integer or bounds.dim() != 1 or bounds.numel() < 2:
        raise ValueError(f"cu_seqlens must be a 1-D integer sequence of n + 1 >= 2 offsets, got {cu_seqlens}")
    bounds = bounds.tolist()
    if bounds[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {bounds}")
    if any(end < start for start, end in zip(bounds[:-1], bounds[1:])):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {bounds}")
    if bounds[-1] != tokens:
        raise ValueError(f"cu_seqlens must end at T = {tokens} (the tokens in q), got {bounds}")
    return list(zip(bounds[:-1], bounds[1:]))
