"""The RoPE lever's inputs and paths: Megatron's `apply_rotary_pos_emb` (unfused, or fused through
TE), a stand-in for TE 2.17's fused kernel's arithmetic on the CPU, TE 2.17's own unfused RoPE
(its Python on the CPU, correctness.te_on_cpu) that holds the stand-in, and the FP64 references.

Inputs: q and k in Megatron's layout (BSHD [positions, rows, heads, head_dim], THD [tokens, heads,
head_dim]), their upstream gradients, and the FP32 frequencies [positions, 1, 1, rotary dims] made
by Megatron's own `RotaryEmbedding` (rotary_pos_embedding.py: inv_freq = 1 / base^(2i / r) in FP32,
outer product with the FP32 positions, the halves concatenated or, interleaved, each angle
repeated) for the shape's rotary fraction, base, scaling and first position. Both paths and the
reference get the same frequencies: the lever judges the rotation, not the angles (the angles'
FP32 rounding, shared by every path, is measured apart: `FormulaRope`).

Outputs, in the harness's [..., positions, heads, features] layout (BSHD rows first): `q`, `k`
(the rotary dims after the rotation), `dq`, `dk` (their gradients), and where the rotary fraction
is below 1, `q_pass`, `k_pass`, `dq_pass`, `dk_pass` (the dims that pass unrotated), judged apart
so that the exact copies do not dilute the rotated dims' errors.
"""

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any
from unittest import mock

import torch

from correctness.errors import ImplementationUnavailable, require_megatron_core
from correctness.lever import ImplementationOutput
from correctness.provenance import megatron_core_version
from correctness.rope.shapes import RopeShape
from references.rope import rope_angles, rope_backward, rope_forward


@dataclass(frozen=True, kw_only=True)
class RopeInputs:
    shape: RopeShape
    q: torch.Tensor
    k: torch.Tensor
    grad_q: torch.Tensor
    grad_k: torch.Tensor
    freqs: torch.Tensor  # [max row, 1, 1, rotary dims] FP32, Megatron's
    cu_seqlens: torch.Tensor | None  # THD: int32 [rows + 1]

    def with_freqs(self, freqs: torch.Tensor, **shape_changes: Any) -> "RopeInputs":
        return replace(self, freqs=freqs, shape=self.shape.with_changes(**shape_changes))

    def freq_rows(self) -> torch.Tensor:
        """The row of `freqs` each token rotates by (its position within its row, from the first)."""
        bounds = self.shape.cu_seqlens
        device = self.q.device
        if bounds is None:
            return torch.arange(self.q.shape[0], device=device)
        return torch.cat([torch.arange(end - start, device=device) for start, end in zip(bounds, bounds[1:])])


@contextlib.contextmanager
def _cuda_device_on_cpu(device: torch.device) -> Iterator[None]:
    """RotaryEmbedding.get_emb moves its inv_freq to torch.cuda.current_device(): on a machine
    without a GPU that is the CPU, for the call only."""
    if device.type != "cpu":
        yield
        return
    with mock.patch.object(torch.cuda, "current_device", lambda: "cpu"):
        yield


@dataclass(frozen=True)
class ContextParallelOne:
    """Stands in for the context-parallel group (CP 1): Megatron reads only its size and rank."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def megatron_freqs(shape: RopeShape, device: torch.device, *, position_shift: int = 0,
                   rows: int | None = None, whole_head: bool = False) -> torch.Tensor:
    """Megatron's RotaryEmbedding(...)(rows, offset) for the shape: FP32 [rows, 1, 1, rotary dims]
    (`whole_head`: rotary_percent 1, for a control)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    percent = 1.0 if whole_head else shape.rotary_percent
    with _cuda_device_on_cpu(device):
        rotary = RotaryEmbedding(
            kv_channels=shape.head_dim, rotary_percent=percent, rotary_interleaved=shape.interleaved,
            seq_len_interpolation_factor=shape.interpolation_factor, rotary_base=shape.rotary_base,
            rope_scaling=shape.rope_scaling_factor is not None,
            rope_scaling_factor=shape.rope_scaling_factor or 8.0,
            use_cpu_initialization=device.type == "cpu", cp_group=ContextParallelOne(),
        )
        freqs = rotary(rows or shape.max_row, offset=shape.first_position + position_shift,
                       packed_seq=shape.qkv_format == "thd")
    if freqs.shape[-1] != (shape.head_dim if whole_head else shape.rotary_dims):
        raise ValueError(f"Megatron's RotaryEmbedding made {freqs.shape[-1]} rotary dims, the shape says {shape.rotary_dims}")
    return freqs.to(device)


