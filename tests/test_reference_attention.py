"""Tests of the FP64 reference attention (references/attention.py).

The independent check is torch's scaled_dot_product_attention on its MATH backend in FP64,
with an explicit boolean mask built here from token positions and gradients from autograd.
"""

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from references.attention import WORKING_SET_BYTES, attention, default_block_size

REFERENCE_AGREEMENT = 1e-12
"""Largest relative L2 error ||reference - sdpa|| / ||sdpa|| allowed for out, dq, dk and dv."""

SAME_ARITHMETIC = 1e-14
"""Largest relative L2 error between two runs of the same FP64 arithmetic (BLAS may still
pick a different summation order for differently aligned buffers)."""

MAX_EXAMPLES = 200
"""Hypothesis examples per property test; keeps the file well under a minute on 2 cores."""

MEMORY_TEST_SEQ_LEN = 4096
"""Long enough that one head's full score matrix (128 MiB in FP64) exceeds WORKING_SET_BYTES."""

GRADIENTS = ("dq", "dk", "dv")


# ---------------------------------------------------------------------------
# Independent implementation: SDPA math backend with a mask built from positions.


def visible_mask(sequence_ids, positions, causal, window):
    """Bool [tokens, tokens]: query token (row) sees key token (column)."""
    i, j = positions[:, None], positions[None, :]
    mask = sequence_ids[:, None] == sequence_ids[None, :]
    if causal:
        mask = mask & (j <= i)
    left, right = window if window is not None else (-1, -1)
    if left != -1:
        mask = mask & (j >= i - left)
    if right != -1:
        mask = mask & (j <= i + right)
    return mask


def sdpa_math(q, k, v, grad_out, *, softmax_scale, causal, window, cu_seqlens=None):
    """out, dq, dk, dv in FP64 and in the inputs' layout (BSHD, or THD with cu_seqlens)."""
    if cu_seqlens is None:
        seq_len = q.shape[1]
        sequence_ids = torch.zeros(seq_len, dtype=torch.long)
        positions = torch.arange(seq_len)
    else:
        # Packed tokens are one batch row; the block-diagonal mask keeps sequences apart.
        q, k, v, grad_out = (x.unsqueeze(0) for x in (q, k, v, grad_out))
        offsets = torch.as_tensor(cu_seqlens)
        sequence_ids = torch.repeat_interleave(torch.arange(len(offsets) - 1), offsets.diff())
        positions = torch.arange(q.shape[1]) - offsets[sequence_ids]
    mask = visible_mask(sequence_ids, positions, causal, window)

    leaves = [x.to(torch.float64).transpose(1, 2).detach().requires_grad_() for x in (q, k, v)]
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(*leaves, attn_mask=mask, scale=softmax_scale, enable_gqa=True)
    grads = torch.autograd.grad(out, leaves, grad_out.to(torch.float64).transpose(1, 2))
    result = {name: x.transpose(1, 2) for name, x in zip(("out", *GRADIENTS), (out.detach(), *grads))}
    if cu_seqlens is not None:
        result = {name: x[0] for name, x in result.items()}
    return result


def relative_error(actual, expected, zero_scale):
    """||actual - expected|| / ||expected||, or / zero_scale where expected is exactly zero."""
    denominator = expected.norm() if expected.norm() > 0 else zero_scale
    return ((actual - expected).norm() / denominator).item()


def assert_agrees(actual, expected, q, k, v, grad_out, softmax_scale, tolerance=REFERENCE_AGREEMENT):
    """Each of expected's tensors agrees with actual's to the relative L2 tolerance.

    When every query sees a single key, the exact dq and dk are zero and SDPA returns
    exact zeros, while the reference's D_i - dP_ii leaves rounding of about
    eps * |dO| * |v|; there the error is taken relative to scale * |dO| * |v| * |k or q|.
    """
    assert set(actual) == set(expected)
    cancellation = abs(softmax_scale) * grad_out.double().norm() * v.double().norm()
    zero_scale = {
        "out": 0.0,
        "dq": cancellation * k.double().norm(),
        "dk": cancellation * q.double().norm(),
        "dv": 0.0,
    }
    errors = {name: relative_error(actual[name], expected[name], zero_scale[name]) for name in expected}
    assert all(error <= tolerance for error in errors.values()), errors


