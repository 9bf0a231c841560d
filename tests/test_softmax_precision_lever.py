"""The attention-softmax-precision lever: Megatron's DotProductAttention on the CPU (its shims), its
FP32-softmax path against the eager unfused path, the BF16 softmax, the controls, the tiers.

Tests marked `megatron` run megatron-core's code and skip with the reason where it is not
importable. Shapes come from the seed recipes at TEST_SCALE, a smaller scale than the smoke one
(one key-value group; the windowed kind's sequence its window and 32 tokens more, the others' 256).
"""

import re
import sys
from dataclasses import replace

import pytest
import torch

from correctness.attention import softmax_precision_lever as softmax_precision
from correctness.attention.eager import EagerUnfused
from correctness.attention.inputs import synthetic_inputs
from correctness.attention.megatron_softmax import MegatronAttention, megatron_attention_on_cpu
from correctness.attention.shapes import attention_shape
from correctness.shapes import Scale, SMOKE_SCALE
from correctness.errors import ImplementationUnavailable
from correctness.fixtures import recipe_path
from correctness.harness import run_case
from correctness.lever import LeverOptions, NotApplicable
from correctness.models import facts_for
from correctness.recipes import load_recipe
from correctness.registry import KNOWN_LEVERS
from correctness import tiers

GEMMA_RECIPE = "gemma-4-31b/h100/attune-tp2-pp4-split13"
NEMOTRON_RECIPE = "nemotron-3-super-120b-a12b/h200/attune-tp4-pp2-ep8-mt16k"
RECIPES = (GEMMA_RECIPE, NEMOTRON_RECIPE)
TEST_SCALE = Scale(name="test", kv_groups=1, seq_len=256, past_window=32, rows=1)
CPU = torch.device("cpu")
FP32 = MegatronAttention(softmax_in_fp32=True)
BF16 = MegatronAttention(softmax_in_fp32=False)


def shapes(recipe_id, scale=TEST_SCALE):
    recipe = load_recipe(recipe_path(recipe_id))
    model = facts_for(recipe, None)
    return [attention_shape(recipe, model, kind, scale) for kind in model.attention_kinds]


SHAPES = {shape.id: shape for recipe_id in RECIPES for shape in shapes(recipe_id)}


def inputs_of(shape, seed=0, variant="model-like"):
    return synthetic_inputs(shape, seed, CPU, variant)


# --- the Megatron path against the eager unfused path --------------------------------------------


@pytest.mark.megatron
@pytest.mark.parametrize("shape_id", sorted(SHAPES))
def test_fp32_softmax_is_bitwise_the_eager_unfused_path(shape_id):
    """Both compute BF16 logits by a GEMM with FP32 accumulation and the scale folded in (on the CPU
    the same LowPrecisionGemm), K and V repeated per head, -10000 at masked keys in FP32, the FP32
    softmax rounded to BF16, and the BF16 product with V; gradients by autograd through the same
    operations. Measured bitwise equal on every tensor (Gemma's sliding and global layers, BSHD;
    Nemotron's one THD row)."""
    inputs = inputs_of(SHAPES[shape_id])
    megatron = FP32.run(inputs)
    eager = EagerUnfused().run(inputs)
    assert megatron.backend == "megatron-torch-softmax (fp32)"
    assert set(megatron.tensors) == set(eager.tensors) == {"out", "dq", "dk", "dv"}
    for name, tensor in eager.tensors.items():
        assert torch.equal(megatron.tensors[name], tensor), name


@pytest.mark.slow(reason="the equality at the component test's own shapes (Gemma's smoke scale: a global layer at 768 "
                         "positions)")
@pytest.mark.megatron
def test_fp32_softmax_equals_eager_at_the_smoke_shapes():
    """The same at the Gemma smoke scale the component test runs (one windowed, one global layer)."""
    for shape in shapes(GEMMA_RECIPE, SMOKE_SCALE):
        inputs = inputs_of(shape, variant="window-edge" if shape.window else "model-like")
        megatron, eager = FP32.run(inputs).tensors, EagerUnfused().run(inputs).tensors
        assert all(torch.equal(megatron[name], eager[name]) for name in eager), shape.id


