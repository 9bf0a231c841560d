"""What common architectures add to attention, through the reference, the paths and the lever:
a logit softcap (Gemma 2), a value head dim of its own (MLA: DeepSeek-V3, Moonlight), attention sinks
(GPT-OSS) and a softmax scale that is neither 1.0 nor 1/sqrt(head_dim) (Gemma 2's
query_pre_attn_scalar).

The FP64 reference is checked against two independent computations: torch SDPA's math backend in
FP64 where it can express the feature (another value head dim; sinks as one more key whose logit is
a float mask column, dsink from autograd through the mask), and a brute-force loop over every
query on its own, gradients by autograd (every feature, the softcap included).
"""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel

from correctness import tiers
from correctness.attention import backend_lever as attention
from correctness.attention.eager import EagerUnfused
from correctness.attention.inputs import synthetic_inputs
from correctness.attention.reference import Fp64Reference
from correctness.attention.sdpa import Sdpa
from correctness.shapes import SMOKE_SCALE
from correctness.attention.te import TransformerEngine
from correctness.errors import ImplementationUnavailable
from correctness.harness import run_case
from correctness.lever import LeverOptions
from correctness.models import ModelFacts, load_model
from correctness.recipes import lever_recipe
from correctness.rule import DEFAULT_RULE
from attention_shapes import tiny_shape
from numerics import FP32_AGREEMENT, relative_l2_error
from references.attention import attention as reference_attention

CPU = torch.device("cpu")
REFERENCE_AGREEMENT = 1e-10
"""Largest relative L2 error between the FP64 reference and an independent FP64 computation."""

MAX_EXAMPLES = 25
"""Hypothesis examples per property: the brute-force loop is slow, and the existing reference tests
cover the shapes and layouts without features in depth."""

GEMMA = "gemma-4-31b/h100/attune-tp2-pp4-split13"


# ---------------------------------------------------------------------------
# Independent computations.


def visible(seq_len, causal, window):
    i, j = torch.arange(seq_len)[:, None], torch.arange(seq_len)[None, :]
    left, right = window or (-1, -1)
    mask = torch.ones(seq_len, seq_len, dtype=torch.bool)
    if causal:
        mask &= j <= i
    if left >= 0:
        mask &= j >= i - left
    if right >= 0:
        mask &= j <= i + right
    return mask


def sdpa_math(q, k, v, grad_out, *, softmax_scale, causal, window, sinks=None):
    """BSHD, FP64, SDPA's math backend; sinks as a zero key whose logit is the mask's last column."""
    leaves = [x.double().transpose(1, 2).detach().requires_grad_() for x in (q, k, v)]
    qh, kh, vh = leaves
    seq_len, heads = q.shape[1], q.shape[2]
    mask = torch.zeros(seq_len, seq_len, dtype=torch.float64).masked_fill(~visible(seq_len, causal, window), -math.inf)
    sink = None
    if sinks is not None:
        sink = sinks.double().detach().requires_grad_()
        kh, vh = (torch.cat((x, torch.zeros_like(x[:, :, :1])), dim=2) for x in (kh, vh))
        sink_column = sink.reshape(1, heads, 1, 1).expand(1, heads, seq_len, 1)
        mask = torch.cat((mask.expand(1, heads, -1, -1), sink_column), dim=-1)
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=softmax_scale, enable_gqa=True)
    out.backward(grad_out.double().transpose(1, 2))
    result = {"out": out.detach().transpose(1, 2)}
    result.update((name, x.grad.transpose(1, 2)) for name, x in zip(("dq", "dk", "dv"), leaves))
    if sink is not None:
        result["dsink"] = sink.grad
    return result