# ---------------------------------------------------------------------------
# Hypothesis strategies.


@dataclass
class Case:
    heads: int
    groups: int
    head_dim: int
    softmax_scale: float
    causal: bool
    window: tuple[int, int] | None
    block_size: int | None
    seed: int

    def tensors(self, tokens_shape):
        """q, k, v, grad_out in FP64, shaped tokens_shape + (heads or groups, head_dim)."""
        generator = torch.Generator().manual_seed(self.seed)
        q_shape = (*tokens_shape, self.heads, self.head_dim)
        kv_shape = (*tokens_shape, self.groups, self.head_dim)
        return tuple(
            torch.randn(shape, generator=generator, dtype=torch.float64)
            for shape in (q_shape, kv_shape, kv_shape, q_shape)
        )

    def kwargs(self):
        return {
            "softmax_scale": self.softmax_scale,
            "causal": self.causal,
            "window": self.window,
        }


def window_sides(seq_len):
    """One side of a window: unbounded, small (windows of 1-4 tokens), or near the sequence length.

    left = seq_len - 1 or more is a window W >= S; left = seq_len - 2 is S = W + 1.
    """
    near_length = [max(seq_len - 2, 0), max(seq_len - 1, 0), seq_len + 3]
    return st.one_of(st.just(-1), st.integers(0, 3), st.sampled_from(near_length))


@st.composite
def cases(draw, seq_len):
    groups = draw(st.integers(1, 4))
    heads = groups * draw(st.integers(1, 4))
    head_dim = draw(st.integers(1, 16))
    causal = draw(st.booleans())
    if draw(st.booleans()):
        window = None
    elif causal:
        # Transformer Engine's causal sliding window is (W - 1, 0); other right sides change nothing.
        window = (draw(window_sides(seq_len)), draw(st.one_of(st.just(0), window_sides(seq_len))))
    else:
        window = (draw(window_sides(seq_len)), draw(window_sides(seq_len)))
    # Scores of about unit size, so the softmax is neither uniform nor one-hot.
    softmax_scale = draw(st.floats(0.1, 2.0)) / math.sqrt(head_dim)
    block_size = draw(st.one_of(st.none(), st.integers(1, seq_len + 2)))
    seed = draw(st.integers(0, 2**32 - 1))
    return Case(heads, groups, head_dim, softmax_scale, causal, window, block_size, seed)


@st.composite
def bshd_cases(draw):
    batch = draw(st.integers(1, 2))
    seq_len = draw(st.integers(1, 40))
    return batch, seq_len, draw(cases(seq_len))


@st.composite
def thd_cases(draw):
    lengths = draw(st.lists(st.integers(1, 16), min_size=1, max_size=4))
    offsets = [0]
    for length in lengths:
        offsets.append(offsets[-1] + length)
    as_tensor = draw(st.booleans())
    cu_seqlens = torch.tensor(offsets, dtype=torch.int32) if as_tensor else offsets
    return cu_seqlens, draw(cases(max(lengths)))


# ---------------------------------------------------------------------------
# Agreement with SDPA math.


@settings(deadline=None, max_examples=MAX_EXAMPLES)
@given(bshd_cases())
def test_bshd_matches_sdpa_math(bshd_case):
    batch, seq_len, case = bshd_case
    q, k, v, grad_out = case.tensors((batch, seq_len))
    actual = attention(q, k, v, grad_out, block_size=case.block_size, **case.kwargs())
    expected = sdpa_math(q, k, v, grad_out, **case.kwargs())
    assert_agrees(actual, expected, q, k, v, grad_out, case.softmax_scale)


