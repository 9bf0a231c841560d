"""Megatron's CPU/GPU offload split on made-up parameters: the threshold checked before adding, the
walk over decayed weights then 1-D tensors, each backwards, the fraction's bounds, and each of
Megatron's optimizers (dense, expert) split on its own."""

import pytest

from correctness.adam.split import CPU, GPU, offload_order, offload_split, offload_summary
from correctness.megatron.layout import ParamSlice


# --- the split's rules -------------------------------------------------------------------------


def fake(name, numel, index, decayed=True, optimizer=None):
    shape = (numel, 1) if decayed else (numel,)
    extra = {} if optimizer is None else {"optimizer": optimizer}
    return ParamSlice(
        name=name, shape=shape, layer=0, layer_kind=None, kind="row-parallel" if decayed else "norm",
        weight_decay=decayed, index=index, sources=(), fan_in=1, init_mean=0.0, init_std=1.0,
        tp=1, tp_rank=0, scale="recipe", **extra,
    )


def test_split_overshoots_by_at_most_one_tensor():
    params = [fake("a", 10, 0), fake("b", 10, 1), fake("c", 10, 2)]
    split = offload_split(params, 0.5)  # threshold 15: c (0 < 15), b (10 < 15), then 20: a stays
    assert split == {"c": CPU, "b": CPU, "a": GPU}
    assert list(split) == ["c", "b", "a"]


def test_split_checks_before_adding():
    params = [fake("a", 10, 0), fake("b", 10, 1), fake("c", 10, 2)]
    assert offload_split(params, 1 / 3) == {"c": CPU, "b": GPU, "a": GPU}  # 10 < 10 is false
    assert offload_split(params, 0.01) == {"c": CPU, "b": GPU, "a": GPU}  # 0 < 0.3: one whole tensor


def test_split_fraction_zero_and_one():
    params = [fake("w1", 5, 0), fake("n1", 3, 1, decayed=False), fake("w2", 7, 2)]
    assert set(offload_split(params, 0.0).values()) == {GPU}
    assert set(offload_split(params, 1.0).values()) == {CPU}
    assert set(offload_split(params, 1).values()) == {CPU}
    assert offload_split([], 0.8) == {}


def test_split_walks_decayed_then_norms_each_backwards():
    params = [fake("emb", 4, 0), fake("n0", 1, 1, False), fake("w1", 4, 2), fake("n2", 1, 3, False)]
    assert [p.name for p in offload_order(params)] == ["w1", "emb", "n2", "n0"]
    assert offload_split(params, 0.4) == {"w1": CPU, "emb": GPU, "n2": GPU, "n0": GPU}
    assert offload_split(params, 0.5) == {"w1": CPU, "emb": CPU, "n2": GPU, "n0": GPU}


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), float("inf"), "0.8", None, True])
def test_split_rejects_bad_fractions(bad):
    with pytest.raises(ValueError, match=r"^offload fraction .+ (outside \[0, 1\]|is not a number)$"):
        offload_split([fake("a", 1, 0)], bad)


def test_split_rejects_a_name_twice():
    with pytest.raises(ValueError, match="parameter a is listed twice"):
        offload_split([fake("a", 1, 0), fake("a", 1, 1)], 0.5)


# --- the split of several optimizers ---------------------------------------------------------


def test_split_each_optimizer_on_its_own():
    params = [
        fake("a", 10, 0), fake("c", 10, 1, optimizer="expert"), fake("b", 10, 2),
        fake("d", 10, 3, optimizer="expert"), fake("e", 10, 4, optimizer="expert"),
    ]
    # dense: threshold 10: b (0 < 10), then a (10 < 10 is false); expert: threshold 15: e, d, then c stays.
    split = offload_split(params, 0.5)
    assert split == {"b": CPU, "a": GPU, "e": CPU, "d": CPU, "c": GPU}
    assert list(split) == ["b", "a", "e", "d", "c"]  # dense first, then expert
    assert [p.name for p in offload_order(params)] == ["b", "a", "e", "d", "c"]
    # One optimizer over all five would cut elsewhere (threshold 25: e, d, b go; c and a stay).
    merged = [fake(p.name, p.numel, p.index) for p in params]
    assert offload_split(merged, 0.5) == {"e": CPU, "d": CPU, "b": CPU, "c": GPU, "a": GPU}
    summary = offload_summary(params, 0.5)
    assert list(summary.optimizers) == ["dense", "expert"]
    expert = summary.optimizers["expert"]
    assert (expert.optimizer, expert.tensors, expert.parameters, expert.gpu_numel) == ("expert", 3, 30, 10)
    assert expert.gpu_share == pytest.approx(1 / 3)
    assert (summary.tensors, summary.gpu_numel, summary.optimizer) == (5, 20, None)


def test_split_with_only_expert_parameters():
    params = [fake("x", 4, 0, optimizer="expert"), fake("y", 4, 1, optimizer="expert")]
    assert offload_split(params, 0.5) == {"y": CPU, "x": GPU}
    assert list(offload_summary(params, 0.5).optimizers) == ["expert"]


def test_split_rejects_an_unknown_optimizer():
    with pytest.raises(ValueError, match=r"parameter a: optimizer 'moe' is not one of \['dense', 'expert'\]"):
        offload_split([fake("a", 1, 0, optimizer="moe")], 0.5)
