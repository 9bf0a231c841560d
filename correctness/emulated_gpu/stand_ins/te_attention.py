"""TE 2.17's cuDNN fused attention (F16_arbitrary_seqlen) on the emulated GPU:
`transformer_engine_torch.fused_attn_fwd` and `fused_attn_bwd`, called by
cpp_extensions/fused_attn.py (fused_attn_fwd 308-341, fused_attn_bwd 564-597) from FusedAttnFunc
(attention/dot_product_attention/backends.py 1501-1535, 1824-1858). The gate TE asks first is
te_attention_gate.py; the arithmetic, one sequence at a time, is cudnn_sdpa.py.

What the stand-ins take and give, as pytorch/csrc/extensions/attention.cpp (v2.17) does:
- Q, K, V separate tensors in the layout's formats (views into one buffer for the packed layouts):
  BSHD [b, s, h, d], SBHD [s, b, h, d], BHSD [b, h, s, d], THD [t, h, d]; GQA by fewer K/V heads.
- Sequences: with a padding mask, sequence i has cu_seqlens[i + 1] - cu_seqlens[i] tokens; in THD
  they start at cu_seqlens_padded[i] (cuDNN's ragged offsets), in BSHD/SBHD/BHSD at the row's start;
  without a padding mask every row is whole. THD needs a padding mask (the C++ check,
  fused_attn_f16_arbitrary_seqlen.cu 100).
- Masks: causal (top-left), causal_bottom_right, their padding forms, no_mask; the window
  (left, right) aligned top-left or bottom-right (`bottom_right_diagonal`); attn_scale.
- softmax_type off-by-one or learnable: the sink logits of SoftmaxOffset [1, h, 1, 1] (FP32).
- forward returns [O, Stats, rng_state(, SoftmaxOffset)] (attention.cpp 114-320): O in the layout's
  o_format, zero outside the sequences (TE zero-fills THD's O, 172-176; a padded BSHD row's tail is
  zero here too: what cuDNN leaves there is not modelled); Stats FP32, [b, h, sq, 1] or, for THD
  with cuDNN 9.6 and newer, [t, h, 1] at the ragged offsets (fused_attn_f16_arbitrary_seqlen.cu
  1141-1147), NaN where no sequence's token is (uninitialised memory on a GPU); rng_state int64 [2].
- backward takes those aux tensors and returns [dQ, dK, dV, dBias, dSoftmaxOffset] (attention.cpp
  323-609): dQ, dK, dV in dqkv_layout's buffers (one [.., 3, h, d] buffer for 3HD, [.., h, 3, d] for
  H3D, dK and dV sharing one for HD_2HD / HD_H2D), zero outside the sequences; dBias None (no bias);
  dSoftmaxOffset FP32 [1, h, 1, 1] with sinks, else None. `deterministic` is accepted: these sums
  run in one fixed order, so the backward is deterministic whatever it says, as cuDNN's is on sm90
  with it set.
Both re-ask the gate as the C++ does (fused_attn.cpp 614-642, 696-700) and raise its "Invalid
combination" error where it says No_Backend.

Refused (NotEmulated): FP8 attention (quantized Q/K/V, S/O/dP/dQKV quantizers), dropout in training
(cuDNN's Philox stream is its own), attention bias and ALiBi, paged KV caches, return_max_logit, and
a dQKV layout of other formats than the QKV layout's. rng_state holds the GPU generator's seed and
offset 0: with no dropout nothing is drawn, and the generator's Philox offset is not advanced.
"""

from dataclasses import dataclass

import torch

from correctness.emulated_gpu import runtime
from correctness.emulated_gpu.kernels import require_on_gpu, stand_in
from correctness.emulated_gpu.runtime import NotEmulated
from correctness.emulated_gpu.stand_ins import cudnn_sdpa
from correctness.emulated_gpu.stand_ins.te_attention_gate import (BIASES, F16, LAYOUTS, MASKS, SOFTMAX_TYPES,
                                                                  AttentionConfig, asked, enum_name, fused_backend,
                                                                  gpu_architecture, layout_formats)

TE_DTYPES = {torch.float16: 5, torch.bfloat16: 6}  # TE's DType values (transformer_engine.h 660-673)
LAYOUT_NAMES = {name: name for name in LAYOUTS}
INVALID = "Invalid combination of data type and sequence length for fused attention."