@settings(deadline=None, max_examples=MAX_EXAMPLES)
@given(thd_cases())
def test_thd_matches_sdpa_math(thd_case):
    cu_seqlens, case = thd_case
    q, k, v, grad_out = case.tensors((int(cu_seqlens[-1]),))
    actual = attention(q, k, v, grad_out, cu_seqlens=cu_seqlens, block_size=case.block_size, **case.kwargs())
    expected = sdpa_math(q, k, v, grad_out, cu_seqlens=cu_seqlens, **case.kwargs())
    assert_agrees(actual, expected, q, k, v, grad_out, case.softmax_scale)


@pytest.mark.parametrize(
    "causal, window",
    [
        (True, None),
        (True, (1, 0)),
        (True, (3, 0)),
        (True, (-1, 0)),
        (True, (0, 0)),  # every query sees only itself: dq = dk = 0
        (False, None),
        (False, (2, 1)),
        (False, (-1, 3)),
        (False, (0, 0)),
    ],
)
@pytest.mark.parametrize("block_size", [None, 1, 3, 7])
def test_gqa_matches_sdpa_math(causal, window, block_size):
    case = Case(heads=6, groups=2, head_dim=8, softmax_scale=0.4, causal=causal, window=window,
                block_size=block_size, seed=7)
    q, k, v, grad_out = case.tensors((2, 19))
    actual = attention(q, k, v, grad_out, block_size=block_size, **case.kwargs())
    expected = sdpa_math(q, k, v, grad_out, **case.kwargs())
    assert_agrees(actual, expected, q, k, v, grad_out, case.softmax_scale)


# ---------------------------------------------------------------------------
# Layouts, forward-only calls and dtypes.


@pytest.mark.parametrize("block_size", [None, 2])
@pytest.mark.parametrize("window", [None, (2, 0), (1, 2)])
@pytest.mark.parametrize("causal", [True, False])
def test_thd_equals_concatenated_bshd(causal, window, block_size):
    lengths = [5, 1, 0, 9, 3]  # includes a length-1 and an empty sequence
    offsets = [0, 5, 6, 6, 15, 18]
    case = Case(heads=4, groups=2, head_dim=6, softmax_scale=0.5, causal=causal, window=window,
                block_size=block_size, seed=3)
    q, k, v, grad_out = case.tensors((offsets[-1],))
    packed = attention(q, k, v, grad_out, cu_seqlens=offsets, block_size=block_size, **case.kwargs())

    pieces = {name: [] for name in packed}
    for start, length in zip(offsets, lengths):
        per_sequence = [x[start : start + length].unsqueeze(0) for x in (q, k, v, grad_out)]
        result = attention(*per_sequence, block_size=block_size, **case.kwargs())
        for name, x in result.items():
            pieces[name].append(x[0])
    expected = {name: torch.cat(xs) for name, xs in pieces.items()}
    assert_agrees(packed, expected, q, k, v, grad_out, case.softmax_scale, tolerance=SAME_ARITHMETIC)


@pytest.mark.parametrize("cu_seqlens", [None, [0, 4, 11]])
def test_forward_only_returns_out_of_full_call(cu_seqlens):
    case = Case(heads=4, groups=1, head_dim=5, softmax_scale=0.3, causal=True, window=(3, 0),
                block_size=None, seed=11)
    tokens = (11,) if cu_seqlens else (2, 11)
    q, k, v, grad_out = case.tensors(tokens)
    forward = attention(q, k, v, cu_seqlens=cu_seqlens, **case.kwargs())
    full = attention(q, k, v, grad_out, cu_seqlens=cu_seqlens, **case.kwargs())
    assert set(forward) == {"out"}
    assert set(full) == {"out", *GRADIENTS}
    assert relative_error(forward["out"], full["out"], 0.0) <= SAME_ARITHMETIC