def brute_force(q, k, v, grad_out, *, softmax_scale, causal, window, softcap=None, sinks=None):
    """BSHD, FP64: every (row, query, head) on its own, the formula written out; gradients by autograd."""
    qq, kk, vv = (x.double().detach().requires_grad_() for x in (q, k, v))
    sink = None if sinks is None else sinks.double().detach().requires_grad_()
    batch, seq_len, heads, _ = q.shape
    per_group = heads // k.shape[2]
    sees = visible(seq_len, causal, window)
    outs, loss = torch.zeros(batch, seq_len, heads, v.shape[-1], dtype=torch.float64), 0.0
    for b in range(batch):
        for i in range(seq_len):
            keys = [j for j in range(seq_len) if sees[i, j]]
            for h in range(heads):
                g = h // per_group
                logits = torch.stack([softmax_scale * torch.dot(qq[b, i, h], kk[b, j, g]) for j in keys])
                if softcap is not None:
                    logits = softcap * torch.tanh(logits / softcap)
                if sink is not None:
                    logits = torch.cat((logits, sink[h : h + 1]))
                weights = torch.softmax(logits, dim=0)
                out = sum(weights[n] * vv[b, j, g] for n, j in enumerate(keys))
                outs[b, i, h] = out.detach()
                loss = loss + torch.dot(out, grad_out[b, i, h].double())
    loss.backward()
    result = {"out": outs, "dq": qq.grad, "dk": kk.grad, "dv": vv.grad}
    if sink is not None:
        result["dsink"] = sink.grad
    return result


def assert_agrees(actual, expected, q, k, v, grad_out, softmax_scale):
    """Relative L2 agreement per tensor. Where the exact dq or dk is zero (every query sees one key
    and there is no sink), the reference keeps rounding of D_i - dP_ii; there the error is taken
    relative to softmax_scale |dO| |v| |k or q|."""
    assert set(actual) == set(expected)
    cancellation = abs(softmax_scale) * grad_out.double().norm() * v.double().norm()
    zero_scale = {"dq": cancellation * k.double().norm(), "dk": cancellation * q.double().norm()}
    errors = {}
    for name, x in expected.items():
        scale = x.norm() if x.norm() > 0 else zero_scale.get(name, 0.0)
        errors[name] = ((actual[name] - x).norm() / scale).item() if scale > 0 else (actual[name] - x).norm().item()
    assert all(error <= REFERENCE_AGREEMENT for error in errors.values()), errors


@dataclasses.dataclass
class Features:
    batch: int
    seq_len: int
    heads: int
    groups: int
    head_dim: int
    v_head_dim: int
    causal: bool
    window: tuple[int, int] | None
    softmax_scale: float
    softcap: float | None
    sinks: bool
    block_size: int | None
    seed: int

    def tensors(self):
        generator = torch.Generator().manual_seed(self.seed)

        def normal(*size):
            return torch.randn(*size, generator=generator, dtype=torch.float64)

        b, s, h, g = self.batch, self.seq_len, self.heads, self.groups
        sinks = 2.0 * normal(h) if self.sinks else None
        return normal(b, s, h, self.head_dim), normal(b, s, g, self.head_dim), normal(b, s, g, self.v_head_dim), \
            normal(b, s, h, self.v_head_dim), sinks

    def kwargs(self):
        return {"softmax_scale": self.softmax_scale, "causal": self.causal, "window": self.window}


