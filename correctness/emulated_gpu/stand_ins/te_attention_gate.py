"""TE 2.17's fused-attention gate on the emulated GPU: `transformer_engine_torch.get_fused_attn_backend`,
which TE's backend selection asks (attention/dot_product_attention/utils.py 1366-1386) and which
stands for nvte_get_fused_attn_backend (common/fused_attn/fused_attn.cpp 229-530 at v2.17): which
configurations cuDNN's fused attention takes, as F16_arbitrary_seqlen (BF16/FP16) or FP8, and which
get No_Backend, for the emulated GPU's architecture (sm90) and the cuDNN version the emulation
reports (correctness.emulated_gpu.runtime.CUDNN_VERSION, 9.10.2).

The gate is the C++ condition clause by clause, for cuDNN 9.5 and newer (older cuDNN needs the 32-bit
ragged-offset check, fused_attn.cpp 245-251, which is not modelled: NotEmulated). What it gives at
sm90 with cuDNN 9.10.2, for BF16 in training:
- head dims: multiples of 8, at most 256 for both Q/K and V (308-330: "9.5: <= 256 + Hopper +
  bprop"); any head dim only without training (9.10.2, 318-325). Gemma's d512 global layers get
  No_Backend in training, its d256 sliding layers pass.
- masks and formats (349-411): BSHD/SBHD with no_mask, causal, padding, padding_causal and the
  bottom-right variants (sq <= skv); THD only with a padding mask, and with GQA from cuDNN 9.6.
- windows (412-447): (left, 0) with causal, no_mask or bottom-right causal at equal lengths on
  BSHD/SBHD (9.2's clause); any (left, right) with no_mask, the padding masks or bottom-right
  causal (9.6's clause: THD's padding_causal window), no bias, no dropout, sq <= skv.
- softmax_type: vanilla only before cuDNN 9.13.1 (452-457): sinks (off-by-one, learnable) get
  No_Backend at 9.10.2; return_max_logit only from 9.21 (458-461).
- determinism: no condition on sm90 (462-469 concern Blackwell); TE's Python keeps
  F16_arbitrary_seqlen in deterministic mode on sm90 (utils.py 1430-1463) and passes
  `deterministic` on to the backward.
"""

from dataclasses import dataclass

from correctness.emulated_gpu import runtime
from correctness.emulated_gpu.kernels import stand_in
from correctness.emulated_gpu.runtime import NotEmulated

F16 = "F16_arbitrary_seqlen"
FP8 = "FP8"
NONE = "No_Backend"

# NVTE_QKV_Layout -> (its NVTE_QKV_Format, its layout group): fused_attn.cpp 100-182.
LAYOUTS = {
    "NVTE_SB3HD": ("sbhd", "3HD"), "NVTE_SBH3D": ("sbhd", "H3D"), "NVTE_SBHD_SB2HD": ("sbhd", "HD_2HD"),
    "NVTE_SBHD_SBH2D": ("sbhd", "HD_H2D"), "NVTE_SBHD_SBHD_SBHD": ("sbhd", "HD_HD_HD"),
    "NVTE_BS3HD": ("bshd", "3HD"), "NVTE_BSH3D": ("bshd", "H3D"), "NVTE_BSHD_BS2HD": ("bshd", "HD_2HD"),
    "NVTE_BSHD_BSH2D": ("bshd", "HD_H2D"), "NVTE_BSHD_BSHD_BSHD": ("bshd", "HD_HD_HD"),
    "NVTE_T3HD": ("thd", "3HD"), "NVTE_TH3D": ("thd", "H3D"), "NVTE_THD_T2HD": ("thd", "HD_2HD"),
    "NVTE_THD_TH2D": ("thd", "HD_H2D"), "NVTE_THD_THD_THD": ("thd", "HD_HD_HD"),
    "NVTE_SBHD_BSHD_BSHD": ("sbhd_2bshd", "HD_HD_HD"), "NVTE_BSHD_SBHD_SBHD": ("bshd_2sbhd", "HD_HD_HD"),
    "NVTE_THD_BSHD_BSHD": ("thd_2bshd", "HD_HD_HD"), "NVTE_THD_SBHD_SBHD": ("thd_2sbhd", "HD_HD_HD"),
    "NVTE_Paged_KV_BSHD_BSHD_BSHD": ("bshd", "Paged_KV"), "NVTE_Paged_KV_BSHD_SBHD_SBHD": ("bshd_2sbhd", "Paged_KV"),
    "NVTE_Paged_KV_SBHD_BSHD_BSHD": ("sbhd_2bshd", "Paged_KV"), "NVTE_Paged_KV_SBHD_SBHD_SBHD": ("sbhd", "Paged_KV"),
    "NVTE_Paged_KV_THD_BSHD_BSHD": ("thd_2bshd", "Paged_KV"), "NVTE_Paged_KV_THD_SBHD_SBHD": ("thd_2sbhd", "Paged_KV"),
    "NVTE_BHSD_BHSD_BHSD": ("bhsd", "SD_SD_SD"),
}
MASKS = {"NVTE_NO_MASK": "no_mask", "NVTE_PADDING_MASK": "padding", "NVTE_CAUSAL_MASK": "causal",
         "NVTE_PADDING_CAUSAL_MASK": "padding_causal", "NVTE_CAUSAL_BOTTOM_RIGHT_MASK": "causal_bottom_right",
         "NVTE_PADDING_CAUSAL_BOTTOM_RIGHT_MASK": "padding_causal_bottom_right"}