def test_bf16_inputs_are_upcast():
    case = Case(heads=4, groups=2, head_dim=8, softmax_scale=0.35, causal=True, window=None,
                block_size=5, seed=5)
    q, k, v, grad_out = (x.to(torch.bfloat16) for x in case.tensors((2, 17)))
    result = attention(q, k, v, grad_out, block_size=5, **case.kwargs())
    upcast = (x.double() for x in (q, k, v, grad_out))
    on_fp64_values = attention(*upcast, block_size=5, **case.kwargs())
    assert all(x.dtype == torch.float64 and x.device == q.device for x in result.values())
    assert_agrees(result, on_fp64_values, q, k, v, grad_out, case.softmax_scale, tolerance=SAME_ARITHMETIC)
    expected = sdpa_math(q, k, v, grad_out, **case.kwargs())
    assert_agrees(result, expected, q, k, v, grad_out, case.softmax_scale)


def test_outputs_keep_input_layout():
    case = Case(heads=6, groups=3, head_dim=4, softmax_scale=0.5, causal=True, window=None,
                block_size=None, seed=2)
    q, k, v, grad_out = case.tensors((3, 7))
    result = attention(q, k, v, grad_out, **case.kwargs())
    assert result["out"].shape == result["dq"].shape == q.shape
    assert result["dk"].shape == result["dv"].shape == k.shape
    packed = attention(q[0], k[0], v[0], grad_out[0], cu_seqlens=torch.tensor([0, 7]), **case.kwargs())
    assert packed["out"].shape == packed["dq"].shape == q[0].shape
    assert packed["dk"].shape == packed["dv"].shape == k[0].shape


@pytest.mark.parametrize("cu_seqlens, tokens", [(None, (0, 5)), ([0, 0], (0,)), ([0, 0, 0], (0,))])
def test_empty_inputs_give_empty_outputs(cu_seqlens, tokens):
    case = Case(heads=2, groups=1, head_dim=3, softmax_scale=0.5, causal=True, window=None,
                block_size=None, seed=0)
    q, k, v, grad_out = case.tensors(tokens)
    result = attention(q, k, v, grad_out, cu_seqlens=cu_seqlens, **case.kwargs())
    assert {name: x.shape for name, x in result.items()} == {
        "out": q.shape, "dq": q.shape, "dk": k.shape, "dv": v.shape
    }


# ---------------------------------------------------------------------------
# Validation.

_B, _S, _H, _G, _D = 1, 6, 4, 2, 3


def _bshd(heads=_H, seq_len=_S, head_dim=_D):
    return torch.zeros(_B, seq_len, heads, head_dim)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"q": torch.zeros(_S, _H, _D)}, r"^q must be 4-D"),
        ({"k": torch.zeros(_B, _S, _G)}, r"^k must be 4-D"),
        ({"q": _bshd().long()}, r"^q must be a floating-point"),
        ({"v": _bshd(heads=1)}, r"^k and v must have the same shape"),
        ({"k": _bshd(_G, seq_len=5), "v": _bshd(_G, seq_len=5)}, r"^k must match q"),
        ({"k": _bshd(_G, head_dim=4), "v": _bshd(_G, head_dim=4)}, r"^k must match q"),
        ({"k": _bshd(3), "v": _bshd(3)}, r"query heads \(4\) must be a multiple of key-value groups \(3\)"),
        ({"grad_out": _bshd(heads=2)}, r"^grad_out must have q's shape"),
        ({"grad_out": torch.zeros(_S, _H, _D)}, r"^grad_out must be 4-D"),
        ({"window": (-2, 0)}, r"^window entries must be >= -1"),
        ({"window": (3, -5)}, r"^window entries must be >= -1"),
        ({"window": (3,)}, r"^window must be a pair"),
        ({"window": (1.5, 0)}, r"^window must be a pair"),
        ({"softmax_scale": math.inf}, r"^softmax_scale must be a finite"),
        ({"softmax_scale": math.nan}, r"^softmax_scale must be a finite"),
        ({"block_size": 0}, r"^block_size must be a positive int"),
    ],
)
def test_invalid_bshd_inputs_raise(change, message):
    arguments = {"q": _bshd(), "k": _bshd(_G), "v": _bshd(_G), "grad_out": _bshd(), "softmax_scale": 0.5}
    arguments.update(change)
    with pytest.raises(ValueError, match=message):
        attention(**arguments)