class FusedAttentionError(RuntimeError):
    """What TE's NVTE_ERROR / NVTE_CHECK raise in the fused-attention C++ code."""


@dataclass(frozen=True)
class Side:
    """Where one side's (queries', or keys' and values') sequences are in its tensors: their format,
    and per sequence its first token and its length."""

    format: str
    starts: tuple[int, ...]
    lengths: tuple[int, ...]

    def tokens(self, tensor: torch.Tensor, sequence: int) -> torch.Tensor:
        """Sequence `sequence`'s tokens of `tensor`, as a [heads, tokens, dim] view."""
        start, length = self.starts[sequence], self.lengths[sequence]
        if self.format == "thd":
            rows = tensor[start:start + length]
        elif self.format == "bshd":
            rows = tensor[sequence, start:start + length]
        elif self.format == "sbhd":
            rows = tensor[start:start + length, sequence]
        else:  # bhsd
            return tensor[sequence, :, start:start + length]
        return rows.transpose(0, 1)


def _heads_and_dim(tensor: torch.Tensor, fmt: str) -> tuple[int, int]:
    return (tensor.shape[1], tensor.shape[-1]) if fmt == "bhsd" else (tensor.shape[-2], tensor.shape[-1])


def _row_length(tensor: torch.Tensor, fmt: str) -> int:
    return {"bshd": tensor.shape[1], "sbhd": tensor.shape[0], "bhsd": tensor.shape[2]}[fmt]


def _batch(tensor: torch.Tensor, fmt: str) -> int:
    return tensor.shape[1] if fmt == "sbhd" else tensor.shape[0]


def _bounds(values: torch.Tensor) -> list[int]:
    return [int(value) for value in values.tolist()]


def _side(tensor: torch.Tensor, fmt: str, batch: int, padding: bool, cu_seqlens: torch.Tensor,
          cu_seqlens_padded: torch.Tensor | None) -> Side:
    if fmt == "thd" and not padding:
        raise FusedAttentionError("Ragged QKV input requires padding or padding_causal mask!")
    if not padding:
        return Side(fmt, (0,) * batch, (_row_length(tensor, fmt),) * batch)
    bounds = _bounds(cu_seqlens)[: batch + 1]
    lengths = tuple(end - start for start, end in zip(bounds, bounds[1:]))
    if fmt != "thd":
        return Side(fmt, (0,) * batch, lengths)
    offsets = _bounds(cu_seqlens_padded if cu_seqlens_padded is not None else cu_seqlens)[:batch]
    return Side(fmt, tuple(offsets), lengths)


@dataclass(frozen=True)
class Call:
    """What a forward or backward call asks, read once from its arguments."""

    config: AttentionConfig
    q: Side
    kv: Side
    masking: cudnn_sdpa.Masking
    batch: int

    @property
    def sequences(self) -> range:
        return range(self.batch)

    def seen(self, sequence: int, device: torch.device) -> torch.Tensor:
        """Which keys each query of sequence `sequence` sees, [tokens_q, tokens_kv] booleans."""
        return cudnn_sdpa.visibility(self.masking, self.q.lengths[sequence], self.kv.lengths[sequence], device)


