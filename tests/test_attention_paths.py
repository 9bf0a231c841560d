"""The attention lever's paths, masks, inputs and controls, at tiny shapes on the CPU."""

import json
import math
import os

import pytest
import torch
from safetensors.torch import save_file

from correctness.attention import backend_lever as attention
import correctness.attention.eager as eager_module
from correctness.attention.eager import EagerUnfused, gemm
from correctness.attention.inputs import (
    CAPTURE_FORMAT,
    CAPTURE_FORMAT_VERSION,
    checkpoint_file,
    checkpoint_inputs,
    synthetic_inputs,
)
from correctness.attention.masks import visible_keys
from correctness.attention.reference import Fp64Reference
from correctness.attention.sdpa import Sdpa
from correctness.attention.te import FORCED, SWITCHES, TransformerEngine, backend_switches, backend_that_ran
from attention_shapes import tiny_shape
from numerics import FP32_AGREEMENT, relative_l2_error
from correctness.errors import CaseInputError, ImplementationUnavailable
from correctness.harness import run_case
from correctness.lever import LeverOptions
from correctness.fixtures import recipe_path
from correctness.models import load_model
from correctness.recipes import load_recipe
from correctness.attention.shapes import AttentionShape, attention_shape

CPU = torch.device("cpu")
# In FP32 the working-precision paths differ from FP64 by rounding alone: any mask, grouping or
# layout bug is orders of magnitude larger than this.


SHAPES = {
    "window": tiny_shape(),
    "global": tiny_shape(window=None),
    "thd-window": tiny_shape(qkv_format="thd"),
    "mha": tiny_shape(groups=4),
}


@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("path", [EagerUnfused(), Sdpa("math"), Sdpa("flash")], ids=lambda p: p.name)
def test_paths_agree_with_the_reference_in_fp32(name, path):
    inputs = synthetic_inputs(SHAPES[name], seed=3, device=CPU, variant="model-like")
    reference = Fp64Reference().run(inputs).tensors
    output = path.run(inputs)
    assert set(output.tensors) == set(reference)
    for tensor, expected in reference.items():
        error, kind = relative_l2_error(output.tensors[tensor], expected)
        assert kind == "relative" and error < FP32_AGREEMENT, f"{path.name} {tensor} on {name}: {error:.2e}"


def test_a_wrong_group_mapping_would_be_seen():
    """Swapping the two groups' keys changes every output: two groups make grouping visible."""
    inputs = synthetic_inputs(SHAPES["window"], seed=3, device=CPU, variant="model-like")
    swapped = type(inputs)(shape=inputs.shape, q=inputs.q, k=inputs.k.flip(2), v=inputs.v.flip(2),
                           grad_out=inputs.grad_out)
    right = EagerUnfused().run(inputs).tensors["out"]
    wrong = EagerUnfused().run(swapped).tensors["out"]
    assert relative_l2_error(wrong, right)[0] > 100 * FP32_AGREEMENT


def test_the_cpu_gemm_is_the_fp32_product_of_the_bf16_values_rounded_once():
    generator = torch.Generator().manual_seed(0)
    a, b, grad = (torch.randn(*size, generator=generator).to(torch.bfloat16) for size in ((2, 8, 16), (2, 16, 4), (2, 8, 4)))
    a.requires_grad_(), b.requires_grad_()
    out = gemm(a, b, alpha=0.5)
    out.backward(grad)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, (torch.bmm(a.float(), b.float()) * 0.5).to(torch.bfloat16))
    # autograd's baddbmm formula: the gradient GEMM rounded, then scaled by alpha in BF16
    assert torch.equal(a.grad, torch.bmm(grad.float(), b.float().transpose(1, 2)).to(torch.bfloat16) * 0.5)
    assert torch.equal(b.grad, torch.bmm(a.float().transpose(1, 2), grad.float()).to(torch.bfloat16) * 0.5)


