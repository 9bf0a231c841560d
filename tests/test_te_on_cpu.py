"""Transformer Engine 2.17's own Python on the CPU (correctness.te_on_cpu): TE's unfused attention is
right where the FP64 reference says so, the TE tier's adapter (correctness.attention.te) runs its
backend selection and refusals, the te-cpu tier passes on every attention case of the seven
fixture recipes, and outside the shim's block no other code sees a Transformer Engine."""

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from attention_shapes import tiny_shape
from numerics import FP32_AGREEMENT, relative_l2_error
from correctness.attention import backend_lever as attention
import correctness.attention.eager as eager_module
from correctness.attention.eager import EagerUnfused
from correctness.attention.inputs import synthetic_inputs
from correctness.attention.reference import Fp64Reference
from correctness.attention.te import TransformerEngine
from correctness.errors import ImplementationUnavailable
from correctness.harness import run_case
from correctness.lever import LeverOptions
from correctness import te_on_cpu

pytestmark = pytest.mark.te_cpu  # the plugin skips with te_on_cpu.unusable_reason() where TE's copy cannot run

ROOT = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")
TE_UNFUSED = TransformerEngine("unfused", on_cpu=True)
# Every layout and model feature TE's unfused path takes, at shapes small enough for FP32 to be
# rounding alone: GQA with a window, global, THD with cu_seqlens, sinks (softmax_type learnable),
# V of its own head dim (MLA: kv_channels=(192-like, 128-like)), and MHA.
SHAPES = {
    "window": tiny_shape(),
    "global": tiny_shape(window=None),
    "thd-window": tiny_shape(qkv_format="thd"),
    "sinks": tiny_shape(sinks=True),
    "mla-head-dims": tiny_shape(window=None, head_dim=12, v_head_dim=8),
    "mha": tiny_shape(groups=4),
}
# The six fixture recipes besides Gemma-4-31B's, whose te-cpu tier is a component test
# (component_tests/test_attention_backend.py).
RECIPES = (
    "nemotron-3-super-120b-a12b/h200/attune-tp4-pp2-ep8-mt16k",
    "llama-3.1-8b/h100/example-tp2-pp1-offload05",
    "qwen3-32b/h100/example-tp4-pp2-offload08",
    "qwen3-30b-a3b/h100/example-tp2-ep4-offload07",
    "gpt-oss-20b/h100/example-tp2-ep4-offload06",
    "moonlight-16b-a3b/h100/example-tp2-ep4-offload07",
)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_tes_unfused_attention_agrees_with_the_reference_in_fp32(name):
    inputs = synthetic_inputs(SHAPES[name], seed=3, device=CPU, variant="model-like")
    reference = Fp64Reference().run(inputs).tensors
    output = TE_UNFUSED.run(inputs)
    assert output.backend == "te-unfused" and output.details["ran"] == "unfused"
    assert set(output.tensors) == set(reference)
    for tensor, expected in reference.items():
        error, kind = relative_l2_error(output.tensors[tensor], expected)
        assert kind == "relative" and error < FP32_AGREEMENT, f"TE unfused {tensor} on {name}: {error:.2e}"


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_the_eager_path_is_bitwise_tes_unfused_attention(name):
    """The cpu tier's default (correctness.attention.eager) is TE's own UnfusedDotProductAttention,
    bit for bit, in BF16: forward, backward and the sinks' gradient, every layout and feature (TE's
    BF16 GEMMs computed as cuBLAS does, as the eager path's are; te_on_cpu). The seven recipes'
    smoke cases agree bitwise too (benchmarks/te_unfused_on_cpu.py, docs/te-on-cpu.md)."""
    inputs = synthetic_inputs(replace(SHAPES[name], dtype="bf16"), seed=3, device=CPU, variant="model-like")
    by_te, by_eager = TE_UNFUSED.run(inputs).tensors, EagerUnfused().run(inputs).tensors
    assert set(by_te) == set(by_eager)
    for tensor, expected in by_eager.items():
        assert torch.equal(by_te[tensor], expected), f"{tensor} on {name}"


def test_bitwise_agreement_has_power(monkeypatch):
    """An eager path that applies the softmax scale after rounding the logits' product to BF16 (one
    rounding more than cuBLAS's alpha in FP32) is no longer bitwise TE's: the comparison above sees
    a single rounding's difference."""
    inputs = synthetic_inputs(replace(SHAPES["window"], dtype="bf16"), seed=3, device=CPU, variant="model-like")
    rounded_first = lambda a, b, alpha=1.0: torch.bmm(a.float(), b.float()).to(a.dtype) * alpha  # noqa: E731
    monkeypatch.setattr(eager_module, "gemm", rounded_first)
    by_te, by_eager = TE_UNFUSED.run(inputs).tensors, EagerUnfused().run(inputs).tensors
    assert not torch.equal(by_te["out"], by_eager["out"])