def _read_call(kernel: str, *, max_seqlen_q, max_seqlen_kv, is_training, p_dropout, qkv_layout, bias_type,
               attn_mask_type, softmax_type, window_size, bottom_right_diagonal, deterministic, cu_seqlens_q,
               cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded, q, k, v, return_max_logit,
               cuda_graph) -> Call:
    if q.dtype not in TE_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise NotEmulated(f"{kernel}: Q/K/V of dtypes {q.dtype}, {k.dtype}, {v.dtype}: only BF16/FP16 fused attention"
                          " (F16_arbitrary_seqlen) is emulated, not FP8")
    layout = enum_name(qkv_layout, LAYOUT_NAMES, "layout")
    _, q_format, kv_format, group = layout_formats(layout)
    bias, mask = enum_name(bias_type, BIASES, "bias type"), enum_name(attn_mask_type, MASKS, "mask type")
    if group == "Paged_KV":
        raise NotEmulated(f"{kernel}: paged KV caches ({layout}) are not emulated")
    if bias != "no_bias":
        raise NotEmulated(f"{kernel}: attention bias {bias} is not emulated")
    if is_training and float(p_dropout) != 0.0:
        raise NotEmulated(f"{kernel}: dropout {float(p_dropout)} in training is not emulated (cuDNN's Philox stream)")
    if return_max_logit:
        raise NotEmulated(f"{kernel}: return_max_logit is not emulated")
    heads, dim_qk = _heads_and_dim(q, q_format)
    groups, _ = _heads_and_dim(k, kv_format)
    _, dim_v = _heads_and_dim(v, kv_format)
    if q_format == "thd":
        batch = cu_seqlens_q.shape[0] - 1
    elif kv_format == "thd":
        batch = cu_seqlens_kv.shape[0] - 1
    else:
        batch = _batch(q, q_format)
    left, right = (int(size) for size in window_size)
    config = asked(is_training, TE_DTYPES[q.dtype], TE_DTYPES[k.dtype], qkv_layout, bias_type, attn_mask_type,
                   softmax_type, p_dropout, heads, groups, max_seqlen_q, max_seqlen_kv, dim_qk, dim_v, left, right,
                   return_max_logit, cuda_graph, deterministic)
    if fused_backend(config, gpu_architecture(), runtime.CUDNN_VERSION) != F16:
        raise FusedAttentionError(INVALID)
    padding = "padding" in mask
    return Call(
        config=config,
        q=_side(q, q_format, batch, padding, cu_seqlens_q, cu_seqlens_q_padded),
        kv=_side(k, kv_format, batch, padding, cu_seqlens_kv, cu_seqlens_kv_padded),
        masking=cudnn_sdpa.Masking(causal=mask in ("causal", "padding_causal"),
                                   causal_bottom_right=mask in ("causal_bottom_right", "padding_causal_bottom_right"),
                                   window=(left, right), diagonal_bottom_right=bool(bottom_right_diagonal)),
        batch=batch,
    )


def _refuse_fp8(kernel: str, **quantizers) -> None:
    """FP8 attention is not emulated: raises where any of the named quantizers is given."""
    if any(quantizer is not None for quantizer in quantizers.values()):
        raise NotEmulated(f"{kernel}: FP8 attention ({'/'.join(quantizers)} quantizers) is not emulated")


def _sinks(kernel: str, softmax_type, softmax_offset: torch.Tensor | None, heads: int) -> torch.Tensor | None:
    """The sink logits [heads] (FP32) where softmax_type has them, None for vanilla softmax."""
    if enum_name(softmax_type, SOFTMAX_TYPES, "softmax type") == "vanilla":
        return None
    if softmax_offset is None:
        raise FusedAttentionError(f"{kernel}: softmax_type with sinks needs SoftmaxOffset [1, h, 1, 1]")
    return softmax_offset.reshape(heads).float()


def _stats_buffer(call: Call, q: torch.Tensor, heads: int, max_seqlen_q: int) -> torch.Tensor:
    """Stats as the forward allocates it: [t, h, 1] for THD queries (cuDNN >= 9.6), else [b, h, sq, 1];
    uninitialised memory there (attention.cpp 278-282), NaN here where no sequence's token writes it."""
    if call.q.format == "thd" and runtime.CUDNN_VERSION >= 90600:
        shape = (q.shape[0], heads, 1)
    else:
        shape = (call.batch, heads, int(max_seqlen_q), 1)
    return torch.full(shape, float("nan"), dtype=torch.float32, device=q.device)


def _stats_rows(call: Call, stats: torch.Tensor, sequence: int) -> torch.Tensor:
    """Sequence `sequence`'s Stats, a [heads, tokens] view of the buffer."""
    start, length = call.q.starts[sequence], call.q.lengths[sequence]
    if stats.dim() == 3:
        return stats[start:start + length, :, 0].transpose(0, 1)
    return stats[sequence, :, :length, 0]


def _rng_state(device: torch.device, generator) -> torch.Tensor:
    """[seed, offset] as int64 (philox_unpack writes the 64-bit seed's bits: a seed of 2^63 or more reads
    negative)."""
    chosen = generator if generator is not None else runtime.generator(device)
    seed = chosen.initial_seed()
    return torch.tensor([seed - 2**64 if seed >= 2**63 else seed, 0], dtype=torch.int64, device=device)


@stand_in(name="transformer_engine_torch.fused_attn_fwd",
          stands_for="TE's cuDNN fused attention forward, F16_arbitrary_seqlen (nvte_fused_attn_fwd)",
          computes="per sequence, S = scale QK^T in FP32 with the mask and window, FP32 softmax with its statistics"
                   " (max + log sum), O = P V accumulated in FP32 (P as BF16 operand), rounded once to BF16;"
                   " returns O, the FP32 Stats and rng_state. One sequence at a time: rows packed in THD give the"
                   " bits of the same rows run alone (packed and per-row agree by construction here)")