def test_the_eager_paths_errors_are_those_of_torchs_own_bf16_gemm(monkeypatch):
    """The FP32 product rounded to BF16 stands for torch's BF16 bmm (FP32 accumulation) on the CPU:
    its errors against FP64 are the same to a few parts in a thousand, and most elements are equal."""
    shape = tiny_shape(dtype="bf16", head_dim=64, seq_len=96, window=(31, 0), softmax_scale=0.125 * 0.7)
    inputs = synthetic_inputs(shape, seed=2, device=CPU, variant="model-like")
    reference = Fp64Reference().run(inputs).tensors
    rounded = EagerUnfused().run(inputs).tensors
    monkeypatch.setattr(eager_module, "gemm", lambda a, b, alpha=1.0: torch.baddbmm(
        torch.empty(a.shape[0], a.shape[1], b.shape[2], dtype=a.dtype), a, b, beta=0.0, alpha=alpha))
    native = EagerUnfused().run(inputs).tensors
    for name in ("out", "dq", "dk", "dv"):
        errors = [relative_l2_error(tensors[name], reference[name])[0] for tensors in (rounded, native)]
        assert errors[0] == pytest.approx(errors[1], rel=5e-3), name
        assert (rounded[name] == native[name]).float().mean() > 0.95, name


def test_eager_path_keeps_logits_in_the_input_dtype():
    shape = tiny_shape(dtype="bf16", softmax_scale=1.0, head_dim=64, seq_len=64)
    inputs = synthetic_inputs(shape, seed=0, device=CPU, variant="model-like")
    reference = Fp64Reference().run(inputs).tensors
    eager = EagerUnfused().run(inputs)
    flash = Sdpa("flash").run(inputs)
    assert eager.details["logits_dtype"] == "bfloat16"
    assert all(eager.tensors[name].dtype == torch.bfloat16 for name in reference)
    # BF16 logits at scale 1.0 are the unfused path's main error: FP32-logit kernels beat it.
    assert relative_l2_error(eager.tensors["out"], reference["out"])[0] > relative_l2_error(
        flash.tensors["out"], reference["out"]
    )[0]


CHUNKED_SHAPES = {
    "bshd-gqa-window": tiny_shape(dtype="bf16", seq_len=64, head_dim=32, heads=6, groups=2),
    "thd": tiny_shape(dtype="bf16", seq_len=48, head_dim=32, heads=6, groups=3, qkv_format="thd"),
    "softcap": tiny_shape(dtype="bf16", seq_len=64, head_dim=32, window=None, softcap=0.5),
    "sinks": tiny_shape(dtype="bf16", seq_len=64, head_dim=32, sinks=True),
}


@pytest.mark.parametrize("pairs", [1, 5])
@pytest.mark.parametrize("name", sorted(CHUNKED_SHAPES))
def test_the_eager_path_run_in_chunks_of_heads_is_bitwise_one_run(name, pairs, monkeypatch):
    """At the recipe scale the eager path runs a few (row, head) pairs at a time (eager.SCORE_CHUNK_BYTES):
    its outputs must be those of one run bit for bit, with a chunk that divides the pairs and one that does not."""
    inputs = synthetic_inputs(CHUNKED_SHAPES[name], seed=1, device=CPU, variant="model-like")
    whole = EagerUnfused().run(inputs).tensors
    shape = inputs.shape
    keys = shape.tokens + (1 if shape.sinks else 0)
    monkeypatch.setattr(eager_module, "SCORE_CHUNK_BYTES", pairs * eager_module.SCORE_BYTES * shape.tokens * keys)
    rows = 1 if shape.qkv_format == "thd" else shape.batch
    assert eager_module.pairs_per_chunk(rows * shape.heads, shape.tokens, keys) == pairs
    chunked = EagerUnfused().run(inputs).tensors
    assert set(chunked) == set(whole)
    for tensor, expected in whole.items():
        assert torch.equal(chunked[tensor], expected), f"{tensor} differs run in chunks of {pairs} pairs on {name}"