BIASES = {"NVTE_NO_BIAS": "no_bias", "NVTE_PRE_SCALE_BIAS": "pre_scale_bias",
          "NVTE_POST_SCALE_BIAS": "post_scale_bias", "NVTE_ALIBI": "alibi"}
SOFTMAX_TYPES = {"NVTE_VANILLA_SOFTMAX": "vanilla", "NVTE_OFF_BY_ONE_SOFTMAX": "off-by-one",
                 "NVTE_LEARNABLE_SOFTMAX": "learnable"}
DTYPES = {4: "float32", 5: "float16", 6: "bfloat16", 7: "float8_e4m3", 8: "float8_e5m2"}  # TE's DType values
PADDING_MASKS = ("padding", "padding_causal", "padding_causal_bottom_right")
ROW_FORMATS = ("sbhd", "bshd")


def enum_name(value, table: dict[str, str], what: str) -> str:
    """The plain name of one of TE's NVTE_* enum members (an IntEnum of correctness.te_on_cpu)."""
    name = getattr(value, "name", None)
    if name not in table:
        raise NotEmulated(f"fused attention: {what} {value!r} is not one the emulation knows")
    return table[name]


def layout_formats(layout: str) -> tuple[str, str, str, str]:
    """(qkv format, q format, kv format, layout group) of an NVTE_QKV_Layout name (fused_attn.cpp 140-227)."""
    qkv_format, group = LAYOUTS[layout]
    q_format, _, kv_format = qkv_format.partition("_2")
    return qkv_format, q_format, kv_format or q_format, group


@dataclass(frozen=True, kw_only=True)
class AttentionConfig:
    """What nvte_get_fused_attn_backend is asked about, as plain values."""

    is_training: bool
    dtype: str  # DTYPES' names, the same for Q and KV (the gate checks it)
    layout: str  # an NVTE_QKV_Layout name
    bias: str
    mask: str
    softmax: str
    dropout: float
    heads: int
    groups: int
    max_seqlen_q: int
    max_seqlen_kv: int
    head_dim_qk: int
    head_dim_v: int
    window: tuple[int, int]
    return_max_logit: bool
    cuda_graph: bool
    deterministic: bool


def fused_backend(c: AttentionConfig, sm: int, cudnn: int) -> str:
    """F16, FP8 or NONE, as nvte_get_fused_attn_backend answers on an `sm` GPU with cuDNN `cudnn`
    (9.10.2 is 91002)."""
    if cudnn < 90500:
        raise NotEmulated(f"the fused-attention gate models cuDNN 9.5 and newer, not {cudnn}")
    if c.dtype in ("float8_e4m3", "float8_e5m2"):
        return FP8 if _fp8_supported(c, sm, cudnn) else NONE
    if c.dtype not in ("float16", "bfloat16"):
        return NONE
    if not _f16_supported(c, sm, cudnn):
        return NONE
    return NONE if _refused_after(c, sm, cudnn) else F16


