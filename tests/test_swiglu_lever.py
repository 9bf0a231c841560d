"""The bias-swiglu-fusion lever: its FP64 reference against autograd, where it applies and the
shapes it takes from the recipe and the model facts, and cases the fixture recipes do not reach
(a bias, the routed experts' weights), run with Megatron's jit_fuser eager (as under
TORCH_COMPILE_DISABLE=1) so that they cost no compilation; the compiled path runs in
component_tests/test_bias_swiglu_fusion.py."""

from dataclasses import replace

import pytest
import torch
from torch import _dynamo

from correctness import tiers
from correctness.harness import run_case
from correctness.lever import Case, LeverOptions, NotApplicable
from correctness.swiglu import lever as swiglu
from correctness.swiglu.paths import FUSED, MegatronSwiglu, SwigluInputs
from correctness.models import facts_for
from correctness.recipes import lever_recipe
from references.swiglu import gated_unit, gated_unit_backward

GEMMA = "gemma-4-31b/h100/attune-tp2-pp4-split13"
NEMOTRON = "nemotron-3-super-120b-a12b/h200/attune-tp4-pp2-ep8-mt16k"
GPT_OSS = "gpt-oss-20b/h100/example-tp2-ep4-offload06"
LLAMA = "llama-3.1-8b/h100/example-tp2-pp1-offload05"
MOONLIGHT = "moonlight-16b-a3b/h100/example-tp2-ep4-offload07"
QWEN_MOE = "qwen3-30b-a3b/h100/example-tp2-ep4-offload07"



@pytest.fixture
def eager_jit_fuser():
    """Megatron's jit_fuser functions run eagerly inside (what TORCH_COMPILE_DISABLE=1 does)."""
    with _dynamo.config.patch(disable=True):
        yield