def brute_force_visible(shape: AttentionShape) -> torch.Tensor:
    n = shape.batch * shape.seq_len if shape.qkv_format == "thd" else shape.seq_len
    left, right = shape.window or (-1, -1)
    visible = torch.zeros(n, n, dtype=torch.bool)
    for a in range(n):
        for b in range(n):
            i, j = a % shape.seq_len, b % shape.seq_len
            same_row = shape.qkv_format != "thd" or a // shape.seq_len == b // shape.seq_len
            visible[a, b] = (
                same_row
                and (not shape.causal or j <= i)
                and (left < 0 or j >= i - left)
                and (right < 0 or j <= i + right)
            )
    return visible


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_visible_keys_matches_the_definition(name):
    assert torch.equal(visible_keys(SHAPES[name], CPU), brute_force_visible(SHAPES[name]))


def test_a_window_of_w_keys_is_te_w_minus_one():
    visible = visible_keys(tiny_shape(window=(3, 0), batch=1), CPU)
    assert visible.sum(dim=1).max() == 4  # the query and the 3 keys before it


def test_sdpa_refusal_makes_the_path_unavailable_with_the_reason():
    inputs = synthetic_inputs(SHAPES["window"], seed=0, device=CPU, variant="model-like")
    with pytest.raises(ImplementationUnavailable, match="torch SDPA efficient refuses toy-sliding"):
        Sdpa("efficient").run(inputs)


def test_unknown_backends_are_refused_at_declaration():
    with pytest.raises(ValueError, match="unknown backend 'fastest'"):
        Sdpa("fastest")
    with pytest.raises(ValueError, match="unknown backend 'fastest'"):
        TransformerEngine("fastest")


def test_te_path_without_te_is_unavailable_with_the_reason():
    inputs = synthetic_inputs(SHAPES["window"], seed=0, device=CPU, variant="model-like")
    with pytest.raises(ImplementationUnavailable, match="Transformer Engine|CUDA"):
        TransformerEngine("auto").run(inputs)


def test_te_backend_switches_are_restored_and_reselection_requested(monkeypatch):
    monkeypatch.setenv("NVTE_FUSED_ATTN", "0")
    monkeypatch.delenv("NVTE_FLASH_ATTN", raising=False)
    monkeypatch.delenv("NVTE_UNFUSED_ATTN", raising=False)
    cache = {"backend_selection_requires_update": False}
    with backend_switches(FORCED["unfused"], cache):
        assert {name: os.environ[name] for name in SWITCHES} == FORCED["unfused"]
        assert cache["backend_selection_requires_update"] is True
        cache["backend_selection_requires_update"] = False  # TE clears it when it re-selects
    assert os.environ["NVTE_FUSED_ATTN"] == "0"
    assert "NVTE_FLASH_ATTN" not in os.environ and "NVTE_UNFUSED_ATTN" not in os.environ
    assert cache["backend_selection_requires_update"] is True


@pytest.mark.parametrize(
    ("cache", "expected"),
    [
        ({"use_fused_attention": True, "fused_attention_backend": 1}, ("fused", "F16_arbitrary_seqlen")),
        ({"use_flash_attention": True, "flash_attention_backend": "2.7.4"}, ("flash", None)),
        ({"use_unfused_attention": True}, ("unfused", None)),
        ({}, ("none", None)),
    ],
)
def test_te_backend_read_back(cache, expected):
    ran, details = backend_that_ran(cache)
    assert (ran, details.get("fused_attention_backend")) == expected


def test_synthetic_inputs_are_seeded_and_model_like():
    shape = tiny_shape(dtype="bf16", head_dim=64, seq_len=32)
    first = synthetic_inputs(shape, seed=5, device=CPU, variant="model-like")
    again = synthetic_inputs(shape, seed=5, device=CPU, variant="model-like")
    other = synthetic_inputs(shape, seed=6, device=CPU, variant="model-like")
    assert torch.equal(first.q, again.q) and torch.equal(first.grad_out, again.grad_out)
    assert not torch.equal(first.q, other.q)
    v_rms = first.v.float().square().mean(dim=-1).sqrt()
    assert torch.allclose(v_rms, torch.ones_like(v_rms), atol=1e-2)  # V normalised without a gain
    assert first.q.dtype == torch.bfloat16 and first.q.shape == (2, 32, 4, 64)


