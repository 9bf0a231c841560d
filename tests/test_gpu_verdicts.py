"""The GPU tiers' verdict logic, on the CPU: a refusal is a skip and every other error a failure,
the recipe's backend claim is checked, an unchanged kernel is "no kernel change", and the GPU type
is matched exactly.

Transformer Engine is absent here, so a stand-in module takes its place (`StandInTE` below): it
chooses a backend from TE's NVTE_* switches as TE does, writes TE's backend cache, and computes
attention in plain torch. It is scaffolding for the TE path's logic (refusals, errors, forced
backends, what ran); its numerics are never what a verdict here is about.
"""

import os
import sys
import types
from dataclasses import dataclass, field, replace

import pytest
import torch

from correctness.attach import component_test_entry
from correctness.attention import backend_lever as attention
from correctness.attention import sdpa as sdpa_module
from correctness.attention import te as te_module
from correctness.attention.claims import expected_te_backends
from correctness.attention.inputs import synthetic_inputs
from correctness.attention.reference import Fp64Reference
from correctness.attention.sdpa import Sdpa
from correctness.attention.te import NO_BACKEND, TransformerEngine, fused_sub_backend, te_versions
from correctness.errors import ImplementationUnavailable, RecipeError
from correctness.harness import run_case, run_lever
from correctness.lever import Lever, LeverOptions
from correctness.results import RecipeRef
from correctness.provenance import gpu_type
from correctness.pytest_plugin import _missing_hardware
from correctness.tiers import recipe_gpu_tier
from correctness.attention.shapes import AttentionShape

RECIPE = RecipeRef(id="toy/h100/stand-in", model="Toy", gpu="H100", sha256="0" * 64)
SHAPE = dict(model="toy", scale="test", tp_size=1, tp_rank=0, batch=1, seq_len=64, heads=4, groups=2, causal=True,
             softmax_scale=1.0, dtype="bf16", qkv_format="bshd")
SLIDING = AttentionShape(**SHAPE, layer_kind="sliding", window=(15, 0), head_dim=16)
GLOBAL = AttentionShape(**SHAPE, layer_kind="global", window=None, head_dim=32)


@dataclass
class StandInTE:
    """What the stand-in TE does: fused attention up to `fused_max_head_dim` where the switches
    allow it (as TE on Hopper: cuDNN needs head dim <= 256 in training), else unfused; `error` is
    raised by the forward instead; `ignore_switches` runs fused even where it is switched off."""

    fused_max_head_dim: int = 16
    error: Exception | None = None
    ignore_switches: bool = False
    cache: dict = field(default_factory=lambda: {"backend_selection_requires_update": True})

    def attention_class(self):
        state = self

        class DotProductAttention(torch.nn.Module):
            def __init__(self, *, kv_channels, softmax_scale, **_):
                super().__init__()
                self.head_dim, self.scale = kv_channels, softmax_scale

            def forward(self, q, k, v, *, window_size, **_):
                if state.error is not None:
                    raise state.error
                fused_fits = self.head_dim <= state.fused_max_head_dim
                fused = fused_fits and (state.ignore_switches or os.environ.get("NVTE_FUSED_ATTN") == "1")
                unfused = os.environ.get("NVTE_UNFUSED_ATTN") == "1"
                if not (fused or unfused):
                    raise ValueError(f"{NO_BACKEND} for the provided inputs. Please run with NVTE_DEBUG=1")
                state.cache.update(use_fused_attention=fused, fused_attention_backend=1 if fused else None,
                                   use_flash_attention=False, use_unfused_attention=not fused)
                return plain_attention(q, k, v, self.scale, window_size, torch.float32 if fused else q.dtype)

        return DotProductAttention

    def install(self, monkeypatch):
        package = types.ModuleType("transformer_engine")
        package.__version__ = "2.17.0"
        pytorch = types.ModuleType("transformer_engine.pytorch")
        pytorch.DotProductAttention = self.attention_class()
        utils = types.ModuleType("transformer_engine.pytorch.utils")
        utils.get_cudnn_version = lambda: (9, 10, 2)
        attention_package = types.ModuleType("transformer_engine.pytorch.attention")
        dpa = types.ModuleType("transformer_engine.pytorch.attention.dot_product_attention")
        dpa._attention_backends = self.cache
        dpa_utils = types.ModuleType("transformer_engine.pytorch.attention.dot_product_attention.utils")
        dpa_utils.FlashAttentionUtils = types.SimpleNamespace(
            is_installed=False, version="0", v3_is_installed=True, fa3_version="3.0.0b1", v4_is_installed=False,
            fa4_version="0",
        )
        package.pytorch, pytorch.utils, pytorch.attention = pytorch, utils, attention_package
        attention_package.dot_product_attention, dpa.utils = dpa, dpa_utils
        for module in (package, pytorch, utils, attention_package, dpa, dpa_utils):
            monkeypatch.setitem(sys.modules, module.__name__, module)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        return self


