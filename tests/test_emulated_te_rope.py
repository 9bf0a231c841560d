"""The emulated GPU's stand-in for TE 2.17's fused RoPE kernel (correctness/emulated_gpu/stand_ins/
te_rope.py), reached through TE's own FusedRoPEFunc: against TE's unfused RoPE Python in FP32, which
computes the same products in the same order (tests/test_rope_lever.py holds that bitwise for the
lever's shapes), in every layout the kernel takes, with start positions and a context-parallel rank;
the kernel's unwritten THD tokens; and a CPU tensor refused."""

import pytest
import torch

from correctness.emulated_gpu.gpus import parse_emulated
from correctness.emulated_gpu.kernels import NotOnGpu, stand_ins_called
from correctness.emulated_gpu.session import emulated_gpu

pytestmark = pytest.mark.te_cpu

HEADS, HEAD_DIM = 3, 16


@pytest.fixture
def gpu():
    with emulated_gpu(parse_emulated("H100x1")) as emulation:
        yield emulation


def _freqs(positions: int, rotary: int, interleaved: bool) -> torch.Tensor:
    """TE's own RotaryPositionEmbedding frequencies [positions, 1, 1, rotary] on the GPU."""
    from transformer_engine.pytorch.attention.rope import RotaryPositionEmbedding

    return RotaryPositionEmbedding(rotary, interleaved=interleaved).to("cuda")(positions)


def _rotated_both_ways(t: torch.Tensor, freqs: torch.Tensor, **options):
    """TE's apply_rotary_pos_emb fused (the stand-in) and unfused (TE's torch code), forward and
    backward, on the same FP32 input and upstream gradient."""
    from transformer_engine.pytorch.attention.rope import apply_rotary_pos_emb

    grad = torch.randn(t.shape, generator=torch.Generator().manual_seed(1)).to("cuda")
    results = []
    for fused in (True, False):
        x = t.detach().clone().requires_grad_()
        y = apply_rotary_pos_emb(x, freqs, fused=fused, **options)
        y.backward(grad)
        results.append((y.detach(), x.grad))
    return results


def _draw(*shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(0)).to("cuda")


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("tensor_format", ["sbhd", "bshd"])
def test_dense_layouts_with_start_positions_and_a_partial_rotation(gpu, tensor_format, interleaved):
    s, b = 6, 2
    t = _draw(*((s, b) if tensor_format == "sbhd" else (b, s)), HEADS, HEAD_DIM)
    freqs = _freqs(s + 4, 8, interleaved)
    start = torch.tensor([0, 3], dtype=torch.int32).to("cuda")
    (fused, dfused), (unfused, dunfused) = _rotated_both_ways(
        t, freqs, tensor_format=tensor_format, interleaved=interleaved, start_positions=start)
    assert torch.equal(fused, unfused) and torch.equal(dfused, dunfused)
    assert torch.equal(fused[..., 8:], t[..., 8:]) and fused.is_cuda
    called = stand_ins_called()
    assert called["transformer_engine_torch.fused_rope_forward"]["calls"] >= 1
    assert called["transformer_engine_torch.fused_rope_backward"]["calls"] >= 1


@pytest.mark.parametrize("cp_rank", [0, 1])
def test_packed_rows_on_a_context_parallel_rank(gpu, cp_rank):
    """THD on CP rank `cp_rank` of 2: each row's local tokens are its two dual chunks, rotated from
    their global positions."""
    cu_seqlens = torch.tensor([0, 8, 20, 24], dtype=torch.int32).to("cuda")  # global rows of 8, 12 and 4
    t = _draw(12, HEADS, HEAD_DIM)  # this rank's half of the 24 tokens
    freqs = _freqs(12, HEAD_DIM, False)
    (fused, dfused), (unfused, dunfused) = _rotated_both_ways(
        t, freqs, tensor_format="thd", cu_seqlens=cu_seqlens, cp_size=2, cp_rank=cp_rank)
    assert torch.equal(fused, unfused) and torch.equal(dfused, dunfused)


def test_sequence_dims_on_a_context_parallel_rank(gpu):
    t = _draw(4, 2, HEADS, HEAD_DIM)
    (fused, dfused), (unfused, dunfused) = _rotated_both_ways(
        t, _freqs(8, HEAD_DIM, True), tensor_format="sbhd", interleaved=True, cp_size=2, cp_rank=1)
    assert torch.equal(fused, unfused) and torch.equal(dfused, dunfused)


def test_tokens_the_kernel_never_writes_are_nan(gpu):
    """Tokens past cu_seqlens[-1] are outside the kernel's grid: its output there is whatever the
    allocation held, NaN here so that code reading it fails."""
    from transformer_engine.pytorch.attention.rope import apply_rotary_pos_emb

    cu_seqlens = torch.tensor([0, 3, 5], dtype=torch.int32).to("cuda")
    out = apply_rotary_pos_emb(_draw(7, HEADS, HEAD_DIM), _freqs(4, HEAD_DIM, False), tensor_format="thd",
                               fused=True, cu_seqlens=cu_seqlens)
    assert not out[:5].isnan().any() and out[5:].isnan().all()


def test_a_frequency_table_too_short_is_refused(gpu):
    from transformer_engine.pytorch.attention.rope import apply_rotary_pos_emb

    with pytest.raises(RuntimeError, match="longer sequence length"):
        apply_rotary_pos_emb(_draw(6, 1, HEADS, HEAD_DIM), _freqs(5, HEAD_DIM, False), fused=True)
    start = torch.tensor([3], dtype=torch.int32).to("cuda")  # positions 3..6 of a table of 6
    with pytest.raises(RuntimeError, match="would read outside freqs"):
        apply_rotary_pos_emb(_draw(4, 1, HEADS, HEAD_DIM), _freqs(6, HEAD_DIM, False), fused=True,
                             start_positions=start)


def test_a_cpu_tensor_is_refused(gpu):
    from transformer_engine.pytorch.attention.rope import apply_rotary_pos_emb

    with pytest.raises(NotOnGpu, match="fused_rope_forward: input is on cpu"):
        apply_rotary_pos_emb(torch.zeros(4, 1, HEADS, HEAD_DIM), _freqs(4, HEAD_DIM, False), fused=True)