def test_window_edge_inputs_make_both_keys_at_the_window_edge_attractive():
    shape = tiny_shape(window=(3, 0), seq_len=16, head_dim=128, softmax_scale=1.0)
    inputs = synthetic_inputs(shape, seed=0, device=CPU, variant="window-edge")
    width = shape.window[0] + 1
    q, k = inputs.q.float(), inputs.k.float()
    for group in range(shape.groups):
        head = group * shape.gqa_ratio
        for query in range(width, shape.seq_len):
            logits = (q[0, query, head] * k[0, : query + 1, group]).sum(-1)
            inside, outside = logits[query - width + 1], logits[query - width]  # farthest inside, first outside
            others = torch.cat((logits[: query - width], logits[query - width + 2 :]))
            assert inside > 0.5 * shape.head_dim and outside > 0.5 * shape.head_dim
            assert bool((others < inside - 0.25 * shape.head_dim).all())


def test_window_edge_needs_a_window_shorter_than_the_sequence():
    with pytest.raises(CaseInputError, match="window-edge"):
        synthetic_inputs(SHAPES["global"], seed=0, device=CPU, variant="window-edge")


def test_thd_inputs_pack_rows():
    inputs = synthetic_inputs(SHAPES["thd-window"], seed=0, device=CPU, variant="model-like")
    assert inputs.q.shape == (2 * 13, 4, 8) and inputs.k.shape == (2 * 13, 2, 8)
    assert SHAPES["thd-window"].cu_seqlens == (0, 13, 26)


def capture_metadata(shape, layer, groups):
    """What `correctness capture-attention` writes, for a capture of `groups` key-value groups."""
    return {
        "format": CAPTURE_FORMAT, "format_version": CAPTURE_FORMAT_VERSION, "model_short_name": shape.model,
        "layer": str(layer), "layer_kind": shape.layer_kind, "head_dim": str(shape.head_dim),
        "kv_groups": str(groups), "query_heads": str(groups * shape.gqa_ratio),
        "window_te": json.dumps(shape.window), "softmax_scale": json.dumps(shape.softmax_scale),
        "tp_size": str(shape.tp_size), "tp_rank": str(shape.tp_rank),
    }


def write_capture(folder, layer, shape, extra_seq=5, groups=None, drop=None, metadata=True):
    generator = torch.Generator().manual_seed(layer)
    groups = groups or shape.groups
    sizes = {"q": groups * shape.gqa_ratio, "k": groups, "v": groups, "out": groups * shape.gqa_ratio}
    tensors = {
        name: torch.randn(shape.batch, shape.seq_len + extra_seq, heads, shape.head_dim, generator=generator)
        .to(torch.bfloat16)
        for name, heads in sizes.items()
        if name != drop
    }
    save_file(tensors, str(checkpoint_file(folder, layer)),
              metadata=capture_metadata(shape, layer, groups) if metadata else None)
    return tensors


def test_checkpoint_inputs_are_sliced_to_the_case(tmp_path):
    shape = tiny_shape(dtype="bf16", batch=1)
    stored = write_capture(tmp_path, 7, shape, groups=3 * shape.groups)
    inputs = checkpoint_inputs(shape, checkpoint_file(tmp_path, 7), seed=0, device=CPU, recipe_groups=3 * shape.groups)
    assert torch.equal(inputs.q, stored["q"][:, : shape.seq_len, : shape.heads])
    assert torch.equal(inputs.k, stored["k"][:, : shape.seq_len, : shape.groups])
    assert inputs.grad_out.shape == inputs.q.shape