def plain_attention(q, k, v, scale, window, dtype):
    """Causal attention with TE's inclusive window, GQA by repetition, in `dtype`; [b, s, h * d]."""
    b, s, h, d = q.shape
    ratio = h // k.shape[2]
    k, v = (x.repeat_interleave(ratio, dim=2).to(dtype) for x in (k, v))
    logits = torch.einsum("bqhd,bkhd->bhqk", q.to(dtype), k) * scale
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    visible = (j <= i) & ((j >= i - window[0]) if window[0] >= 0 else True)
    probs = torch.softmax(logits.float().masked_fill(~visible, -torch.inf), dim=-1).to(dtype)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v).to(q.dtype).reshape(b, s, h * d)


def te_lever(expected: dict[str, str]) -> Lever:
    """The attention lever's recipe-GPU tier (TE auto against TE unfused) at tiny shapes."""
    cases = (
        attention.synthetic_case(SLIDING, 0, "model-like", expected.get("sliding")),
        attention.synthetic_case(SLIDING, 0, "window-edge", expected.get("sliding")),
        attention.synthetic_case(GLOBAL, 0, "model-like", expected.get("global")),
    )
    candidate = TransformerEngine("auto")
    return Lever(
        name=attention.NAME, version=attention.VERSION, description="TE auto against TE unfused",
        tier=replace(recipe_gpu_tier("H100"), device="cpu"),  # the H100 tier, its stand-in TE on the CPU
        recipe=RECIPE, cases=cases, candidate=candidate, default=TransformerEngine("unfused"),
        reference=Fp64Reference(), controls=attention.controls(candidate), compares_kernels=True,
    )


CLAIMED = {"sliding": "te-fused", "global": "te-unfused"}


def test_te_tier_passes_where_te_runs_what_the_recipe_says(monkeypatch):
    StandInTE().install(monkeypatch)
    record = run_lever(te_lever(CLAIMED))
    statuses = {case.case_id: case.status for case in record.cases}
    assert list(statuses.values()) == ["pass", "pass", "no kernel change"], [c.failures for c in record.cases]
    sliding = record.cases[0]
    assert sliding.candidate.run.backend == "te-fused (F16_arbitrary_seqlen)"
    assert sliding.default.backend == "te-unfused"
    assert all(t.bitwise_identical for t in record.cases[2].candidate.tensors)
    assert all(control.fails_bound for case in record.cases for control in case.controls if control.judgement)
    assert record.verdict == "pass"


def test_the_recipe_entry_says_which_layers_had_no_kernel_change(monkeypatch):
    StandInTE().install(monkeypatch)
    entry = component_test_entry(run_lever(te_lever(CLAIMED)))
    assert entry["result"] == "pass"
    assert "on the sliding-window layers te-fused (F16_arbitrary_seqlen) runs, whose relative L2 error" in entry["detail"]
    assert ("on the global layers te-unfused runs, the default's own kernel: no kernel change, bitwise identical"
            " to the default") in entry["detail"]