def test_a_wrong_scale_in_tes_path_would_be_seen():
    """The agreement above has power: TE run with a softmax scale 1.5x the shape's misses it."""
    inputs = synthetic_inputs(SHAPES["window"], seed=3, device=CPU, variant="model-like")
    reference = Fp64Reference().run(inputs).tensors
    wrong = TE_UNFUSED.run(inputs.with_shape(softmax_scale=inputs.shape.softmax_scale * 1.5)).tensors
    error, _ = relative_l2_error(wrong["out"], reference["out"])
    assert error > 1000 * FP32_AGREEMENT


def test_tes_backend_selection_runs_and_chooses_unfused_on_the_cpu():
    """TE's own get_attention_backend decides: the fused and flash backends are not there."""
    inputs = synthetic_inputs(SHAPES["window"], seed=0, device=CPU, variant="model-like")
    output = TransformerEngine("auto", on_cpu=True).run(inputs)
    assert output.details["requested"] == "auto" and output.details["ran"] == "unfused"


@pytest.mark.parametrize("backend", ["fused", "flash"])
def test_a_forced_kernel_is_tes_own_refusal(backend):
    inputs = synthetic_inputs(SHAPES["window"], seed=0, device=CPU, variant="model-like")
    refused = f"TE {backend} refuses .*No dot product attention backend is available"
    with pytest.raises(ImplementationUnavailable, match=refused):
        TransformerEngine(backend, on_cpu=True).run(inputs)


def test_a_softcap_is_refused_before_te_runs():
    inputs = synthetic_inputs(tiny_shape(softcap=5.0), seed=0, device=CPU, variant="model-like")
    with pytest.raises(ImplementationUnavailable, match="no softcap on any backend"):
        TE_UNFUSED.run(inputs)


def test_the_record_says_what_stands_in():
    inputs = synthetic_inputs(SHAPES["window"], seed=0, device=CPU, variant="model-like")
    details = TE_UNFUSED.run(inputs).details
    assert details["transformer_engine"] == te_on_cpu.TE_VERSION
    assert "no kernels" in details["stands_in"]["transformer_engine_torch"]
    assert "sm90" in details["stands_in"]["cuda"]
    assert details["environment"]["NVTE_MASKED_SOFTMAX_FUSION"] == "0"


def test_a_compiled_function_raises_instead_of_computing():
    with te_on_cpu.te_on_cpu():
        import transformer_engine_torch as tex

        with pytest.raises(te_on_cpu.NoCompiledTe, match="fused_attn_fwd is compiled CUDA code"):
            tex.fused_attn_fwd(torch.zeros(1))
        assert int(tex.NVTE_Mask_Type.NVTE_PADDING_CAUSAL_MASK) == 3  # fused_attn.h 128 at v2.17


def test_outside_the_block_there_is_no_transformer_engine():
    with te_on_cpu.te_on_cpu() as te:
        assert te.__name__ == "transformer_engine.pytorch" and torch.cuda.is_available()
    assert not any(name.startswith("transformer_engine") for name in sys.modules)
    assert not torch.cuda.is_available()
    with pytest.raises(ImportError):
        import transformer_engine  # noqa: F401


def test_megatron_core_sees_no_te_after_te_ran():
    """megatron-core decides HAVE_TE by importing transformer_engine (fp8_utils.py 26, ...): after
    TE ran on the CPU, its Megatron CPU tiers still take their paths without TE."""
    program = (
        "import torch\n"
        "from attention_shapes import tiny_shape\n"
        "from correctness.attention.inputs import synthetic_inputs\n"
        "from correctness.attention.te import TransformerEngine\n"
        "inputs = synthetic_inputs(tiny_shape(), 0, torch.device('cpu'), 'model-like')\n"
        "TransformerEngine('unfused', on_cpu=True).run(inputs)\n"
        "from megatron.core import fp8_utils\n"
        "from megatron.core.extensions import transformer_engine as te_extension\n"
        "print(fp8_utils.HAVE_TE, te_extension.HAVE_TE, torch.cuda.is_available())\n"
    )
    finished = subprocess.run([sys.executable, "-c", program], cwd=ROOT / "tests", capture_output=True, text=True,
                              timeout=300, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert finished.returncode == 0, finished.stderr
    assert finished.stdout.split() == ["False", "False", "False"]


def test_a_folder_without_te_is_the_tiers_reason(monkeypatch, tmp_path):
    monkeypatch.setenv(te_on_cpu.FOLDER_VARIABLE, str(tmp_path))
    assert f"not installed for the CPU tier in {tmp_path}" in te_on_cpu.unusable_reason()
    inputs = synthetic_inputs(SHAPES["window"], seed=0, device=CPU, variant="model-like")
    with pytest.raises(ImplementationUnavailable, match="not installed for the CPU tier"):
        TE_UNFUSED.run(inputs)


@pytest.mark.parametrize("recipe_id", RECIPES)
def test_the_te_cpu_tier_passes_on_every_attention_case(recipe_id):
    (lever,) = attention.te_cpu_tier(recipe_id, LeverOptions())
    required = [case for case in lever.cases if case.required]
    assert required
    for case in required:
        result = run_case(lever, case)
        assert result.status == "pass", (case.id, result.failures)
        assert result.default.backend == "te-unfused"
