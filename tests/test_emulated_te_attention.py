"""The emulated GPU's stand-ins for TE 2.17's cuDNN fused attention (correctness/emulated_gpu/stand_ins/
te_attention_gate.py, te_attention.py, cudnn_sdpa.py) and its fused softmax kernels (te_softmax.py):
the gate's answers at sm90 with cuDNN 9.10.2 and where other versions answer otherwise; the
arithmetic in FP32 against the FP64 reference (every mask, window, GQA and sinks, the saved
statistics feeding the backward); the stand-ins reached through TE's own DotProductAttention in BF16
(BSHD, SBHD, THD with padding between sequences, packed QKV layouts, deterministic mode), never less
accurate than TE's unfused path; what TE refuses; and the TE path's own placement of q, k and v."""

from dataclasses import replace

import pytest
import torch

from attention_shapes import tiny_shape
from numerics import FP32_AGREEMENT, relative_l2_error
from correctness.attention.inputs import AttentionInputs, synthetic_inputs
from correctness.attention.reference import Fp64Reference
from correctness.attention.te import TransformerEngine
from correctness.attention.thd_packing_lever import PerRow
from correctness.emulated_gpu.gpus import parse_emulated
from correctness.emulated_gpu.kernels import NotOnGpu, stand_ins_called
from correctness.emulated_gpu.session import emulated_gpu
from correctness.emulated_gpu.stand_ins import cudnn_sdpa
from correctness.emulated_gpu.stand_ins.te_attention_gate import F16, FP8, NONE, AttentionConfig, fused_backend
from correctness.errors import ImplementationUnavailable
from references.attention import attention as fp64_attention

pytestmark = pytest.mark.te_cpu

HOPPER, CUDNN = 90, 91002  # the emulation's sm90 and cuDNN 9.10.2
CUDA = torch.device("cuda")


@pytest.fixture
def gpu():
    with emulated_gpu(parse_emulated("H100x1")) as emulation:
        _forget_tes_cached_gpu_tensors()
        yield emulation


def _forget_tes_cached_gpu_tensors() -> None:
    """TE keeps cu_seqlens it made on the GPU in a module-level cache (utils.py 1950-1978); an earlier
    test's emulation placed them, and its end forgot every placement, so they would read as CPU
    tensors here. A real process keeps its GPU tensors; each test here starts a fresh emulation."""
    from transformer_engine.pytorch.attention.dot_product_attention import utils

    utils._cu_seqlens_cache.clear()


# --- the gate ----------------------------------------------------------------------------------

def _asked(**changes) -> AttentionConfig:
    """Gemma's sliding layer in training: BF16, BSHD, causal, window (1023, 0), GQA, d256."""
    fields = dict(is_training=True, dtype="bfloat16", layout="NVTE_BSHD_BSHD_BSHD", bias="no_bias", mask="causal",
                  softmax="vanilla", dropout=0.0, heads=16, groups=8, max_seqlen_q=8192, max_seqlen_kv=8192,
                  head_dim_qk=256, head_dim_v=256, window=(1023, 0), return_max_logit=False, cuda_graph=False,
                  deterministic=False)
    return AttentionConfig(**{**fields, **changes})