def make_inputs(shape: RopeShape, seed: int, device: torch.device) -> RopeInputs:
    """Standard-normal q and k (q and k after their norms, unit RMS) and upstream gradients, in the
    recipe's dtype; Megatron's frequencies."""
    generator = torch.Generator().manual_seed(seed)
    if shape.qkv_format == "thd":
        lead = (shape.cu_seqlens[-1],)
    else:
        lead = (shape.positions, shape.rows)
    sizes = [(*lead, heads, shape.head_dim) for heads in (shape.heads, shape.groups)] * 2
    q, k, grad_q, grad_k = (torch.randn(size, generator=generator).to(shape.torch_dtype).to(device) for size in sizes)
    bounds = shape.cu_seqlens
    cu_seqlens = None if bounds is None else torch.tensor(bounds, dtype=torch.int32, device=device)
    return RopeInputs(shape=shape, q=q, k=k, grad_q=grad_q, grad_k=grad_k, freqs=megatron_freqs(shape, device),
                      cu_seqlens=cu_seqlens)


def outputs(shape: RopeShape, q: torch.Tensor, k: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor) -> dict[str, torch.Tensor]:
    """The judged tensors: BSHD moved to [rows, positions, heads, dims]; the rotary dims and, where
    the fraction is below 1, the passed dims apart."""
    named = {"q": q, "k": k, "dq": dq, "dk": dk}
    if shape.qkv_format == "bshd":
        named = {name: x.transpose(0, 1) for name, x in named.items()}
    tensors = {name: x[..., :shape.rotary_dims].contiguous() for name, x in named.items()}
    if shape.rotary_dims < shape.head_dim:
        tensors.update((f"{name}_pass", x[..., shape.rotary_dims:].contiguous()) for name, x in named.items())
    return tensors


def te_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("transformer_engine")
    except Exception:  # noqa: BLE001 - not installed, or unreadable: recorded as absent
        return None