@pytest.mark.megatron
@pytest.mark.parametrize("shape_id", sorted(SHAPES))
def test_bf16_softmax_changes_only_the_backward_through_it(shape_id):
    """torch's softmax of BF16 logits accumulates in FP32 and rounds once, as the FP32 path rounds
    its probabilities: out and dv are bitwise the FP32 softmax's. Its backward starts from the BF16
    probabilities autograd saved, so dq and dk differ."""
    inputs = inputs_of(SHAPES[shape_id])
    default, candidate = FP32.run(inputs), BF16.run(inputs)
    assert candidate.backend == "megatron-torch-softmax (bf16)"
    assert candidate.details["attention_softmax_in_fp32"] is False
    assert torch.equal(candidate.tensors["out"], default.tensors["out"])
    assert torch.equal(candidate.tensors["dv"], default.tensors["dv"])
    assert not torch.equal(candidate.tensors["dq"], default.tensors["dq"])
    assert not torch.equal(candidate.tensors["dk"], default.tensors["dk"])


@pytest.mark.megatron
def test_the_window_is_megatrons_own_mask():
    """The sliding-window layer's mask comes from Megatron's get_sliding_window_causal_mask, which
    the run reports; a window one key wider changes the output."""
    shape = next(s for s in SHAPES.values() if s.window is not None)
    inputs = inputs_of(shape, variant="window-edge")
    run = BF16.run(inputs)
    assert run.details["window_size"] == list(shape.window)
    wider = BF16.run(inputs.with_shape(window=(shape.window[0] + 1, 0)))
    assert not torch.equal(run.tensors["out"], wider.tensors["out"])


# --- the shims -----------------------------------------------------------------------------------


@pytest.mark.megatron
def test_shims_apply_only_inside_the_context():
    import megatron.core.tensor_parallel as tensor_parallel
    from megatron.core import parallel_state

    current_device, tracker = torch.cuda.current_device, tensor_parallel.get_cuda_rng_tracker
    with megatron_attention_on_cpu():
        assert torch.cuda.current_device() == "cpu"
        assert torch.ones(2, device="cuda").device.type == "cpu"
        a = torch.randn(2, 3, 4).bfloat16()
        product = torch.bmm(a, a.transpose(1, 2))
        expected = torch.bmm(a.float(), a.float().transpose(1, 2)).bfloat16()
        assert torch.equal(product, expected)
        with tensor_parallel.get_cuda_rng_tracker().fork():
            pass
    assert torch.cuda.current_device is current_device
    assert tensor_parallel.get_cuda_rng_tracker is tracker
    with pytest.raises((RuntimeError, AssertionError)):
        torch.ones(2, device="cuda")
    BF16.run(inputs_of(next(iter(SHAPES.values()))))
    assert parallel_state._GLOBAL_MEMORY_BUFFER is None  # created for the run, removed after