GATE = {  # name: (changes, cuDNN version, the gate's answer at sm90)
    "gemma sliding d256 window": ({}, CUDNN, F16),
    "gemma global d512 in training": (dict(head_dim_qk=512, head_dim_v=512, window=(-1, 0)), CUDNN, NONE),
    "d512 without training": (dict(head_dim_qk=512, head_dim_v=512, window=(-1, 0), is_training=False), CUDNN, F16),
    "nemotron thd padding_causal gqa": (dict(layout="NVTE_THD_THD_THD", mask="padding_causal", head_dim_qk=128,
                                             head_dim_v=128, window=(-1, 0), groups=2), CUDNN, F16),
    "thd window padding_causal": (dict(layout="NVTE_THD_THD_THD", mask="padding_causal"), CUDNN, F16),
    "bottom-right causal with more queries than keys": (dict(mask="causal_bottom_right", window=(-1, 0),
                                                             max_seqlen_kv=4096), CUDNN, NONE),
    "post-scale bias with a padding mask": (dict(bias="post_scale_bias", mask="padding", window=(-1, -1)), CUDNN,
                                            NONE),
    "deterministic on hopper": (dict(deterministic=True), CUDNN, F16),
    "sinks before cudnn 9.13.1": (dict(softmax="learnable"), CUDNN, NONE),
    "sinks from cudnn 9.13.1": (dict(softmax="learnable"), 91301, F16),
    "max logit before 9.21": (dict(return_max_logit=True), CUDNN, NONE),
    "cudnn 9.10.0's known bug": ({}, 91000, NONE),
    "head dims 256 and 128 at 9.10.2": (dict(head_dim_qk=256, head_dim_v=128, window=(-1, 0)), CUDNN, F16),
    "head dims 256 and 128 at 9.11 (its MLA bug)": (dict(head_dim_qk=256, head_dim_v=128, window=(-1, 0)), 91100,
                                                    NONE),
    "head dims 192 and 128 at 9.11": (dict(head_dim_qk=192, head_dim_v=128, window=(-1, 0)), 91100, F16),
    "head dim not a multiple of 8": (dict(head_dim_qk=100, head_dim_v=100), CUDNN, NONE),
    "a window right of the diagonal under causal": (dict(window=(16, 4)), CUDNN, NONE),
    "dropout with a window": (dict(dropout=0.1), CUDNN, NONE),
    "fp32": (dict(dtype="float32"), CUDNN, NONE),
    "fp8 d128 causal": (dict(dtype="float8_e4m3", head_dim_qk=128, head_dim_v=128, window=(-1, 0)), CUDNN, FP8),
    "fp8 d256 in training": (dict(dtype="float8_e4m3", window=(-1, 0)), CUDNN, NONE),
}


@pytest.mark.parametrize("name", sorted(GATE))
def test_the_gate_answers_as_fused_attn_cpp(name):
    changes, cudnn, expected = GATE[name]
    assert fused_backend(_asked(**changes), HOPPER, cudnn) == expected


def test_the_gate_is_asked_by_tes_selection_and_refuses_d512_training(gpu):
    shape = tiny_shape(dtype="bf16", head_dim=512, window=None, seq_len=16)
    inputs = synthetic_inputs(shape, seed=0, device=CUDA, variant="model-like")
    with pytest.raises(ImplementationUnavailable, match="No dot product attention backend"):
        TransformerEngine("fused").run(inputs)
    assert TransformerEngine("auto").run(inputs).details["ran"] == "unfused"
    assert stand_ins_called()["transformer_engine_torch.get_fused_attn_backend"]["calls"] >= 2


# --- the arithmetic, in FP32 ---------------------------------------------------------------------

ARITHMETIC = {
    "window gqa": tiny_shape(),
    "global": tiny_shape(window=None),
    "no mask": tiny_shape(window=None, causal=False),
    "sinks": tiny_shape(sinks=True),
    "mha": tiny_shape(groups=4),
}


