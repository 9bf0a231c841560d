"""A tiny attention shape the unit tests share: small enough for exact and brute-force checks,
with GQA, a window and a scale that is neither 1 nor 1/sqrt(d)."""

from correctness.attention.shapes import AttentionShape


def tiny_shape(**changes) -> AttentionShape:
    fields = dict(
        model="toy", layer_kind="sliding", scale="test", tp_size=1, tp_rank=0, batch=2, seq_len=13,
        heads=4, groups=2, head_dim=8, window=(3, 0), causal=True, softmax_scale=0.7, dtype="fp32",
        qkv_format="bshd",
    )
    return AttentionShape(**{**fields, **changes})