@dataclass(frozen=True)
class MegatronRope:
    """Megatron's `apply_rotary_pos_emb` (rope_utils.py) on q and k as attention.py calls it
    (`cu_seqlens` for THD, mscale 1, the CP group), with `apply_rope_fusion` as given: False is
    `--no-rope-fusion` (its torch code, `_apply_rotary_pos_emb_bshd` / `_thd`), True is Megatron's
    default, TE's `apply_rotary_pos_emb(..., fused=True)` through `fused_apply_rotary_pos_emb(_thd)`
    (FusedRoPEFunc, CUDA only). The backward is autograd's through whichever ran."""

    fused: bool

    @property
    def name(self) -> str:
        return "megatron-rope-fused-te" if self.fused else "megatron-rope-unfused"

    def config(self, shape: RopeShape):
        from megatron.core.transformer.transformer_config import TransformerConfig

        with warnings.catch_warnings():  # about its default cuda_graph_scope, which no call here reads
            warnings.filterwarnings("ignore", message="full scope is deprecated", category=UserWarning)
            return TransformerConfig(
                num_layers=1, hidden_size=shape.heads * shape.tp_size * shape.head_dim,
                num_attention_heads=shape.heads * shape.tp_size, num_query_groups=shape.groups * shape.tp_size,
                kv_channels=shape.head_dim, tensor_model_parallel_size=shape.tp_size,
                bf16=shape.dtype == "bf16", fp16=shape.dtype == "fp16", params_dtype=shape.torch_dtype,
                apply_rope_fusion=self.fused, rotary_interleaved=shape.interleaved,
            )

    def run(self, inputs: RopeInputs) -> ImplementationOutput:
        require_megatron_core()
        from megatron.core.models.common.embeddings import rope_utils

        if self.fused and inputs.q.device.type != "cuda":
            raise ImplementationUnavailable("TE's fused RoPE is a CUDA kernel; these inputs are on the CPU")
        # Both fused functions come from one import of TE (megatron/core/extensions/transformer_engine.py);
        # without them TransformerConfig refuses apply_rope_fusion ("apply_rope_fusion is not available").
        if self.fused and rope_utils.fused_apply_rotary_pos_emb is None:
            raise ImplementationUnavailable(
                "megatron-core found no TE fused_apply_rotary_pos_emb (Transformer Engine missing)")
        config = self.config(inputs.shape)
        q, k = (x.detach().requires_grad_() for x in (inputs.q, inputs.k))
        rotated = [rope_utils.apply_rotary_pos_emb(x, inputs.freqs, config, cu_seqlens=inputs.cu_seqlens,
                                                   cp_group=ContextParallelOne()) for x in (q, k)]
        torch.autograd.backward(rotated, [inputs.grad_q, inputs.grad_k])
        details: dict[str, Any] = {
            "function": "megatron.core.models.common.embeddings.rope_utils.apply_rotary_pos_emb",
            "apply_rope_fusion": self.fused, "megatron_core": megatron_core_version(),
            "ran": ("TE FusedRoPEFunc (tex.fused_rope_forward / backward)" if self.fused else
                    f"_apply_rotary_pos_emb_{inputs.shape.qkv_format if inputs.shape.qkv_format == 'thd' else 'bshd'}"
                    " in the inputs' dtype, backward by autograd"),
        }
        if self.fused:
            details["transformer_engine"] = te_version()
        return ImplementationOutput(
            tensors=outputs(inputs.shape, rotated[0].detach(), rotated[1].detach(), q.grad, k.grad),
                          backend="te-fused-rope" if self.fused else "megatron-unfused-rope", details=details)


def _fused_kernel_rotation(src: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
                           backward: bool) -> torch.Tensor:
    """fused_rope.cu's fused_rope_block_forward / _backward on the rotary dims, in FP32: each
    output element is src * cos + partner * sin with the kernel's partner and sine (TE v2.17
    transformer_engine/common/fused_rope/fused_rope.cu, lines 33-56 and 88-116)."""
    half = src.shape[-1] // 2
    if not interleaved:
        first, second = src[..., :half], src[..., half:]
        if not backward:  # partner: -x[i + r/2] for the first half, x[i - r/2] for the second
            partner_sin = torch.cat((-second, first), dim=-1) * sin
        else:  # partner x[i + r/2] with sin[i + r/2]; x[i - r/2] with -sin[i - r/2]
            partner_sin = torch.cat((second * sin[..., half:], -first * sin[..., :half]), dim=-1)
    else:
        even, odd = src[..., 0::2], src[..., 1::2]
        if not backward:  # partner: -x[i + 1] at even i, x[i - 1] at odd i
            partner_sin = torch.stack((-odd, even), dim=-1).flatten(-2) * sin
        else:  # x[i + 1] with sin[i + 1] at even i; x[i - 1] with -sin[i - 1] at odd i
            partner_sin = torch.stack((odd * sin[..., 1::2], -even * sin[..., 0::2]), dim=-1).flatten(-2)
    return src * cos + partner_sin