def test_te_tier_fails_where_te_runs_another_backend_than_the_recipe_says(monkeypatch):
    StandInTE(fused_max_head_dim=0).install(monkeypatch)  # cuDNN takes no case: auto falls back to unfused
    result = run_case(te_lever(CLAIMED), te_lever(CLAIMED).cases[0])
    assert result.status == "fail"
    assert result.failures == ("the recipe says te-fused runs on this case; the candidate ran te-unfused",)


def test_without_a_claim_an_unchanged_kernel_is_no_kernel_change_never_a_pass(monkeypatch):
    StandInTE(fused_max_head_dim=0).install(monkeypatch)
    record = run_lever(te_lever({}))
    assert {case.status for case in record.cases} == {"no kernel change"}
    assert record.verdict == "no kernel change"


def test_tes_own_refusal_skips_the_case_and_leaves_the_lever_incomplete(monkeypatch):
    StandInTE(fused_max_head_dim=0).install(monkeypatch)
    lever = te_lever({})
    refused = Lever(**{**lever.__dict__, "default": TransformerEngine("fused")})  # fused cannot run anything
    record = run_lever(refused)
    assert {case.status for case in record.cases} == {"skip"}
    assert all(NO_BACKEND in case.skip_reason for case in record.cases)
    assert record.verdict == "skip"


@pytest.mark.parametrize(
    "error",
    [RuntimeError("cuDNN Error: CUDNN_STATUS_EXECUTION_FAILED"), torch.OutOfMemoryError("CUDA out of memory."),
     AssertionError("Sequence length does not match"), ValueError("qkv_format=thd requires cu_seqlens")],
    ids=["cudnn-error", "out-of-memory", "assertion", "another-value-error"],
)
def test_any_other_te_error_fails_the_case_with_its_message(monkeypatch, error):
    StandInTE(error=error).install(monkeypatch)
    lever = te_lever(CLAIMED)
    result = run_case(lever, lever.cases[0])
    assert result.status == "fail"
    assert result.failures == (f"candidate (te-auto) raised {type(error).__name__}: {error}",)


def test_a_forced_backend_that_did_not_run_fails(monkeypatch):
    StandInTE(ignore_switches=True).install(monkeypatch)  # runs fused where it was forced to unfused
    lever = te_lever(CLAIMED)
    result = run_case(lever, lever.cases[0])
    assert result.status == "fail"
    assert "default (te-unfused) raised CorrectnessError: TE was forced to unfused but ran fused" in result.failures[0]


def test_te_versions_name_flash_attention_only_where_installed(monkeypatch):
    StandInTE().install(monkeypatch)
    versions = te_versions()
    assert versions["transformer_engine"] == "2.17.0" and versions["cudnn_runtime"] == "9.10.2"
    assert versions["flash_attn"] is None  # TE says "0" where flash-attn is absent
    assert versions["flash_attn_3"] == "3.0.0b1" and versions["flash_attn_4"] is None


@pytest.mark.parametrize(
    ("value", "name"),
    [(1, "F16_arbitrary_seqlen"), (2, "FP8"), (-1, "No_Backend"), (7, "7"), (None, "unknown"),
     (types.SimpleNamespace(name="NVTE_F16_arbitrary_seqlen"), "F16_arbitrary_seqlen")],
)
def test_fused_sub_backends_have_te_2_17s_names(value, name):
    assert fused_sub_backend(value) == name
    assert "F16_max512_seqlen" not in te_module.FUSED_SUB_BACKENDS.values()


# torch SDPA


def sdpa_raising(monkeypatch, error):
    def attend(*args, **kwargs):
        raise error

    monkeypatch.setattr(sdpa_module.F, "scaled_dot_product_attention", attend)
    return synthetic_inputs(SLIDING, seed=0, device=torch.device("cpu"), variant="model-like")


@pytest.mark.parametrize("message", ["No available kernel.  Aborting execution.",
                                     "No viable backend for scaled_dot_product_attention was found."])
