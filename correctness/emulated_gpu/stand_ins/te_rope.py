"""TE 2.17's fused RoPE kernel (`transformer_engine_torch.fused_rope_forward` / `fused_rope_backward`,
called by attention/rope.py FusedRoPEFunc) on the emulated GPU.

The kernel (common/fused_rope/fused_rope.cu at v2.17, its launcher in
pytorch/csrc/extensions/apply_rope.cpp) rotates each token of `input` by one row of the FP32
frequencies `freqs` [max_s, 1, 1, d2]: in SBHD and BSHD the token's position in the sequence
dimension, in THD its position within its packed row (cu_seqlens[b] / cp_size to
cu_seqlens[b + 1] / cp_size); plus start_positions[b] where given; and, with context parallelism,
the dual-chunk offset of the CP rank (the first half of the local tokens at cp_rank * s / 2, the
second half at s * cp_size - (cp_rank + 1) * s / 2, fused_rope.cu 157-166). Which row each token
reads is worked out here; the arithmetic on it (FP32 sincos, the rotation or its transpose, one
rounding, the dims past d2 copied) is correctness.rope.paths.fused_kernel_rope, the project's one
copy of it. The output is a new contiguous tensor in the input's dtype, as the launcher allocates.

A THD token the kernel's grid never reaches (past cu_seqlens[-1] / cp_size, between rows, or at a
position >= max_s) is left unwritten by the kernel: here it is NaN, so that code reading it fails.
A frequency row outside `freqs` (the kernel would read past it) raises. The fused QKV variant
(`fused_qkv_rope_forward`, Megatron's fused_single_qkv_rope) is not stood in for: no tier calls it.
"""

import torch

from correctness.emulated_gpu.kernels import require_on_gpu, stand_in
from correctness.emulated_gpu.runtime import NotEmulated
from correctness.rope.paths import fused_kernel_rope

# TE's NVTE_QKV_Format values (te_on_cpu.ENUMS) that FusedRoPEFunc passes.
SBHD, BSHD, THD = 0, 1, 2

COMPUTES = ("per token, its FP32 frequency row (position in the sequence or in its THD row, start_positions,"
            " the CP rank's dual-chunk offset), FP32 sincos and rotation, one rounding to the input's dtype, the dims"
            " past the frequencies copied (correctness.rope.paths.fused_kernel_rope); unwritten THD tokens NaN")


def _check(kernel: str, input: torch.Tensor, freqs: torch.Tensor, qkv_format: int, cu_seqlens, cp_size: int) -> None:
    """The launcher's TORCH_CHECKs (apply_rope.cpp), as RuntimeErrors."""
    if freqs.dim() != 4 or freqs.shape[1] != 1 or freqs.shape[2] != 1:
        raise RuntimeError(f"{kernel}: expected a 4D freqs tensor [s, 1, 1, d2], got {tuple(freqs.shape)}")
    if freqs.dtype != torch.float32:
        raise RuntimeError(f"{kernel}: Dtype of the freqs tensor must be float, got {freqs.dtype}")
    if input.shape[-1] < freqs.shape[3]:
        raise RuntimeError(f"{kernel}: expected the last dim of the input tensor ({input.shape[-1]}) equals or is"
                           f" greater than the freqs tensor's ({freqs.shape[3]})")
    if qkv_format == THD:
        if input.dim() != 3 or cu_seqlens is None or cu_seqlens.dim() != 1:
            raise RuntimeError(f"{kernel}: THD needs a 3D input and a 1D cu_seqlens")
        return
    if input.dim() != 4:
        raise RuntimeError(f"{kernel}: expected a 4D input tensor, got {input.dim()}D")
    s = input.shape[0] if qkv_format == SBHD else input.shape[1]
    if s * cp_size > freqs.shape[0]:
        raise RuntimeError(f"{kernel}: expected freqs tensor has a longer sequence length than input"
                           f" ({freqs.shape[0]} < {s} x CP {cp_size})")