def _autograd_unit(x, bias, probs, activation):
    gate, linear = (x + bias if bias is not None else x).chunk(2, dim=-1)
    act = torch.nn.functional.silu(gate) if activation == "silu" else torch.nn.functional.gelu(gate, approximate="tanh")
    out = act * linear
    return out if probs is None else out * probs


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("with_bias, with_probs", [(False, False), (True, False), (False, True), (True, True)])
def test_reference_matches_autograd_in_fp64(activation, with_bias, with_probs):
    """The closed-form gradients equal autograd's through torch's own SiLU / tanh GELU in FP64."""
    generator = torch.Generator().manual_seed(3)
    x = (4 * torch.randn(7, 3, 10, generator=generator, dtype=torch.float64)).requires_grad_()
    bias = torch.randn(10, generator=generator, dtype=torch.float64).requires_grad_() if with_bias else None
    probs = torch.rand(7, 3, 1, generator=generator, dtype=torch.float64).requires_grad_() if with_probs else None
    grad = torch.randn(7, 3, 5, generator=generator, dtype=torch.float64)
    expected = _autograd_unit(x, bias, probs, activation)
    expected.backward(grad)
    out = gated_unit(x.detach(), None if bias is None else bias.detach(), None if probs is None else probs.detach(), activation)
    dx, dbias, dprobs = gated_unit_backward(x.detach(), grad, None if bias is None else bias.detach(),
                                            None if probs is None else probs.detach(), activation)
    torch.testing.assert_close(out, expected.detach(), rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(dx, x.grad, rtol=1e-13, atol=1e-13)
    assert (dbias is None) == (bias is None) and (dprobs is None) == (probs is None)
    if bias is not None:
        torch.testing.assert_close(dbias, bias.grad, rtol=1e-12, atol=1e-12)
    if probs is not None:
        torch.testing.assert_close(dprobs, probs.grad, rtol=1e-12, atol=1e-12)


def test_reference_refuses_an_odd_width_and_a_bias_of_another_width():
    with pytest.raises(ValueError, match="two equal halves"):
        gated_unit(torch.zeros(2, 5))
    with pytest.raises(ValueError, match="bias of shape"):
        gated_unit(torch.zeros(2, 6), torch.zeros(4))


@pytest.mark.parametrize("recipe, reason", [
    (GEMMA, "Megatron's GeGLU fusion runs only for F.gelu"),
    (NEMOTRON, "MLP is not gated (squared_relu"),
    (GPT_OSS, "quick_gelu (clamp 7.0, offset 1.0), not SwiGLU"),
])
def test_models_without_a_swiglu_are_not_applicable_with_the_reason(recipe, reason):
    with pytest.raises(NotApplicable, match=None) as refused:
        swiglu.cpu_tier(recipe, LeverOptions())
    assert reason in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("recipe, sites", [
    (LLAMA, {"dense": ("ffn_hidden_size", "tp")}),
    (MOONLIGHT, {"dense": ("ffn_hidden_size", "tp"), "shared-expert": ("moe.shared_expert_ffn_hidden_size", "tp"),
                 "experts": ("moe.expert_ffn_hidden_size", "etp")}),
    (QWEN_MOE, {"experts": ("moe.expert_ffn_hidden_size", "etp")}),
])
def test_shapes_come_from_the_recipe_and_the_model_facts(recipe, sites):
    """Each site's half width is the model's FFN width over TP (ETP for the experts), at both
    scales; the smoke scale cuts only the tokens; the experts take the router's dtype."""
    loaded = lever_recipe(recipe)
    model = facts_for(loaded, None)
    for scale in ("recipe", "smoke"):
        shapes = {shape.site: shape for shape in swiglu.swiglu_shapes(loaded, model, scale)}
        assert set(shapes) == set(sites)
        for site, (field, split) in sites.items():
            shape = shapes[site]
            assert shape.ffn_per_rank * int(loaded.field(f"layout.{split}")) == model.field(field) == shape.model_ffn
            positions = loaded.row_tokens if scale == "recipe" else swiglu.SMOKE_TOKENS
            if site == "experts":
                top_k, ep = int(model.field("moe.top_k")), int(loaded.field("layout.ep"))
                assert shape.batch is None and shape.tokens == positions * loaded.rows_per_microbatch * top_k // ep
                assert shape.probs_dtype == "fp32"  # --moe-router-dtype fp32
            else:
                assert (shape.tokens, shape.batch, shape.probs_dtype) == (positions, loaded.rows_per_microbatch, None)
            assert shape.dtype == loaded.precision and not shape.bias  # --disable-bias-linear
    lever = swiglu.cpu_tier(recipe, LeverOptions())[0]
    assert lever.tier == tiers.MEGATRON_CPU and len(lever.cases) == len(sites) * len(swiglu.VARIANTS)


def _case_of(lever, shape, seed=0):
    from functools import partial

    return Case(id=f"{shape.id}-seed{seed}", shape=shape, seed=seed, source="synthetic", variant="unit",
                make_inputs=partial(swiglu.make_inputs, shape, seed))


def _control(result, name):
    return next(control for control in result.controls if control.name == name)


@pytest.mark.megatron
def test_a_bias_and_router_weights_are_judged_and_their_controls_fail(eager_jit_fuser):
    """A dense case with a bias (no fixture recipe has one) and a routed-experts case, run with the
    jit_fuser eager: both pass, every control that applies fails, and the candidate's record says
    it ran eagerly. Eager, the fused forward is Megatron's own silu(a) * b, bitwise the unfused one."""
    lever = swiglu.cpu_tier(MOONLIGHT, LeverOptions())[0]
    dense = next(case.shape for case in lever.cases if case.shape.site == "dense")
    experts = next(case.shape for case in lever.cases if case.shape.site == "experts")
    biased = replace(dense, tokens=16, ffn_per_rank=256, bias=True)
    routed = replace(experts, tokens=48, ffn_per_rank=256)
    for shape, control in ((biased, "bias not added"), (routed, "router weights ignored")):
        result = run_case(lever, _case_of(lever, shape))
        assert result.status == "pass", result.failures
        assert "eager (torch.compile disabled" in result.candidate.run.backend
        judged = {t.tensor: t for t in result.candidate.tensors}
        assert ("grad_bias" in judged) == shape.bias and ("grad_probs" in judged) == (shape.probs_dtype is not None)
        if shape.bias:
            assert judged["out"].bitwise_identical
        assert _control(result, control).fails
        assert all(c.fails for c in result.controls if c.judgement is not None)
        assert all(c.judgement is not None for c in result.controls if c.name != ("router weights ignored" if shape.bias else "bias not added"))


@pytest.mark.megatron
def test_a_bias_on_the_experts_skips_with_megatrons_refusal(eager_jit_fuser):
    generator = torch.Generator().manual_seed(0)
    inputs = SwigluInputs(x=torch.randn(8, 16, generator=generator).bfloat16(), grad=torch.randn(8, 8).bfloat16(),
                          bias=torch.zeros(16).bfloat16(), probs=torch.rand(8, 1))
    from correctness.errors import ImplementationUnavailable

    with pytest.raises(ImplementationUnavailable, match="takes no bias"):
        MegatronSwiglu(FUSED, fused=True).run(inputs)


def _inputs(rows: int, width: int, seed: int) -> SwigluInputs:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 1, 2 * width, generator=generator).to(torch.bfloat16)
    grad = torch.randn(rows, 1, width, generator=generator).to(torch.bfloat16)
    return SwigluInputs(x=x, grad=grad, bias=None, probs=None)


def test_a_cases_compiled_kernel_does_not_depend_on_what_the_process_compiled_before():
    """Megatron's fused function is compiled for each case's inputs alone: run after a case of
    another width (which, without the reset, had dynamo recompile it with dynamic shapes), a case's
    tensors are bitwise those it gets first in the process."""
    fused = MegatronSwiglu(name=FUSED, fused=True)
    first = fused.run(_inputs(64, 1024, seed=0))
    assert first.details["graphs_compiled"] > 0
    fused.run(_inputs(32, 768, seed=1))
    again = fused.run(_inputs(64, 1024, seed=0))
    assert again.details["graphs_compiled"] > 0, "new inputs: compiled afresh"
    assert all(torch.equal(first.tensors[name], again.tensors[name]) for name in first.tensors)
    repeat_inputs = _inputs(64, 1024, seed=0)
    fused.run(repeat_inputs)
    assert fused.run(repeat_inputs).details["graphs_compiled"] == 0, "the same inputs reuse their graphs"