def _fp8_supported(c: AttentionConfig, sm: int, cudnn: int) -> bool:
    """fused_attn.cpp 255-293."""
    fmt = layout_formats(c.layout)[0]
    sq, skv, dqk, dv, tr, mask = c.max_seqlen_q, c.max_seqlen_kv, c.head_dim_qk, c.head_dim_v, c.is_training, c.mask
    shapes = (
        (cudnn >= 90201 and sm < 100 and sq % 128 == 0 and skv % 128 == 0 and dqk == 128 and dv == 128
         and mask in ("causal", "no_mask"))
        or (cudnn >= 90700
            and ((sm < 100 and not tr and dqk <= 256 and dv <= 256) or (sm < 100 and tr and dqk == 128 and dv == 128)
                 or (sm >= 100 and dqk <= 128 and dv <= 128))
            and dqk % 16 == 0 and dv % 16 == 0 and mask in ("no_mask", "causal", "padding", "padding_causal"))
        or (cudnn >= 92100 and sm >= 100 and dqk <= 192 and dv <= 128 and dqk % 16 == 0 and dv % 16 == 0
            and mask in ("no_mask", "causal", "causal_bottom_right")))
    formats = ((cudnn < 92100 and fmt in ROW_FORMATS and c.softmax == "vanilla")
               or (cudnn >= 92100 and fmt in (*ROW_FORMATS, "bhsd")))
    return (sm >= 90 and c.bias == "no_bias" and shapes and formats and cudnn != 91000 and not c.return_max_logit)


def _f16_supported(c: AttentionConfig, sm: int, cudnn: int) -> bool:
    """fused_attn.cpp 294-472, for cuDNN 9.5 and newer."""
    fmt, q_fmt, kv_fmt, group = layout_formats(c.layout)
    paged = group == "Paged_KV"
    sq, skv, dqk, dv, tr, mask = c.max_seqlen_q, c.max_seqlen_kv, c.head_dim_qk, c.head_dim_v, c.is_training, c.mask
    no_bias, no_dropout = c.bias == "no_bias", c.dropout == 0.0
    left, right = c.window
    architecture = (80 <= sm < 100) or (cudnn >= 90700 and sm >= 100)
    head_dim = (
        dqk % 8 == 0 and dv % 8 == 0
        and ((dqk <= 128 and dv <= 128)
             or (dqk <= 256 and dv <= 256 and sm == 90 and (cudnn >= 90100 if not tr else cudnn >= 90500))
             or (not tr and sm >= 100 and cudnn >= 90900 and sq > 1 and not paged)
             or (not tr and cudnn >= 91002
                 and (paged or sq > 1 or (sq == 1 and mask not in ("causal", "padding_causal"))))
             or (dqk == 192 and dv == 128 and tr and sm >= 100 and cudnn >= 91100))
        # 9.11+ bug: 128 <= d_qk != d_v <= 256 on Hopper in training (MLA), 331-335
        and not (cudnn >= 91100 and tr and sm == 90 and dqk >= 128 and dv >= 128 and not (dqk == 192 and dv == 128)
                 and dqk != dv))
    bias = (no_bias
            or (c.bias == "alibi" and mask not in ("no_mask", *PADDING_MASKS) and sm >= 90)
            or (c.bias == "post_scale_bias" and sm >= 80))
    bottom_right_lengths = sq % 64 == 0 and skv % 64 == 0 and sq <= skv
    masks = (
        (fmt in ROW_FORMATS and mask in ("causal", "padding", "padding_causal", "no_mask"))
        or (fmt == "thd" and mask in ("padding", "padding_causal"))
        or (fmt in ROW_FORMATS and mask == "causal_bottom_right" and bottom_right_lengths and no_bias and no_dropout)
        or (paged and (mask in ("padding", "padding_causal")
                       or (mask == "padding_causal_bottom_right" and bottom_right_lengths)) and no_bias and no_dropout)
        or (cudnn >= 90600 and mask == "padding_causal_bottom_right" and bottom_right_lengths and no_bias
            and no_dropout)
        or (cudnn >= 90700 and (mask in ("no_mask", "causal")
                                or (mask in PADDING_MASKS and no_bias and no_dropout)
                                or (mask in ("causal_bottom_right", "padding_causal_bottom_right") and sq <= skv))))
    bias_with_mask = not (mask in ("padding", "padding_causal") and c.bias == "post_scale_bias")
    row_or_heads = (*ROW_FORMATS, "bhsd")
    formats = (fmt in row_or_heads
               or (fmt == "thd" and sm >= 90 and (c.heads == c.groups or cudnn >= 90600))
               or ((q_fmt in row_or_heads or (q_fmt == "thd" and sm >= 90) or kv_fmt in row_or_heads
                    or (kv_fmt == "thd" and sm >= 90)) and cudnn >= 90700))
    blackwell_bottom_right = sm < 100 or (sq == skv and cudnn <= 90700) or cudnn > 90700
    window = (
        ((left == -1 and right == -1 and mask == "no_mask")
         or (left >= -1 and right == 0
             and (mask in ("no_mask", "causal") or (mask == "causal_bottom_right" and sq == skv))
             and sq <= skv and no_dropout and no_bias and fmt in ROW_FORMATS))
        or (cudnn >= 90600
            and ((left == -1 and right in (-1, 0))
                 or (left >= -1 and right >= -1
                     and ((mask == "causal_bottom_right" and blackwell_bottom_right)
                          or mask in ("no_mask", "padding", "padding_causal")
                          or (mask == "padding_causal_bottom_right" and blackwell_bottom_right))
                     and sq <= skv and no_bias and no_dropout))))
    softmax = cudnn >= 91301 or c.softmax == "vanilla"
    max_logit = not c.return_max_logit or cudnn >= 92100
    determinism = (sm < 100 or not tr or (not c.deterministic and (no_dropout or no_bias))
                   or (c.deterministic and cudnn >= 91801 and no_dropout and no_bias))
    return (architecture and head_dim and bias and masks and bias_with_mask and formats and window
            and cudnn not in (91000, 91001) and softmax and max_logit and determinism)