def fused_attn_fwd(max_seqlen_q, max_seqlen_kv, is_training, attn_scale, p_dropout, set_zero, qkv_layout, o_format,
                   qkv_scale_inv_format, bias_type, attn_mask_type, softmax_type, window_size, bottom_right_diagonal,
                   cu_seqlens_q, cu_seqlens_kv, Q, K, V, fake_dtype, cu_seqlens_q_padded, cu_seqlens_kv_padded,
                   page_table_k, page_table_v, s_quantizer, o_quantizer, Bias, SoftmaxOffset, rng_gen,
                   rng_elts_per_thread, return_max_logit, cuda_graph):
    kernel = "fused_attn_fwd"
    require_on_gpu(kernel, Q=Q, K=K, V=V, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
                   cu_seqlens_q_padded=cu_seqlens_q_padded, cu_seqlens_kv_padded=cu_seqlens_kv_padded,
                   SoftmaxOffset=SoftmaxOffset)
    _refuse_fp8(kernel, S=s_quantizer, O=o_quantizer)
    if page_table_k is not None or page_table_v is not None:
        raise NotEmulated(f"{kernel}: paged KV caches are not emulated")
    call = _read_call(kernel, max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv, is_training=is_training,
                      p_dropout=p_dropout, qkv_layout=qkv_layout, bias_type=bias_type, attn_mask_type=attn_mask_type,
                      softmax_type=softmax_type, window_size=window_size, bottom_right_diagonal=bottom_right_diagonal,
                      deterministic=False, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
                      cu_seqlens_q_padded=cu_seqlens_q_padded, cu_seqlens_kv_padded=cu_seqlens_kv_padded, q=Q, k=K,
                      v=V, return_max_logit=return_max_logit, cuda_graph=cuda_graph)
    out_format = _format_name(o_format)
    if out_format != call.q.format:
        raise NotEmulated(f"{kernel}: an O format ({out_format}) other than Q's ({call.q.format}) is not emulated")
    heads = call.config.heads
    out = torch.zeros((*Q.shape[:-1], call.config.head_dim_v), dtype=fake_dtype, device=Q.device)
    stats = _stats_buffer(call, Q, heads, max_seqlen_q)
    sinks = _sinks(kernel, softmax_type, SoftmaxOffset, heads)
    for sequence in call.sequences:
        rows, row_stats = cudnn_sdpa.forward(call.q.tokens(Q, sequence), call.kv.tokens(K, sequence),
                                             call.kv.tokens(V, sequence), call.seen(sequence, Q.device),
                                             float(attn_scale), sinks)
        call.q.tokens(out, sequence).copy_(rows)
        _stats_rows(call, stats, sequence).copy_(row_stats)
    aux = [stats, _rng_state(Q.device, rng_gen)]
    if sinks is not None:
        aux.append(SoftmaxOffset)
    return [out, *aux]


def _format_name(value) -> str:
    name = getattr(value, "name", "")
    return name.removeprefix("NVTE_").lower()


def _gradient_buffers(layout: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV as attention.cpp 386-458 allocates them for the layout's group (zeros here)."""
    group = layout_formats(layout)[3]

    def zeros(shape) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=q.device)

    if group == "3HD":
        packed = zeros((*q.shape[:-2], 3, *q.shape[-2:]))
        return packed.select(-3, 0), packed.select(-3, 1), packed.select(-3, 2)
    if group == "H3D":
        packed = zeros((*q.shape[:-1], 3, q.shape[-1]))
        return packed.select(-2, 0), packed.select(-2, 1), packed.select(-2, 2)
    if group == "HD_2HD":
        packed = zeros((*k.shape[:-2], 2, *k.shape[-2:]))
        return zeros(q.shape), packed.select(-3, 0), packed.select(-3, 1)
    if group == "HD_H2D":
        packed = zeros((*k.shape[:-1], 2, k.shape[-1]))
        return zeros(q.shape), packed.select(-2, 0), packed.select(-2, 1)
    return zeros(q.shape), zeros(k.shape), zeros(v.shape)