def fused_kernel_rope(x: torch.Tensor, freqs: torch.Tensor, interleaved: bool, *, backward: bool) -> torch.Tensor:
    """What TE 2.17's fused RoPE kernel writes for `x` [..., heads, d] given each token's FP32
    frequencies `freqs` [..., 1, r] (r <= d): sincos of the FP32 frequency, the rotation (or, for the
    backward, its transpose) in FP32, one rounding to x's dtype; the dims past r copied. Shared by
    `FusedRopeArithmetic` and the emulated GPU's stand-in for tex.fused_rope_forward / _backward
    (correctness/emulated_gpu/stand_ins/te_rope.py), which gathers `freqs` per token as the kernel does."""
    r = freqs.shape[-1]
    rotated = _fused_kernel_rotation(x[..., :r].float(), torch.cos(freqs), torch.sin(freqs), interleaved, backward)
    return torch.cat((rotated.to(x.dtype), x[..., r:]), dim=-1)


@dataclass(frozen=True)
class FusedRopeArithmetic:
    """Stands in for TE 2.17's fused RoPE kernel (FusedRoPEFunc: tex.fused_rope_forward and
    tex.fused_rope_backward) where it cannot run: its arithmetic in torch, on any device. What the
    kernel does: the FP32 frequency of each token's row (its position within its THD row) through
    sincosf, the input element and its partner loaded as FP32, `src * cos + partner * sin` in FP32,
    and one rounding to the input's dtype; dims past the frequencies' width copied. The backward
    applies the transposed rotation to the upstream gradient the same way. What differs from the
    CUDA kernel: torch's FP32 cos and sin on the CPU in place of CUDA's sincosf (each within an
    FP32 ulp or two), and the FP32 sum rounded after each product where nvcc may contract one
    product into an FMA; both well below the BF16 rounding that follows. Held bitwise against TE's
    own unfused RoPE in FP32 on the CPU (`TeUnfusedRope`), which is the same arithmetic in TE's
    layout and pairing code; against the kernel itself only on a GPU."""

    name: str = "te217-fused-rope-arithmetic"

    def run(self, inputs: RopeInputs) -> ImplementationOutput:
        shape = inputs.shape
        freqs = inputs.freqs.float()[inputs.freq_rows()]  # [tokens, 1, 1, r]
        if shape.qkv_format == "thd":
            freqs = freqs.squeeze(1)  # [tokens, 1, r] against [tokens, heads, d]
        q, k = (fused_kernel_rope(x, freqs, shape.interleaved, backward=False) for x in (inputs.q, inputs.k))
        dq, dk = (fused_kernel_rope(g, freqs, shape.interleaved, backward=True) for g in (inputs.grad_q, inputs.grad_k))
        return ImplementationOutput(tensors=outputs(shape, q, k, dq, dk), backend=self.name, details={
            "stands_in_for": "TE 2.17 FusedRoPEFunc (transformer_engine/common/fused_rope/fused_rope.cu)",
            "arithmetic": "FP32 cos/sin of the FP32 frequencies, FP32 rotation, one rounding to the inputs' dtype",
        })