def test_sdpa_refusal_is_unavailable(monkeypatch, message):
    inputs = sdpa_raising(monkeypatch, RuntimeError(message))
    with pytest.raises(ImplementationUnavailable, match="torch SDPA cudnn refuses"):
        Sdpa("cudnn").run(inputs)


@pytest.mark.parametrize(
    "error", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 GiB"),
              RuntimeError("CUDA error: an illegal memory access was encountered")],
    ids=["out-of-memory", "kernel-error"],
)
def test_sdpa_errors_are_not_refusals(monkeypatch, error):
    inputs = sdpa_raising(monkeypatch, error)
    with pytest.raises(type(error)):
        Sdpa("cudnn").run(inputs)


# The recipe's claim


def test_the_gemma_recipe_claims_fused_sliding_and_unfused_global_attention(gemma_recipe, gemma):
    assert expected_te_backends(gemma_recipe, gemma) == {"sliding": "te-fused", "global": "te-unfused"}


def test_a_forced_backend_is_the_claim_for_every_layer_kind(gemma_recipe, gemma, monkeypatch):
    monkeypatch.setattr(type(gemma_recipe), "argument", lambda self, flag: ["fused"] if flag == "--attention-backend" else None)
    assert expected_te_backends(gemma_recipe, gemma) == {"sliding": "te-fused", "global": "te-fused"}


def test_the_nemotron_recipe_makes_no_claim(nemotron_recipe, nemotron):
    assert expected_te_backends(nemotron_recipe, nemotron) == {}


def test_a_claim_whose_quote_left_the_recipe_is_refused(gemma_recipe, gemma):
    edited = type(gemma_recipe)(
        id=gemma_recipe.id, path=gemma_recipe.path, sha256=gemma_recipe.sha256,
        data={**gemma_recipe.data, "layout": {**gemma_recipe.data["layout"], "summary": "TE's flash attention"}},
    )
    with pytest.raises(RecipeError, match="its quote no longer stands in the recipe's layout.summary"):
        expected_te_backends(edited, gemma)


def test_the_recipe_gpu_tier_declares_the_claims(gemma_recipe):
    (lever,) = attention.recipe_gpu_tier(gemma_recipe.id, LeverOptions())
    expected = {case.shape.layer_kind: case.expected_backend for case in lever.cases}
    assert expected == {"sliding": "te-fused", "global": "te-unfused"}
    assert lever.compares_kernels
    assert {case.required for case in lever.cases if case.source == "checkpoint"} == {False}
    assert {case.required for case in lever.cases if case.source == "synthetic"} == {True}


# The GPU type


@pytest.mark.parametrize(
    ("name", "expected"),
    [("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA H100 PCIe", "H100"), ("NVIDIA H200", "H200"),
     ("NVIDIA H200 NVL", "H200"), ("NVIDIA GH200 480GB", "GH200"), ("NVIDIA GB200", "GB200"),
     ("NVIDIA B200", "B200"), ("NVIDIA A100-SXM4-80GB", "A100"), ("NVIDIA GeForce RTX 4090", None), (None, None)],
)
def test_the_gpu_type_is_matched_as_a_whole_word(name, expected):
    assert gpu_type(name) == expected


@dataclass
class MarkedItem:
    names: tuple[str, ...]

    def iter_markers(self):
        return [types.SimpleNamespace(name=name) for name in self.names]


@pytest.mark.parametrize(("device", "skips"), [("NVIDIA GH200 480GB", True), ("NVIDIA H200", False)])
def test_a_gh200_is_not_an_h200(monkeypatch, device, skips):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: device)
    reason = _missing_hardware(MarkedItem(("h200",)))
    # a GH200 (sm90) skips, and is told it could stand in (tests/test_gpu_stand_in.py), never taken for an H200
    assert (reason or "").startswith(f"needs an NVIDIA H200 (the recipe's GPU); found {device}") is skips
    assert (reason is None) is not skips