def _cp_offset(position: torch.Tensor, length: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """The frequency row's offset for the CP rank's dual chunks (fused_rope.cu 159-166)."""
    if cp_size == 1:
        return torch.zeros_like(position)
    if length % 2:
        raise RuntimeError(f"fused RoPE with CP {cp_size}: a sequence of {length} local tokens is not in two chunks"
                           " (the kernel asserts an even length)")
    half = length // 2
    second = length * cp_size - (cp_rank + 1) * half - half
    return torch.where(position < half, cp_rank * half, second)


def _dense_rows(input: torch.Tensor, qkv_format: int, start_positions, cp_size: int, cp_rank: int) -> torch.Tensor:
    """SBHD / BSHD: each token's frequency row, shaped as the input's first two dims."""
    s, b = (input.shape[0], input.shape[1]) if qkv_format == SBHD else (input.shape[1], input.shape[0])
    position = torch.arange(s).unsqueeze(1).expand(s, b)
    rows = position + _cp_offset(position, s, cp_size, cp_rank)
    if start_positions is not None:
        rows = rows + start_positions.cpu().long().unsqueeze(0)
    return rows if qkv_format == SBHD else rows.t()


def _packed_rows(input: torch.Tensor, cu_seqlens: torch.Tensor, max_s: int, start_positions, cp_size: int,
                 cp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """THD: each token's frequency row, and whether the kernel's grid writes the token at all."""
    rows = torch.zeros(input.shape[0], dtype=torch.long)
    written = torch.zeros(input.shape[0], dtype=torch.bool)
    bounds = cu_seqlens.tolist()
    starts = start_positions.tolist() if start_positions is not None else [0] * (len(bounds) - 1)
    for row, (begin, end) in enumerate(zip(bounds, bounds[1:])):
        first, last = begin // cp_size, end // cp_size
        position = torch.arange(min(last - first, max_s))
        offset = _cp_offset(position, last - first, cp_size, cp_rank)
        if first + len(position) > input.shape[0]:
            raise RuntimeError(f"THD fused RoPE: row {row} ends at token {first + len(position)} of {input.shape[0]}"
                               " (the CUDA kernel would write past its output)")
        rows[first:first + len(position)] = position + starts[row] + offset
        written[first:first + len(position)] = True
    return rows, written


def _fused_rope(kernel: str, input, freqs, start_positions, qkv_format, interleaved, cu_seqlens, cp_size, cp_rank,
                *, backward: bool) -> torch.Tensor:
    require_on_gpu(kernel, input=input, freqs=freqs, start_positions=start_positions, cu_seqlens=cu_seqlens)
    fmt = int(qkv_format)
    if fmt not in (SBHD, BSHD, THD):
        raise NotEmulated(f"{kernel} in QKV format {getattr(qkv_format, 'name', fmt)}: only sbhd, bshd and thd are"
                          " emulated (FusedRoPEFunc passes no other)")
    _check(kernel, input, freqs, fmt, cu_seqlens, cp_size)
    table = freqs.reshape(freqs.shape[0], freqs.shape[3])
    if fmt == THD:
        rows, written = _packed_rows(input, cu_seqlens, freqs.shape[0], start_positions, cp_size, cp_rank)
    else:
        rows = _dense_rows(input, fmt, start_positions, cp_size, cp_rank)
        written = torch.ones(rows.shape, dtype=torch.bool)
    read = rows[written]
    if read.numel() and (int(read.max()) >= table.shape[0] or int(read.min()) < 0):
        raise RuntimeError(f"{kernel}: tokens read frequency rows {int(read.min())} to {int(read.max())} of"
                           f" {table.shape[0]} (the CUDA kernel would read outside freqs)")
    per_token = table[torch.where(written, rows, 0)].unsqueeze(-2)  # [..., 1, d2] against [..., heads, d]
    out = fused_kernel_rope(input, per_token, bool(interleaved), backward=backward).contiguous()
    if not bool(written.all()):
        unwritten = (~written).view(-1, 1, 1).to(out.device)
        out = torch.where(unwritten, torch.full_like(out, float("nan")), out)
    return out


@stand_in(name="transformer_engine_torch.fused_rope_forward",
          stands_for="TE 2.17's fused RoPE kernel, forward (fused_rope_forward, common/fused_rope/fused_rope.cu)",
          computes=f"the rotation: {COMPUTES}")
def fused_rope_forward(input, freqs, start_positions, qkv_format, interleaved, cu_seqlens, cp_size, cp_rank):
    return _fused_rope("fused_rope_forward", input, freqs, start_positions, qkv_format, interleaved, cu_seqlens,
                       int(cp_size), int(cp_rank), backward=False)


@stand_in(name="transformer_engine_torch.fused_rope_backward",
          stands_for="TE 2.17's fused RoPE kernel, backward (fused_rope_backward, common/fused_rope/fused_rope.cu)",
          computes=f"the transposed rotation of the output gradient: {COMPUTES}")
def fused_rope_backward(output_grads, freqs, start_positions, qkv_format, interleaved, cu_seqlens, cp_size, cp_rank):
    return _fused_rope("fused_rope_backward", output_grads, freqs, start_positions, qkv_format, interleaved,
                       cu_seqlens, int(cp_size), int(cp_rank), backward=True)