@pytest.mark.parametrize("name", sorted(ARITHMETIC))
def test_the_arithmetic_is_attention_and_its_gradients(name):
    """In FP32 (P and dS then enter their products unrounded) the stand-in's forward and its
    backward from the saved statistics agree with the FP64 reference to rounding."""
    shape = ARITHMETIC[name]
    inputs = synthetic_inputs(shape, seed=5, device=torch.device("cpu"), variant="model-like")
    expected = Fp64Reference().run(inputs).tensors
    masking = cudnn_sdpa.Masking(causal=shape.causal, window=shape.window or (-1, 0 if shape.causal else -1))
    seen = cudnn_sdpa.visibility(masking, shape.seq_len, shape.seq_len, inputs.q.device)
    got: dict[str, list[torch.Tensor]] = {}
    for row in range(shape.batch):
        q, k, v, do = (x[row].transpose(0, 1) for x in (inputs.q, inputs.k, inputs.v, inputs.grad_out))
        out, stats = cudnn_sdpa.forward(q, k, v, seen, shape.softmax_scale, inputs.sinks)
        dq, dk, dv, dsink = cudnn_sdpa.backward(q, k, v, out, do, stats, seen, shape.softmax_scale, inputs.sinks)
        for tensor, value in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv), ("dsink", dsink)):
            if value is not None:
                got.setdefault(tensor, []).append(value if tensor == "dsink" else value.transpose(0, 1))
    tensors = {tensor: torch.stack(parts).sum(0) if tensor == "dsink" else torch.stack(parts)
               for tensor, parts in got.items()}
    assert set(tensors) == set(expected)
    for tensor, value in expected.items():
        error, _ = relative_l2_error(tensors[tensor], value)
        assert error < FP32_AGREEMENT, f"{tensor} on {name}: {error:.2e}"


def test_the_masks_and_windows_keep_the_documented_keys():
    """Top-left and bottom-right causal masks and windows, with fewer queries than keys."""
    def keys(masking, query, tokens_q=3, tokens_kv=6):
        seen = cudnn_sdpa.visibility(masking, tokens_q, tokens_kv, torch.device("cpu"))
        return seen[query].nonzero().flatten().tolist()

    assert keys(cudnn_sdpa.Masking(causal=True), 1) == [0, 1]
    assert keys(cudnn_sdpa.Masking(causal_bottom_right=True), 1) == [0, 1, 2, 3, 4]
    assert keys(cudnn_sdpa.Masking(causal=True, window=(1, 0)), 2) == [1, 2]
    assert keys(cudnn_sdpa.Masking(causal_bottom_right=True, window=(1, 0), diagonal_bottom_right=True), 2) == [4, 5]
    assert keys(cudnn_sdpa.Masking(window=(0, 2)), 1) == [1, 2, 3]