@stand_in(name="transformer_engine_torch.fused_attn_bwd",
          stands_for="TE's cuDNN fused attention backward, F16_arbitrary_seqlen (nvte_fused_attn_bwd)",
          computes="per sequence, P recomputed from the forward's saved FP32 Stats, D = rowsum(dO O), dV = P^T dO,"
                   " dS = P (dO V^T - D), dQ = scale dS K, dK = scale dS^T Q, FP32 accumulation (P and dS as BF16"
                   " operands), grouped heads summed in FP32, each rounded once to BF16. The same fixed-order sums"
                   " with or without `deterministic` (deterministic mode's candidate and default agree by"
                   " construction here)")
def fused_attn_bwd(max_seqlen_q, max_seqlen_kv, attn_scale, p_dropout, set_zero, qkv_layout, o_format, do_format,
                   dqkv_layout, qkv_scale_inv_format, do_scale_inv_format, bias_type, attn_mask_type, softmax_type,
                   window_size, bottom_right_diagonal, deterministic, cu_seqlens_q, cu_seqlens_kv, Q, K, V, O, dO,
                   fake_dtype, Aux_CTX_Tensors, cu_seqlens_q_padded, cu_seqlens_kv_padded, s_quantizer, dp_quantizer,
                   dqkv_quantizer, cuda_graph):
    kernel = "fused_attn_bwd"
    aux = list(Aux_CTX_Tensors)
    require_on_gpu(kernel, Q=Q, K=K, V=V, O=O, dO=dO, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
                   cu_seqlens_q_padded=cu_seqlens_q_padded, cu_seqlens_kv_padded=cu_seqlens_kv_padded,
                   **{f"Aux_CTX_Tensors[{index}]": tensor for index, tensor in enumerate(aux)})
    _refuse_fp8(kernel, S=s_quantizer, dP=dp_quantizer, dQKV=dqkv_quantizer)
    call = _read_call(kernel, max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv, is_training=True,
                      p_dropout=p_dropout, qkv_layout=qkv_layout, bias_type=bias_type, attn_mask_type=attn_mask_type,
                      softmax_type=softmax_type, window_size=window_size, bottom_right_diagonal=bottom_right_diagonal,
                      deterministic=deterministic, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
                      cu_seqlens_q_padded=cu_seqlens_q_padded, cu_seqlens_kv_padded=cu_seqlens_kv_padded, q=Q, k=K,
                      v=V, return_max_logit=False, cuda_graph=cuda_graph)
    layout = enum_name(qkv_layout, LAYOUT_NAMES, "layout")
    gradient_layout = enum_name(dqkv_layout, LAYOUT_NAMES, "dqkv layout")
    if layout_formats(gradient_layout)[1:3] != layout_formats(layout)[1:3]:
        raise NotEmulated(f"{kernel}: dQKV layout {gradient_layout} in other formats than {layout} is not emulated")
    for name, fmt in (("O", o_format), ("dO", do_format)):
        if _format_name(fmt) != call.q.format:
            raise NotEmulated(f"{kernel}: {name} in format {_format_name(fmt)}, not Q's ({call.q.format}), is not"
                              " emulated")
    if len(aux) < 2:
        raise FusedAttentionError(f"{kernel}: Unexpected Aux_CTX_Tensors size {len(aux)} (Stats, rng_state expected)")
    stats = aux[0]
    heads = call.config.heads
    sinks = _sinks(kernel, softmax_type, aux[2] if len(aux) > 2 else None, heads)
    dq, dk, dv = _gradient_buffers(gradient_layout, Q, K, V, fake_dtype)
    dsink = torch.zeros(heads, dtype=torch.float32, device=Q.device) if sinks is not None else None
    for sequence in call.sequences:
        grads = cudnn_sdpa.backward(call.q.tokens(Q, sequence), call.kv.tokens(K, sequence),
                                    call.kv.tokens(V, sequence), call.q.tokens(O, sequence),
                                    call.q.tokens(dO, sequence), _stats_rows(call, stats, sequence),
                                    call.seen(sequence, Q.device), float(attn_scale), sinks)
        call.q.tokens(dq, sequence).copy_(grads[0])
        call.kv.tokens(dk, sequence).copy_(grads[1])
        call.kv.tokens(dv, sequence).copy_(grads[2])
        if dsink is not None:
            dsink += grads[3]
    return [dq, dk, dv, None, dsink.reshape(1, heads, 1, 1) if dsink is not None else None]