@st.composite
def features(draw, softcap=True):
    groups = draw(st.integers(1, 3))
    heads = groups * draw(st.integers(1, 3))
    head_dim, v_head_dim = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    causal = draw(st.booleans())
    left = st.integers(-1, 4)
    window = draw(st.one_of(st.none(), st.tuples(left, st.just(0) if causal else left)))
    seq_len = draw(st.integers(1, 10))
    return Features(
        batch=draw(st.integers(1, 2)), seq_len=seq_len, heads=heads, groups=groups, head_dim=head_dim,
        v_head_dim=v_head_dim, causal=causal, window=window,
        softmax_scale=draw(st.floats(0.1, 2.0)) / math.sqrt(head_dim),
        # Caps of the logits' own size (about 1), so that tanh bends them.
        softcap=draw(st.one_of(st.none(), st.floats(0.3, 3.0))) if softcap else None,
        sinks=draw(st.booleans()),
        block_size=draw(st.one_of(st.none(), st.integers(1, seq_len + 1))),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


@settings(deadline=None, max_examples=MAX_EXAMPLES)
@given(features(softcap=False))
def test_reference_matches_sdpa_math_with_value_head_dims_and_sinks(case):
    q, k, v, grad_out, sinks = case.tensors()
    actual = reference_attention(q, k, v, grad_out, sinks=sinks, block_size=case.block_size, **case.kwargs())
    expected = sdpa_math(q, k, v, grad_out, sinks=sinks, **case.kwargs())
    assert_agrees(actual, expected, q, k, v, grad_out, case.softmax_scale)


@settings(deadline=None, max_examples=MAX_EXAMPLES)
@given(features())
def test_reference_matches_a_brute_force_loop_with_every_feature(case):
    q, k, v, grad_out, sinks = case.tensors()
    actual = reference_attention(q, k, v, grad_out, softcap=case.softcap, sinks=sinks, block_size=case.block_size,
                                 **case.kwargs())
    expected = brute_force(q, k, v, grad_out, softcap=case.softcap, sinks=sinks, **case.kwargs())
    assert_agrees(actual, expected, q, k, v, grad_out, case.softmax_scale)


def test_reference_thd_with_sinks_sums_dsink_over_the_sequences():
    case = Features(batch=1, seq_len=9, heads=4, groups=2, head_dim=5, v_head_dim=3, causal=True, window=(2, 0),
                    softmax_scale=0.4, softcap=1.5, sinks=True, block_size=None, seed=4)
    q, k, v, grad_out, sinks = case.tensors()
    packed = reference_attention(q[0], k[0], v[0], grad_out[0], cu_seqlens=[0, 4, 9], softcap=1.5, sinks=sinks,
                                 **case.kwargs())
    rows = [reference_attention(*(x[:, a:b] for x in (q, k, v, grad_out)), softcap=1.5, sinks=sinks, **case.kwargs())
            for a, b in ((0, 4), (4, 9))]
    assert relative_l2_error(packed["dsink"], rows[0]["dsink"] + rows[1]["dsink"])[0] < REFERENCE_AGREEMENT
    assert relative_l2_error(packed["out"], torch.cat([r["out"][0] for r in rows]))[0] < REFERENCE_AGREEMENT


@pytest.mark.parametrize(
    "change, message",
    [
        ({"softcap": 0.0}, r"^softcap must be None or a finite positive number"),
        ({"softcap": math.inf}, r"^softcap must be None or a finite positive number"),
        ({"sinks": torch.zeros(3)}, r"^sinks must be a floating-point torch.Tensor of shape \(4,\)"),
        ({"sinks": torch.tensor([0.0, 1.0, math.nan, 0.0])}, r"^sinks must be finite"),
        ({"v": torch.zeros(1, 6, 1, 2)}, r"^k and v must have the same shape but for the head dim"),
        ({"grad_out": torch.zeros(1, 6, 4, 3)}, r"^grad_out must have q's shape with v's head dim"),
    ],
)
def test_invalid_feature_inputs_raise(change, message):
    arguments = {"q": torch.zeros(1, 6, 4, 3), "k": torch.zeros(1, 6, 2, 3), "v": torch.zeros(1, 6, 2, 2),
                 "grad_out": torch.zeros(1, 6, 4, 2), "softmax_scale": 0.5, **change}
    with pytest.raises(ValueError, match=message):
        reference_attention(**arguments)


# ---------------------------------------------------------------------------
# Model facts, shapes and inputs.


def toy_facts(name: str, attention_facts: dict, kinds: dict) -> ModelFacts:
    short = name.lower()
    return ModelFacts(name=name, short_name=short, data={
        "name": name, "short_name": short, "layers": len(kinds), "layer_pattern": {"repeat": list(kinds)},
        "attention": {"logit_softcap": None, **attention_facts, "kinds": kinds},
    })


# Moonlight / DeepSeek-V3's MLA: q/k head dim 192 (128 nope + 64 rope), V 128.
MLA = toy_facts("Toy-MLA", {"query_heads": 8, "softmax_scale": "inverse_sqrt_head_dim"},
                {"mla": {"kv_heads": 8, "head_dim": 192, "v_head_dim": 128, "window": None}})
# GPT-OSS: sinks, head dim 64, a 128-token window.
SINKS = toy_facts("Toy-Sinks", {"query_heads": 16, "softmax_scale": "inverse_sqrt_head_dim", "sinks": True},
                  {"sliding": {"kv_heads": 4, "head_dim": 64, "window": 128}})
# Gemma 2 27B: softcap 50, head dim 128, scale query_pre_attn_scalar ** -0.5 = 144 ** -0.5, which is
# neither 1.0 nor 1/sqrt(128).
SOFTCAP = toy_facts("Toy-Softcap", {"query_heads": 8, "softmax_scale": 144**-0.5, "logit_softcap": 50.0},
                    {"global": {"kv_heads": 4, "head_dim": 128, "window": None}})


def test_model_facts_give_the_features_and_default_to_none():
    mla, sinks, softcap = MLA.attention_kind("mla"), SINKS.attention_kind("sliding"), SOFTCAP.attention_kind("global")
    assert (mla.head_dim, mla.v_head_dim, mla.logit_softcap, mla.sinks) == (192, 128, None, False)
    assert (sinks.v_head_dim, sinks.sinks) == (64, True)
    assert (softcap.logit_softcap, softcap.softmax_scale) == (50.0, 144**-0.5)
    for model in ("Gemma-4-31B", "Nemotron-3-Super-120B-A12B"):
        facts = load_model(model)
        for kind in facts.attention_kinds:
            found = facts.attention_kind(kind)
            assert (found.v_head_dim, found.logit_softcap, found.sinks) == (found.head_dim, None, False)


def test_case_ids_name_only_the_features_that_are_on():
    assert tiny_shape().id == "toy-sliding-s13-b2bshd-h4-g2-d8-w4-fp32"
    assert tiny_shape(v_head_dim=8).id == tiny_shape().id
    featured = tiny_shape(v_head_dim=5, softcap=50.0, sinks=True)
    assert featured.id == "toy-sliding-s13-b2bshd-h4-g2-d8-dv5-w4-cap50-sink-fp32"


def test_sinks_are_drawn_after_the_other_tensors():
    plain = synthetic_inputs(tiny_shape(dtype="bf16"), seed=2, device=CPU, variant="model-like")
    with_sinks = synthetic_inputs(tiny_shape(dtype="bf16", sinks=True), seed=2, device=CPU, variant="model-like")
    for name in ("q", "k", "v", "grad_out"):
        assert torch.equal(getattr(plain, name), getattr(with_sinks, name))
    assert plain.sinks is None and with_sinks.sinks.shape == (4,) and with_sinks.sinks.dtype == torch.bfloat16


def test_beyond_cap_logits_reach_past_the_cap():
    shape = tiny_shape(head_dim=128, softmax_scale=144**-0.5, softcap=50.0, seq_len=64, batch=1)
    inputs = synthetic_inputs(shape, seed=0, device=CPU, variant="beyond-cap")
    model_like = synthetic_inputs(shape, seed=0, device=CPU, variant="model-like")
    logits, plain = ((x.q[0, :, :2] @ x.k[0, :, 0].T) * shape.softmax_scale for x in (inputs, model_like))
    assert 0.2 < (logits.abs() > shape.softcap).float().mean() < 0.5
    assert plain.abs().max() < 0.2 * shape.softcap


# ---------------------------------------------------------------------------
# The paths at a tiny shape, in FP32: rounding alone apart from the reference.


FEATURE_SHAPES = {
    "mla": tiny_shape(v_head_dim=5),
    "sinks": tiny_shape(sinks=True),
    "sinks-thd": tiny_shape(sinks=True, qkv_format="thd"),
    "sinks-mla-global": tiny_shape(sinks=True, v_head_dim=6, window=None),
    "softcap": tiny_shape(softcap=2.0),
}


def feature_inputs(name):
    shape = FEATURE_SHAPES[name]
    return synthetic_inputs(shape, seed=3, device=CPU, variant="beyond-cap" if shape.softcap else "model-like")


@pytest.mark.parametrize("name", sorted(FEATURE_SHAPES))
@pytest.mark.parametrize("path", [EagerUnfused(), Sdpa("flash")], ids=lambda p: p.name)
def test_paths_agree_with_the_reference_or_refuse(name, path):
    inputs = feature_inputs(name)
    reference = Fp64Reference().run(inputs).tensors
    if isinstance(path, Sdpa) and inputs.shape.softcap is not None:
        with pytest.raises(ImplementationUnavailable, match="cannot apply a logit softcap"):
            path.run(inputs)
        return
    output = path.run(inputs)
    assert set(output.tensors) == set(reference)
    for tensor, expected in reference.items():
        error, kind = relative_l2_error(output.tensors[tensor], expected)
        assert kind == "relative" and error < FP32_AGREEMENT, f"{path.name} {tensor} on {name}: {error:.2e}"
    if inputs.shape.v_head_dim != inputs.shape.head_dim and isinstance(path, Sdpa):
        assert "equal_head_dims" in output.details  # the flash kernel wants one head dim


def test_sdpa_refuses_sinks_where_it_cannot_read_the_kernels_log_sum_exp():
    with pytest.raises(ImplementationUnavailable, match="SDPA has no sinks"):
        Sdpa("math").run(feature_inputs("sinks"))


def test_te_refuses_a_softcap_naming_it():
    with pytest.raises(ImplementationUnavailable, match="no softcap on any backend"):
        TransformerEngine("auto").run(feature_inputs("softcap"))


@pytest.mark.parametrize(("name", "control"), [("softcap", "softcap ignored"), ("sinks", "sink ignored"),
                                               ("sinks-thd", "sink ignored"), ("mla", "wrong softmax scale")])
def test_controls_fail_the_rule_at_a_tiny_shape(name, control):
    inputs = feature_inputs(name)
    reference = Fp64Reference().run(inputs).tensors
    default = EagerUnfused().run(inputs).tensors
    wrong = next(c for c in attention.controls(EagerUnfused()) if c.name == control)
    tensors = wrong.implementation.run(inputs).tensors
    assert set(tensors) == set(reference)
    over = {name: relative_l2_error(tensors[name], ref)[0] / DEFAULT_RULE.bound(relative_l2_error(default[name], ref)[0])
            for name, ref in reference.items()}
    assert max(over.values()) > 1.0, over


def test_wrong_scale_control_takes_the_usual_scale_where_the_model_uses_neither():
    shape = tiny_shape(head_dim=128, softmax_scale=144**-0.5)
    assert attention.wrong_scale(shape) == 1 / math.sqrt(128)


# ---------------------------------------------------------------------------
# The lever at smoke scale, on synthetic model facts.


def feature_lever(facts: ModelFacts, candidate):
    fixture = lever_recipe(GEMMA)
    recipe = dataclasses.replace(fixture, data={**fixture.data, "model": facts.name})
    return attention.attention_backend_lever(
        recipe=recipe, tier=tiers.CPU, scale=SMOKE_SCALE, candidate=candidate, default=EagerUnfused(),
        options=LeverOptions(model=facts), description=f"{candidate.name} on {facts.name}",
    )


def judged(lever, variants):
    """The lever's first synthetic case of each variant, run."""
    cases = {}
    for case in lever.cases:
        if case.source == "synthetic" and case.variant in variants:
            cases.setdefault(case.variant, case)
    return {variant: run_case(lever, case) for variant, case in cases.items()}


def controls_of(result):
    return {control.name: control for control in result.controls}


def test_mla_smoke_cases_pass_with_the_flash_kernel():
    lever = feature_lever(MLA, Sdpa("flash"))
    assert all("-d192-dv128-" in case.id for case in lever.cases)
    result = judged(lever, {"model-like"})["model-like"]
    assert result.status == "pass", result.failures
    assert "equal_head_dims" in result.candidate.run.details
    assert controls_of(result)["wrong softmax scale"].fails_bound


def test_sink_smoke_cases_pass_with_the_flash_kernel_and_the_sink_control_fails():
    lever = feature_lever(SINKS, Sdpa("flash"))
    results = judged(lever, {"model-like", "window-edge"})
    for variant, result in results.items():
        assert result.status == "pass", (variant, result.failures)
        assert {t.tensor for t in result.candidate.tensors} == {"out", "dq", "dk", "dv", "dsink"}
        sink = controls_of(result)["sink ignored"]
        # Not on the zero dsink alone: the output moves outside the bound too.
        out = next(t for t in sink.judgement.tensors if t.tensor == "out")
        assert sink.fails_bound and out.whole_error_over_bound > 1
        assert "no logit softcap" in controls_of(result)["softcap ignored"].inapplicable_reason


def test_softcap_smoke_cases_skip_on_sdpa_and_their_controls_fail():
    skipped = judged(feature_lever(SOFTCAP, Sdpa("flash")), {"model-like"})["model-like"]
    assert skipped.status == "skip" and "softcap" in skipped.skip_reason
    # No candidate here applies a softcap: the default judged as the candidate measures the controls.
    results = judged(feature_lever(SOFTCAP, EagerUnfused()), {"model-like", "beyond-cap"})
    for result in results.values():
        assert result.status == "no kernel change", result.failures
        assert controls_of(result)["wrong softmax scale"].fails_bound
    assert "beyond-cap case carries" in controls_of(results["model-like"])["softcap ignored"].inapplicable_reason
    assert controls_of(results["beyond-cap"])["softcap ignored"].fails_bound