@pytest.mark.megatron
def test_apply_query_key_layer_scaling_forces_the_fp32_softmax():
    """Megatron's TransformerConfig sets attention_softmax_in_fp32 where layer scaling is on, so a
    recipe with --apply-query-key-layer-scaling has no BF16 softmax: the lever does not apply."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=8, kv_channels=8,
                               apply_query_key_layer_scaling=True, attention_softmax_in_fp32=False)
    assert config.attention_softmax_in_fp32 is True
    recipe = load_recipe(recipe_path(GEMMA_RECIPE))
    run = recipe.data["run"].replace("--attention-softmax-in-fp32", "--attention-softmax-in-fp32 --apply-query-key-layer-scaling")
    scaled = replace(recipe, data={**recipe.data, "run": run})
    with pytest.raises(NotApplicable, match="apply-query-key-layer-scaling"):
        softmax_precision.cpu_tier(GEMMA_RECIPE, LeverOptions(recipe=scaled))


def test_features_the_module_lacks_are_refused():
    shape = SHAPES[sorted(SHAPES)[0]]
    inputs = inputs_of(shape)
    for changed, why in (
        (inputs.with_shape(softcap=50.0), "softcap"),
        (inputs.with_shape(window=(3, 2)), "window"),
        (inputs.with_shape(dtype="fp32"), "BF16 and FP16"),
    ):
        with pytest.raises(ImplementationUnavailable, match=why):
            BF16.run(changed)


def test_without_megatron_core_the_path_is_unavailable(monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron.core", None)
    with pytest.raises(ImplementationUnavailable, match="megatron-core is not usable here"):
        BF16.run(inputs_of(next(iter(SHAPES.values()))))


# --- the lever: controls, tiers, both recipes ----------------------------------------------------


@pytest.mark.megatron
@pytest.mark.parametrize("recipe_id", RECIPES, ids=["gemma", "nemotron"])
def test_the_lever_passes_and_its_controls_fail(recipe_id):
    lever = softmax_precision.cpu_tier(recipe_id, LeverOptions(), scale=TEST_SCALE)[0]
    synthetic = [case for case in lever.cases if case.source == "synthetic"]
    applied = set()
    for case in synthetic:
        result = run_case(lever, case)
        assert result.status == "pass", (case.id, result.failures)
        for control in result.controls:
            if control.judgement is not None:
                applied.add(control.name)
                assert control.fails_bound and control.power > 2, (case.id, control.name, control.power)
        mask = next(c for c in result.controls if c.name == "mask ignored")
        assert mask.judgement is not None  # it applies to every case
    expected = {"wrong softmax scale", "mask ignored"}
    if any(case.variant == "window-edge" for case in synthetic):
        expected |= {"window off by one", "window one short"}
    assert applied == expected


@pytest.mark.parametrize("recipe_id", RECIPES, ids=["gemma", "nemotron"])
def test_the_lever_builds_from_both_recipes(recipe_id):
    cpu = softmax_precision.cpu_tier(recipe_id, LeverOptions())
    gpu = softmax_precision.gpu_tier(recipe_id, LeverOptions())
    assert [lever.tier for lever in cpu + gpu] == [tiers.MEGATRON_CPU, tiers.GPU]
    for lever in cpu + gpu:
        assert lever.name == softmax_precision.NAME and lever.version == softmax_precision.VERSION
        assert not lever.candidate.softmax_in_fp32 and lever.default.softmax_in_fp32
        assert lever.candidate.masked_softmax_fusion == lever.default.masked_softmax_fusion
        assert {control.name for control in lever.controls} >= {"mask ignored", "wrong softmax scale"}
        assert [case.seed for case in lever.cases if case.variant == "model-like"] == [0] * len(
            {case.shape.layer_kind for case in lever.cases})
    assert cpu[0].candidate.masked_softmax_fusion is False  # the fused kernel is CUDA only
    # Neither recipe says --no-masked-softmax-fusion: Megatron-LM's fusion is on on the GPU.
    assert gpu[0].candidate.masked_softmax_fusion is True
    assert gpu[0].cases[0].shape.scale == "recipe"
    fusion = softmax_precision.fusion_gpu_tier(recipe_id, LeverOptions())[0]
    assert fusion.candidate.masked_softmax_fusion and not fusion.default.masked_softmax_fusion
    assert fusion.candidate.softmax_in_fp32 and fusion.default.softmax_in_fp32
    assert fusion.cases[0].shape.scale == "smoke" and fusion.record_id != gpu[0].record_id
    mask = next(control for control in fusion.controls if control.name == "mask ignored")
    assert mask.implementation.masked_softmax_fusion is False  # the fused kernel takes no mask function


def test_the_description_names_no_other_levers_test():
    """A recipe entry's title is the lever's description; classify finds a lever by its regexes, so
    this lever's description must match none of another lever's."""
    descriptions = [softmax_precision.DESCRIPTION]
    descriptions += [lever.description for lever in softmax_precision.gpu_tier(GEMMA_RECIPE, LeverOptions())]
    descriptions.append(softmax_precision.FUSION_DESCRIPTION)
    for name, spec in KNOWN_LEVERS.items():
        if name == softmax_precision.NAME:
            continue
        for pattern in spec.titles:
            assert not any(re.search(pattern, text, re.IGNORECASE) for text in descriptions), (name, pattern)