def _refused_after(c: AttentionConfig, sm: int, cudnn: int) -> bool:
    """The refusals after the F16 clause (fused_attn.cpp 477-527)."""
    fmt = layout_formats(c.layout)[0]
    if cudnn == 91400 and c.max_seqlen_kv > 1024 and c.window[0] != -1 \
            and c.mask not in ("causal", "causal_bottom_right"):
        return True
    if cudnn <= 91500 and c.is_training and fmt in ROW_FORMATS and c.max_seqlen_kv % 128 != 0 and c.cuda_graph \
            and c.mask not in PADDING_MASKS:
        return True
    if sm == 120:
        return (cudnn < 91801 or (c.deterministic and c.is_training)
                or c.layout in ("NVTE_T3HD", "NVTE_TH3D"))
    return False


def gpu_architecture() -> int:
    """The emulated GPU's sm number (90 for H100 and H200)."""
    major, minor = runtime.emulated().model.capability
    return major * 10 + minor


def asked(is_training, q_dtype, kv_dtype, qkv_layout, bias_type, attn_mask_type, softmax_type, p_dropout,
          num_attn_heads, num_gqa_groups, max_seqlen_q, max_seqlen_kv, head_dim_qk, head_dim_v, window_size_left,
          window_size_right, return_max_logit, cuda_graph, deterministic) -> AttentionConfig:
    """The gate's arguments (pytorch/csrc/extensions/attention.cpp 42-54) as plain values."""
    if int(q_dtype) != int(kv_dtype):
        raise RuntimeError("Q and KV must have the same data type.")  # fused_attn.cpp 238 (NVTE_CHECK)
    if int(q_dtype) not in DTYPES:
        raise NotEmulated(f"fused attention: Q dtype {q_dtype!r} is not one the emulation knows")
    return AttentionConfig(
        is_training=bool(is_training), dtype=DTYPES[int(q_dtype)],
        layout=enum_name(qkv_layout, {name: name for name in LAYOUTS}, "layout"),
        bias=enum_name(bias_type, BIASES, "bias type"), mask=enum_name(attn_mask_type, MASKS, "mask type"),
        softmax=enum_name(softmax_type, SOFTMAX_TYPES, "softmax type"), dropout=float(p_dropout),
        heads=int(num_attn_heads), groups=int(num_gqa_groups), max_seqlen_q=int(max_seqlen_q),
        max_seqlen_kv=int(max_seqlen_kv), head_dim_qk=int(head_dim_qk), head_dim_v=int(head_dim_v),
        window=(int(window_size_left), int(window_size_right)), return_max_logit=bool(return_max_logit),
        cuda_graph=bool(cuda_graph), deterministic=bool(deterministic))


def backend_enum(name: str):
    """TE's NVTE_Fused_Attn_Backend member of that name (the extension's own enum, so TE's
    comparisons and `.name` work)."""
    import sys

    return getattr(sys.modules["transformer_engine_torch"].NVTE_Fused_Attn_Backend, f"NVTE_{name}")


@stand_in(name="transformer_engine_torch.get_fused_attn_backend",
          stands_for="TE's fused-attention gate (nvte_get_fused_attn_backend, fused_attn.cpp 229-530)",
          computes="the C++ gate's conditions for the emulated sm90 GPU and cuDNN 9.10.2: F16_arbitrary_seqlen,"
                   " FP8 or No_Backend")
def get_fused_attn_backend(*arguments):
    return backend_enum(fused_backend(asked(*arguments), gpu_architecture(), runtime.CUDNN_VERSION))