def test_checkpoint_inputs_name_what_is_wrong(tmp_path):
    shape = tiny_shape(dtype="bf16", batch=1)
    with pytest.raises(CaseInputError, match="layer-03.safetensors not found"):
        checkpoint_inputs(shape, checkpoint_file(tmp_path, 3), seed=0, device=CPU)
    write_capture(tmp_path, 4, shape, drop="v")
    with pytest.raises(CaseInputError, match="no tensor 'v'"):
        checkpoint_inputs(shape, checkpoint_file(tmp_path, 4), seed=0, device=CPU)
    write_capture(tmp_path, 5, shape, extra_seq=-1)
    with pytest.raises(CaseInputError, match="tensor q is .* too small"):
        checkpoint_inputs(shape, checkpoint_file(tmp_path, 5), seed=0, device=CPU)
    write_capture(tmp_path, 6, shape, metadata=False)
    with pytest.raises(CaseInputError, match="not 'correctness.attention-capture' version 1"):
        checkpoint_inputs(shape, checkpoint_file(tmp_path, 6), seed=0, device=CPU)
    write_capture(tmp_path, 8, shape)
    with pytest.raises(CaseInputError, match="window \\(3, 0\\) in the capture, the case needs \\(4, 0\\)"):
        checkpoint_inputs(shape.with_changes(window=(4, 0)), checkpoint_file(tmp_path, 8), seed=0, device=CPU)


GEMMA = "gemma-4-31b/h100/attune-tp2-pp4-split13"


def smoke_lever(options=LeverOptions()):
    return attention.cpu_tier(GEMMA, options)[0]


def test_cpu_tier_declares_the_recipe_cases():
    lever = smoke_lever()
    variants = sorted((case.shape.layer_kind, case.variant) for case in lever.cases)
    assert variants == sorted(
        [("sliding", "model-like")] * 2 + [("sliding", "window-edge")] + [("global", "model-like")] * 2
        + [("sliding", "captured")] * 2 + [("global", "captured")] * 2
    )
    layers = sorted(case.id.rsplit("layer", 1)[1] for case in lever.cases if case.source == "checkpoint")
    assert layers == ["00", "05", "58", "59"]  # first and last layer of each kind
    assert all(case.skip_reason for case in lever.cases if case.source == "checkpoint")


def test_controls_apply_only_where_they_change_the_computation():
    lever = smoke_lever()
    controls = {control.name: control for control in lever.controls}
    too_wide, too_narrow, scale = (controls[name] for name in ("window off by one", "window one short", "wrong softmax scale"))
    by_variant = {(case.shape.layer_kind, case.variant): case for case in lever.cases}
    for window in (too_wide, too_narrow):
        assert window.why_inapplicable(by_variant[("sliding", "window-edge")]) is None
        assert "no window" in window.why_inapplicable(by_variant[("global", "model-like")])
        assert "window-edge case carries" in window.why_inapplicable(by_variant[("sliding", "model-like")])
    assert all(scale.why_inapplicable(case) is None for case in lever.cases)
    # Gemma 4 has neither a logit softcap nor sinks: those controls apply nowhere, with the reason.
    assert all("no logit softcap" in controls["softcap ignored"].why_inapplicable(case) for case in lever.cases)
    assert all("no attention sinks" in controls["sink ignored"].why_inapplicable(case) for case in lever.cases)


def test_wrong_scale_is_the_other_convention():
    assert attention.wrong_scale(tiny_shape(softmax_scale=1.0, head_dim=256)) == 1 / 16
    assert attention.wrong_scale(tiny_shape(softmax_scale=1 / math.sqrt(128), head_dim=128)) == 1.0


def test_checkpoint_case_runs_through_the_lever(tmp_path):
    """A captured sliding layer at smoke scale: candidate passes, controls fail."""
    lever = smoke_lever(LeverOptions(checkpoint_dir=tmp_path))
    case = next(c for c in lever.cases if c.source == "checkpoint" and c.shape.layer_kind == "sliding")
    recipe_shape = attention_shape(load_recipe(recipe_path(GEMMA)), load_model("Gemma-4-31B"), "sliding")
    write_capture(tmp_path, int(case.id.rsplit("layer", 1)[1]), case.shape.with_changes(seq_len=recipe_shape.seq_len // 4),
                  extra_seq=0, groups=recipe_shape.groups)
    result = run_case(lever, case)
    assert result.status == "pass", result.failures
    assert [c.fails_bound for c in result.controls if c.judgement is not None] == [True]