@dataclass(frozen=True)
class TeUnfusedRope:
    """TE 2.17's own unfused RoPE, `apply_rotary_pos_emb(..., fused=False)` (attention/rope.py), its
    Python run on CPU tensors through correctness.te_on_cpu: q and k in Megatron's layouts (TE's
    "sbhd"; "thd" with the cumulative lengths, where TE rotates each packed row from its own
    position 0), Megatron's frequencies, the shape's pairing; the backward by autograd through TE's
    torch code. `compute` is the dtype TE's code runs in. None, the inputs' own: TE's arithmetic at
    the recipe's precision (`_apply_rotary_pos_emb_base`: cos and sin rounded to it, then each
    product and the sum rounded to it, as Megatron's unfused function does). FP32: the inputs and
    upstream gradients upcast (exactly), TE's rotation in FP32, the results rounded once to the
    inputs' dtype: the fused kernel's arithmetic, in TE's own layout and pairing code."""

    compute: torch.dtype | None = None

    @property
    def name(self) -> str:
        computed = "" if self.compute is None else f"-in-{str(self.compute).removeprefix('torch.')}"
        return f"te217-unfused-rope{computed}"

    def run(self, inputs: RopeInputs) -> ImplementationOutput:
        if inputs.q.device.type != "cpu":
            raise ImplementationUnavailable(
                "TE's unfused RoPE runs here through correctness.te_on_cpu, on CPU tensors only")
        from correctness.te_on_cpu import provenance, te_on_cpu

        shape = inputs.shape
        computed, given = self.compute or inputs.q.dtype, inputs.q.dtype
        tensor_format = "thd" if shape.qkv_format == "thd" else "sbhd"  # Megatron's BSHD is sequence first
        with te_on_cpu():
            from transformer_engine.pytorch.attention.rope import apply_rotary_pos_emb

            q, k = (x.detach().to(computed).requires_grad_() for x in (inputs.q, inputs.k))
            rotated = [apply_rotary_pos_emb(x, inputs.freqs, tensor_format=tensor_format, interleaved=shape.interleaved,
                                            fused=False, cu_seqlens=inputs.cu_seqlens) for x in (q, k)]
            torch.autograd.backward(rotated, [g.to(computed) for g in (inputs.grad_q, inputs.grad_k)])
        results = (rotated[0].detach(), rotated[1].detach(), q.grad, k.grad)
        return ImplementationOutput(
            tensors=outputs(shape, *(x.to(given) for x in results)), backend=self.name, details={
            "function": "transformer_engine.pytorch.attention.rope.apply_rotary_pos_emb (fused=False)",
            "tensor_format": tensor_format, "computed_in": str(computed), **provenance(),
        })


def _pair_angles(inputs: RopeInputs) -> torch.Tensor:
    """Each token's r / 2 pair angles from Megatron's frequencies (halves concatenated, or each
    angle repeated when interleaved); a layout that is neither is an error."""
    freqs = inputs.freqs.reshape(inputs.freqs.shape[0], -1)[inputs.freq_rows()]
    half = freqs.shape[-1] // 2
    first, second = (freqs[:, 0::2], freqs[:, 1::2]) if inputs.shape.interleaved else (freqs[:, :half], freqs[:, half:])
    if not torch.equal(first, second):
        raise ValueError("the frequencies do not repeat each pair's angle as Megatron's RotaryEmbedding lays them out")
    return first


def _reference_outputs(inputs: RopeInputs, angles: torch.Tensor) -> dict[str, torch.Tensor]:
    shape = inputs.shape
    forward = [rope_forward(x, angles, shape.interleaved) for x in (inputs.q, inputs.k)]
    backward = [rope_backward(g, angles, shape.interleaved) for g in (inputs.grad_q, inputs.grad_k)]
    return outputs(shape, *forward, *backward)


@dataclass(frozen=True)
class Fp64Rope:
    """references/rope.py on the inputs' own FP32 frequencies (taken exactly, in FP64)."""

    name: str = "fp64-rope"

    def run(self, inputs: RopeInputs) -> ImplementationOutput:
        return ImplementationOutput(
            tensors=_reference_outputs(inputs, _pair_angles(inputs).double()), backend=self.name)


@dataclass(frozen=True)
class FormulaRope:
    """references/rope.py with the angles of the formula in FP64 (positions x base^(-2i / r)), not
    Megatron's FP32 ones: an informational reference whose errors add the FP32 angles' rounding,
    the same in both paths. Only for shapes whose frequencies are the plain formula's."""

    name: str = "fp64-rope-formula-angles"

    def run(self, inputs: RopeInputs) -> ImplementationOutput:
        shape = inputs.shape
        if not shape.formula_angles:
            raise ImplementationUnavailable(
                "RoPE scaling or interpolation: Megatron's frequencies are not the plain formula's")
        positions = inputs.freq_rows() + shape.first_position
        angles = rope_angles(positions, shape.rotary_dims, shape.rotary_base)
        return ImplementationOutput(tensors=_reference_outputs(inputs, angles), backend=self.name)