@pytest.mark.parametrize(
    "cu_seqlens, message",
    [
        ([1, 6], r"^cu_seqlens must start at 0"),
        ([0, 4, 2, 6], r"^cu_seqlens must be non-decreasing"),
        ([0, 5], r"^cu_seqlens must end at T = 6"),
        ([0, 3, 7], r"^cu_seqlens must end at T = 6"),
        ([0], r"^cu_seqlens must be a 1-D integer"),
        (torch.tensor([0.0, 6.0]), r"^cu_seqlens must be a 1-D integer"),
        (torch.tensor([[0, 6]]), r"^cu_seqlens must be a 1-D integer"),
    ],
)
def test_invalid_cu_seqlens_raise(cu_seqlens, message):
    q, k = torch.zeros(_S, _H, _D), torch.zeros(_S, _G, _D)
    with pytest.raises(ValueError, match=message):
        attention(q, k, k, softmax_scale=0.5, cu_seqlens=cu_seqlens)


def test_thd_inputs_need_rank_3():
    with pytest.raises(ValueError, match=r"^q must be 3-D THD"):
        attention(_bshd(), _bshd(_G), _bshd(_G), softmax_scale=0.5, cu_seqlens=[0, _S])


# ---------------------------------------------------------------------------
# Memory.


class LargestTensor(TorchFunctionMode):
    """Records the largest tensor (in bytes) that any torch function returns while active."""

    def __init__(self):
        super().__init__()
        self.largest_bytes = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for x in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(x, torch.Tensor):
                self.largest_bytes = max(self.largest_bytes, x.numel() * x.element_size())
        return result


def largest_intermediate_bytes(seq_len, causal, window, heads=2, groups=1):
    """Largest tensor the reference creates for one fwd+bwd call with head dim 2."""
    case = Case(heads=heads, groups=groups, head_dim=2, softmax_scale=0.5, causal=causal, window=window,
                block_size=None, seed=0)
    q, k, v, grad_out = case.tensors((1, seq_len))
    with LargestTensor() as probe:
        attention(q, k, v, grad_out, **case.kwargs())
    return probe.largest_bytes


@pytest.mark.parametrize(
    "causal, window", [(True, None), (False, None), (True, (511, 0)), (False, (255, 255))]
)
def test_working_set_does_not_grow_with_seq_squared(causal, window):
    # Head dim 2 keeps inputs and outputs tiny, so the largest tensor is a score-sized block.
    # One head's full FP64 score matrix is seq^2 * 8 bytes; at MEMORY_TEST_SEQ_LEN that is 2x the budget.
    full_scores_bytes = MEMORY_TEST_SEQ_LEN**2 * 8
    assert full_scores_bytes > WORKING_SET_BYTES
    largest = largest_intermediate_bytes(MEMORY_TEST_SEQ_LEN, causal, window)
    assert largest <= WORKING_SET_BYTES
    assert largest < full_scores_bytes / 2


@pytest.mark.parametrize("seq_len", [1, 2, 100, 4096, 100_000, 1_000_000])
@pytest.mark.parametrize("heads", [1, 2, 64])
@pytest.mark.parametrize(
    "causal, window", [(True, None), (False, None), (True, (1023, 0)), (False, (7, 3)), (True, (-1, 5))]
)
def test_default_block_size_is_within_sequence_and_budget(seq_len, heads, causal, window):
    rows = default_block_size(seq_len, heads, causal=causal, window=window)
    assert 1 <= rows <= seq_len
    left, right = window if window is not None else (-1, -1)
    below = seq_len if left < 0 else left
    above = 0 if causal else (seq_len if right < 0 else right)
    keys = min(seq_len, rows + below + above)
    # A block keeps at most a couple of FP64 score-sized arrays of heads x rows x keys.
    assert rows == 1 or heads * rows * keys * 8 <= WORKING_SET_BYTES