def test_a_row_that_sees_no_key_gives_zeros_and_no_gradient():
    q, k, v = (torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    seen = torch.ones(4, 4, dtype=torch.bool)
    seen[2] = False
    out, stats = cudnn_sdpa.forward(q, k, v, seen, 0.5)
    assert torch.equal(out[:, 2], torch.zeros_like(out[:, 2])) and torch.isneginf(stats[:, 2]).all()
    dq, dk, dv, _ = cudnn_sdpa.backward(q, k, v, out, torch.ones_like(out), stats, seen, 0.5)
    assert torch.equal(dq[:, 2], torch.zeros_like(dq[:, 2])) and torch.isfinite(dk).all() and torch.isfinite(dv).all()


# --- through TE's DotProductAttention, in BF16 ------------------------------------------------------

THROUGH_TE = {
    "bshd window gqa": tiny_shape(dtype="bf16", seq_len=40, head_dim=16, window=(7, 0)),
    "bshd global": tiny_shape(dtype="bf16", seq_len=40, head_dim=16, window=None),
    "thd window": tiny_shape(dtype="bf16", seq_len=40, head_dim=16, window=(7, 0), qkv_format="thd"),
}


@pytest.mark.parametrize("name", sorted(THROUGH_TE))
def test_tes_fused_attention_runs_the_stand_ins_at_least_as_accurately_as_unfused(gpu, name):
    """TE forced to fused runs F16_arbitrary_seqlen through TE's own FusedAttention; its BF16 errors
    against FP64 are no larger than TE's unfused path's (BF16 logits and probabilities)."""
    inputs = synthetic_inputs(THROUGH_TE[name], seed=2, device=CUDA, variant="model-like")
    expected = Fp64Reference().run(inputs).tensors
    fused = TransformerEngine("fused").run(inputs)
    unfused = TransformerEngine("unfused").run(inputs)
    assert fused.backend == "te-fused (F16_arbitrary_seqlen)" and unfused.backend == "te-unfused"
    for tensor, value in expected.items():
        assert fused.tensors[tensor].is_cuda
        fused_error, _ = relative_l2_error(fused.tensors[tensor].cpu(), value.cpu())
        unfused_error, _ = relative_l2_error(unfused.tensors[tensor].cpu(), value.cpu())
        assert fused_error <= unfused_error, f"{tensor} on {name}: fused {fused_error:.2e}, unfused {unfused_error:.2e}"
    called = stand_ins_called()
    assert called["transformer_engine_torch.fused_attn_fwd"]["calls"] >= 1
    assert called["transformer_engine_torch.fused_attn_bwd"]["calls"] >= 1


def _dot_product_attention(te, **options):
    return te.DotProductAttention(num_attention_heads=4, kv_channels=16, num_gqa_groups=2, attention_dropout=0.0,
                                  **options).train()


def _draw(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16).to("cuda")


def test_thd_with_padding_between_sequences_computes_each_sequence_alone(gpu):
    """cu_seqlens_padded places two sequences of 5 and 7 tokens at offsets 0 and 8 of 16: the tokens
    between them and after them stay zero in O and in every gradient, and each sequence's results are
    the bits of the same sequences packed without gaps."""
    import transformer_engine.pytorch as te
    from transformer_engine.pytorch.attention.dot_product_attention import _attention_backends

    q, k, v, do = _draw(16, 4, 16, seed=1), _draw(16, 2, 16, seed=2), _draw(16, 2, 16, seed=3), _draw(16, 4, 16, seed=4)
    tokens = torch.tensor([0, 1, 2, 3, 4, 8, 9, 10, 11, 12, 13, 14])
    gaps = torch.tensor([5, 6, 7, 15])

    def run(q, k, v, do, cu_seqlens, padded):
        module = _dot_product_attention(te, qkv_format="thd", attn_mask_type="padding_causal")
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        _attention_backends["backend_selection_requires_update"] = True
        out = module(*leaves, cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, cu_seqlens_q_padded=padded,
                     cu_seqlens_kv_padded=padded, max_seqlen_q=8, max_seqlen_kv=8)
        out.backward(do.reshape(out.shape))
        assert _attention_backends["use_fused_attention"]
        return [out.reshape(-1, 4, 16).detach(), *(leaf.grad for leaf in leaves)]

    cu_seqlens = torch.tensor([0, 5, 12], dtype=torch.int32).to("cuda")
    padded = run(q, k, v, do, cu_seqlens, torch.tensor([0, 8, 16], dtype=torch.int32).to("cuda"))
    dense = run(*(x[tokens] for x in (q, k, v, do)), cu_seqlens, None)
    for with_gaps, without in zip(padded, dense):
        assert torch.equal(with_gaps[tokens], without)
        assert torch.equal(with_gaps[gaps], torch.zeros_like(with_gaps[gaps]))


@pytest.mark.parametrize("packing", ["bs3hd", "bsh3d", "bshd_bs2hd"])
def test_packed_qkv_layouts_give_the_separate_tensors_results(gpu, packing):
    """Q, K, V as views of one buffer (TE detects bs3hd, bsh3d or bshd_bs2hd): the same bits as three
    tensors, the gradients in the layout's own buffers."""
    import transformer_engine.pytorch as te

    module = te.DotProductAttention(num_attention_heads=2, kv_channels=16, attention_dropout=0.0,
                                    qkv_format="bshd", attn_mask_type="causal").train()
    separate = [_draw(2, 24, 2, 16, seed=seed) for seed in range(3)]
    grad = _draw(2, 24, 32, seed=9)

    def run(q, k, v):
        out = module(q, k, v)
        out.backward(grad)
        return out.detach()

    leaves = [x.clone().requires_grad_() for x in separate]
    expected = run(*leaves)
    if packing == "bs3hd":
        buffer = torch.stack(separate, dim=2).requires_grad_()
        views = buffer.unbind(2)
    elif packing == "bsh3d":
        buffer = torch.stack(separate, dim=3).requires_grad_()
        views = buffer.unbind(3)
    else:
        buffer = torch.stack(separate[1:], dim=2).requires_grad_()
        views = (separate[0].clone().requires_grad_(), *buffer.unbind(2))
    assert torch.equal(run(*views), expected)
    gradients = buffer.grad.unbind(2 if packing != "bsh3d" else 3)
    for got, leaf in zip(gradients, leaves[-len(gradients):]):
        assert torch.equal(got, leaf.grad)


def test_sbhd_gives_the_bits_of_bshd(gpu):
    import transformer_engine.pytorch as te

    q, k, v, do = _draw(2, 24, 4, 16, seed=1), _draw(2, 24, 2, 16, seed=2), _draw(2, 24, 2, 16, seed=3), \
        _draw(2, 24, 64, seed=4)

    def run(qkv_format, transpose):
        module = _dot_product_attention(te, qkv_format=qkv_format, attn_mask_type="causal", window_size=(5, 0))
        leaves = [transpose(x).contiguous().requires_grad_() for x in (q, k, v)]
        out = module(*leaves)
        out.backward(transpose(do).contiguous())
        return [transpose(x) for x in (out.detach(), *(leaf.grad for leaf in leaves))]

    same = lambda x: x  # noqa: E731
    for by_sbhd, by_bshd in zip(run("sbhd", lambda x: x.transpose(0, 1)), run("bshd", same)):
        assert torch.equal(by_sbhd, by_bshd)


def test_deterministic_mode_keeps_fused_attention_and_asks_its_backward_for_determinism(gpu, monkeypatch):
    """NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 at construction: TE 2.17 keeps F16_arbitrary_seqlen on sm90
    (utils.py 1430-1463) and passes deterministic=True to the gate and to the backward."""
    import transformer_engine.pytorch as te
    from correctness import te_on_cpu

    asked = []
    backward = te_on_cpu.COMPILED_STAND_INS["fused_attn_bwd"]
    monkeypatch.setitem(te_on_cpu.COMPILED_STAND_INS, "fused_attn_bwd",
                        lambda *arguments: asked.append(arguments[16]) or backward(*arguments))
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    module = _dot_product_attention(te, qkv_format="bshd", attn_mask_type="causal")
    q = _draw(1, 24, 4, 16, seed=0).requires_grad_()
    k, v = (_draw(1, 24, 2, 16, seed=seed).requires_grad_() for seed in (1, 2))
    module(q, k, v).sum().backward()
    assert module.deterministic and asked == [True]


def test_sinks_are_refused_by_fused_attention_at_cudnn_9_10(gpu):
    shape = tiny_shape(dtype="bf16", seq_len=24, head_dim=16, sinks=True)
    inputs = synthetic_inputs(shape, seed=0, device=CUDA, variant="model-like")
    with pytest.raises(ImplementationUnavailable, match="No dot product attention backend"):
        TransformerEngine("fused").run(inputs)


def test_a_cpu_tensor_is_refused(gpu):
    from transformer_engine.pytorch.cpp_extensions.fused_attn import FusedAttnBackend, fused_attn_fwd

    cu_seqlens = torch.tensor([0, 24], dtype=torch.int32).to("cuda")
    q, k, v = _draw(1, 24, 4, 16, seed=0), _draw(1, 24, 2, 16, seed=1), _draw(1, 24, 2, 16, seed=2)
    with pytest.raises(NotOnGpu, match="fused_attn_fwd: Q is on cpu"):
        fused_attn_fwd(True, 24, 24, cu_seqlens, cu_seqlens, q.cpu(), k, v, torch.bfloat16,
                       FusedAttnBackend["F16_arbitrary_seqlen"], qkv_layout="bshd_bshd_bshd", o_format="bshd",
                       attn_mask_type="causal", window_size=(-1, 0))


def test_tes_path_runs_rows_sliced_from_a_packed_batch(gpu):
    """Regression: PerRow hands TE each packed row as a slice of the packed tensors; TE's layout
    detection (utils.py get_qkv_layout) refused the second row, a view starting inside the storage
    ("The provided qkv memory layout is not supported!"), until the TE path gave TE tensors of
    their own."""
    shape = tiny_shape(dtype="bf16", seq_len=24, head_dim=16, qkv_format="thd", window=None)
    inputs = synthetic_inputs(shape, seed=0, device=CUDA, variant="model-like")
    output = PerRow(TransformerEngine("fused")).run(inputs)
    assert output.details["rows"] == 2 and output.tensors["out"].shape == inputs.q.shape


# --- TE's fused softmax kernels ------------------------------------------------------------------

def _within_one_bf16_step(got: torch.Tensor, exact: torch.Tensor) -> bool:
    """Every BF16 element is the FP64 value rounded either way (the FP32 arithmetic's own rounding
    can land on the other side of a BF16 midpoint)."""
    below = exact.to(torch.bfloat16).double()
    step = torch.nextafter(below.abs().to(torch.bfloat16), torch.tensor(float("inf"), dtype=torch.bfloat16)).double() \
        - below.abs()
    return bool(((got.double() - exact).abs() <= step).all())


def test_the_fused_masked_softmax_is_the_fp32_softmax_rounded_once(gpu):
    from correctness import te_on_cpu

    forward = te_on_cpu.COMPILED_STAND_INS["scaled_masked_softmax_forward"]
    backward = te_on_cpu.COMPILED_STAND_INS["scaled_masked_softmax_backward"]
    scores = _draw(2, 3, 8, 32, seed=0)
    mask = torch.rand(1, 1, 8, 32, generator=torch.Generator().manual_seed(1)) < 0.3
    mask[0, 0, 5] = True  # a row with every key masked
    mask = mask.to("cuda")
    probs = forward(scores, mask, 0.5)
    exact = torch.softmax((scores.double() * 0.5).masked_fill(mask, float("-inf")), dim=-1)
    exact[:, :, 5] = 0.0
    assert probs.dtype == torch.bfloat16 and probs.is_cuda and _within_one_bf16_step(probs, exact)
    assert torch.equal(probs[:, :, 5], torch.zeros_like(probs[:, :, 5]))
    grad = _draw(2, 3, 8, 32, seed=2)
    y, dy = probs.double(), grad.double()
    exact_grad = 0.5 * y * (dy - (dy * y).sum(-1, keepdim=True))
    result = backward(grad, probs, 0.5)
    assert result.data_ptr() == grad.data_ptr()  # in place, as the kernel writes it
    assert _within_one_bf16_step(result, exact_grad)


def test_the_unscaled_softmax_kernel_and_the_launchers_checks(gpu):
    from correctness import te_on_cpu
    from correctness.emulated_gpu.stand_ins.te_softmax import SoftmaxCheckFailed

    forward = te_on_cpu.COMPILED_STAND_INS["scaled_softmax_forward"]
    scores = _draw(1, 2, 4, 16, seed=3)
    assert _within_one_bf16_step(forward(scores, 2.0), torch.softmax(scores.double() * 2.0, dim=-1))
    large = scores * 64  # logits where the launcher's rounding of the scale to BF16 shows
    rounded_scale = float(torch.tensor(0.3, dtype=torch.bfloat16))
    probs = forward(large, 0.3)
    assert _within_one_bf16_step(probs, torch.softmax(large.double() * rounded_scale, dim=-1))
    assert not _within_one_bf16_step(probs, torch.softmax(large.double() * 0.3, dim=-1))
    with pytest.raises(SoftmaxCheckFailed, match="divisible by 8"):
        forward(_draw(1, 2, 4, 12, seed=3), 1.0)
    with pytest.raises(NotOnGpu):
        forward(scores.cpu(), 1.0)
