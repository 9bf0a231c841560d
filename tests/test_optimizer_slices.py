"""The optimizer lever's parameters: Megatron's TP slices of Gemma-4-31B, their checkpoint and
synthetic values, and Megatron's CPU/GPU offload split.

The recipe's numbers (21 tensors, 556,051,968 parameters, 19.8% on the GPU at fraction 0.8: the
embedding slice, layer 0's linear_qkv and linear_proj, every norm gain) are the specification the
derivation from the model facts must reproduce; they are stated in the recipe's correctness block.
"""

import copy
import hashlib
import json
import math
import re

import pytest
import safetensors
import torch
from safetensors.torch import save_file

import correctness.optimizer.slices as slices_module
from correctness.errors import CaseInputError, RecipeError, ShapeError
from correctness.models import ModelFacts
from correctness.optimizer.slices import (
    RECIPE,
    SMOKE,
    ParamSlice,
    checkpoint_tensor,
    first_layer_of_each_kind,
    layer_kinds,
    load_slice,
    param_slices,
    synthetic_slice,
)
from correctness.optimizer.config import optimizer_config
from correctness.optimizer.split import CPU, GPU, offload_order, offload_orders, offload_split, offload_summary

LAYERS = (0, 5)  # a sliding layer and a global one
EMBEDDING_ROWS = 8192


@pytest.fixture(scope="module")
def fraction(gemma_recipe):
    return gemma_recipe.field("layout.offload.optimizer_fraction")


def recipe_slices(gemma_recipe, gemma, scale=RECIPE, tp_rank=0):
    return param_slices(gemma, tp=gemma_recipe.tp, tp_rank=tp_rank, layers=LAYERS, embedding_rows=EMBEDDING_ROWS, scale=scale)


# --- the recipe's slices and split -------------------------------------------------------------


def test_recipe_slices_and_gpu_share(gemma_recipe, gemma, fraction):
    params = recipe_slices(gemma_recipe, gemma)
    assert fraction == 0.8 and gemma_recipe.tp == 2
    assert len(params) == 21
    total = sum(p.numel for p in params)
    assert total == 556_051_968
    summary = offload_summary(params, fraction)
    assert summary.gpu_numel == 110_145_024
    assert summary.cpu_numel + summary.gpu_numel == total
    assert round(100 * summary.gpu_share, 1) == 19.8
    norms = {p.name for p in params if p.kind == "norm"}
    assert len(norms) == 12  # six per layer: four of size hidden, q_layernorm and k_layernorm
    assert set(summary.gpu) == norms | {
        "embedding.word_embeddings.weight",
        "decoder.layers.0.self_attention.linear_qkv.weight",
        "decoder.layers.0.self_attention.linear_proj.weight",
    }


def test_recipe_slice_inventory(gemma_recipe, gemma):
    params = recipe_slices(gemma_recipe, gemma)
    by_name = {p.name: p for p in params}
    assert [p.index for p in params] == list(range(21))
    assert params[0].name == "embedding.word_embeddings.weight" and params[0].layer is None
    assert [p.layer for p in params[1:]] == [0] * 10 + [5] * 10
    # One layer in named_parameters() order (Attention builds linear_proj before linear_qkv).
    assert [p.name.removeprefix("decoder.layers.0.") for p in params[1:11]] == [
        "self_attention.linear_proj.weight",
        "self_attention.linear_proj.post_layernorm.weight",
        "self_attention.linear_qkv.layer_norm_weight",
        "self_attention.linear_qkv.weight",
        "self_attention.q_layernorm.weight",
        "self_attention.k_layernorm.weight",
        "mlp.linear_fc1.layer_norm_weight",
        "mlp.linear_fc1.weight",
        "mlp.linear_fc2.weight",
        "post_ffn_layernorm.weight",
    ]
    hidden, ffn = gemma.field("hidden_size"), gemma.field("ffn_hidden_size")
    sliding, global_ = gemma.attention_kind("sliding"), gemma.attention_kind("global")
    tp = gemma_recipe.tp

    def shape(name):
        return by_name[name].shape

    assert shape("embedding.word_embeddings.weight") == (EMBEDDING_ROWS, hidden)
    for layer, kind in ((0, sliding), (5, global_)):
        p = f"decoder.layers.{layer}."
        heads, groups = kind.query_heads // tp, kind.kv_heads // tp
        assert shape(p + "self_attention.linear_qkv.weight") == ((heads + 2 * groups) * kind.head_dim, hidden)
        assert shape(p + "self_attention.linear_proj.weight") == (hidden, heads * kind.head_dim)
        assert shape(p + "mlp.linear_fc1.weight") == (2 * ffn // tp, hidden)
        assert shape(p + "mlp.linear_fc2.weight") == (hidden, ffn // tp)
        assert shape(p + "self_attention.q_layernorm.weight") == (kind.head_dim,)
        assert by_name[p + "self_attention.linear_qkv.weight"].layer_kind == kind.name
    for param in params:
        assert param.kind in ("embedding", "column-parallel", "row-parallel", "norm")
        assert param.weight_decay == (len(param.shape) == 2)
        assert param.weight_decay == (param.kind != "norm")
        assert (param.tp, param.tp_rank, param.scale) == (2, 0, "recipe")
        assert param.numel == math.prod(param.shape)


def test_rank_one_slices_have_the_same_shapes(gemma_recipe, gemma):
    rank0, rank1 = recipe_slices(gemma_recipe, gemma), recipe_slices(gemma_recipe, gemma, tp_rank=1)
    assert [(p.name, p.shape) for p in rank0] == [(p.name, p.shape) for p in rank1]
    embedding = rank1[0].sources[0]
    assert embedding.rows == (gemma.field("vocab_size") // 2, gemma.field("vocab_size") // 2 + EMBEDDING_ROWS)


def test_recipe_offload_order(gemma_recipe, gemma):
    order = [p.name for p in offload_order(recipe_slices(gemma_recipe, gemma))]
    decayed = order[:9]
    assert decayed == [
        "decoder.layers.5.mlp.linear_fc2.weight",
        "decoder.layers.5.mlp.linear_fc1.weight",
        "decoder.layers.5.self_attention.linear_qkv.weight",
        "decoder.layers.5.self_attention.linear_proj.weight",
        "decoder.layers.0.mlp.linear_fc2.weight",
        "decoder.layers.0.mlp.linear_fc1.weight",
        "decoder.layers.0.self_attention.linear_qkv.weight",
        "decoder.layers.0.self_attention.linear_proj.weight",
        "embedding.word_embeddings.weight",
    ]
    assert order[9] == "decoder.layers.5.post_ffn_layernorm.weight"
    assert order[-1] == "decoder.layers.0.self_attention.linear_proj.post_layernorm.weight"


def test_smoke_scale_counts(gemma_recipe, gemma, fraction):
    recipe_params = recipe_slices(gemma_recipe, gemma)
    params = recipe_slices(gemma_recipe, gemma, scale=SMOKE)
    assert [(p.name, p.kind, p.weight_decay, p.index) for p in params] == [
        (p.name, p.kind, p.weight_decay, p.index) for p in recipe_params
    ]
    assert len(params) == 21
    assert sum(p.numel for p in params) == 2_174_688
    for small, big in zip(params, recipe_params):
        assert small.numel * (256 if small.weight_decay else 16) == big.numel
        assert small.sources == () and small.scale == "smoke"
    summary = offload_summary(params, fraction)
    assert summary.gpu_numel == 432_864
    assert round(100 * summary.gpu_share, 1) == 19.9
    assert set(summary.gpu) == set(offload_summary(recipe_params, fraction).gpu)
    assert {p.name for p in params if p.weight_decay} & set(summary.gpu)  # 2-D weights as well as norms


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


# --- bad inputs to the inventory ---------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, error, message",
    [
        ({"tp_rank": 2}, ShapeError, r"Gemma-4-31B: TP rank 2 outside 0\.\.1"),
        ({"tp_rank": -1}, ShapeError, r"TP rank -1 outside 0\.\.1"),
        ({"tp": 0}, ShapeError, r"TP size 0 must be a positive integer"),
        ({"tp": 3}, ShapeError, r"does not split evenly over TP 3"),
        ({"layers": (0, 60)}, RecipeError, r"layer 60 outside 0\.\.59"),
        ({"layers": (5, 5)}, ShapeError, r"layer 5 is listed twice"),
        ({"embedding_rows": 131_073}, ShapeError, r"embedding rows 131073 outside 1\.\.131072 \(TP rank 0's part"),
        ({"embedding_rows": 0}, ShapeError, r"embedding rows 0 outside"),
        ({"embedding_rows": 8200, "scale": SMOKE}, ShapeError, r"smoke scale: embedding rows 8200 is not divisible"),
    ],
)
def test_inventory_errors(gemma, changes, error, message):
    arguments = {"tp": 2, "tp_rank": 0, "layers": LAYERS, "embedding_rows": EMBEDDING_ROWS, "scale": RECIPE, **changes}
    with pytest.raises(error, match=message) as raised:
        param_slices(gemma, **arguments)
    assert "\n" not in str(raised.value)


# --- values from a checkpoint: a tiny Gemma-4 in a fake checkpoint ------------------------------


@pytest.fixture(scope="module")
def tiny(gemma):
    """Gemma-4's layout at toy size: sliding layers 8 query heads over 4 groups, global layers 8 over
    2 groups with k_eq_v, FFN 12, vocabulary 16."""
    data = copy.deepcopy(gemma.data)
    data.update(name="Tiny-Gemma-4", short_name="tiny", layers=6, hidden_size=8, ffn_hidden_size=12, vocab_size=16)
    data["attention"]["query_heads"] = 8
    data["attention"]["kinds"]["sliding"].update(kv_heads=4, head_dim=4)
    data["attention"]["kinds"]["global"].update(kv_heads=2, head_dim=6)
    return ModelFacts(name="Tiny-Gemma-4", short_name="tiny", data=data)


def full_tensors(model):
    """The whole HF tensors of layers 0 and 5 and the embedding, seeded, in BF16."""
    generator = torch.Generator().manual_seed(7)
    hidden, ffn = model.field("hidden_size"), model.field("ffn_hidden_size")
    heads = model.field("attention.query_heads")

    def randn(*shape):
        return torch.randn(shape, generator=generator).to(torch.bfloat16)

    tensors = {checkpoint_tensor(model, "embed_tokens"): randn(model.field("vocab_size"), hidden)}
    for layer in LAYERS:
        kind = model.attention_kind(model.layer_kind(layer))
        kv, d = kind.kv_heads * kind.head_dim, kind.head_dim
        shapes = {
            "q_proj": (heads * d, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden),
            "o_proj": (hidden, heads * d),
            "gate_proj": (ffn, hidden), "up_proj": (ffn, hidden), "down_proj": (hidden, ffn),
            "q_norm": (d,), "k_norm": (d,), "input_layernorm": (hidden,), "post_attention_layernorm": (hidden,),
            "pre_feedforward_layernorm": (hidden,), "post_feedforward_layernorm": (hidden,),
        }
        if kind.name == "global":
            del shapes["v_proj"]  # attention_k_eq_v: the checkpoint has no v_proj
        for key, shape in shapes.items():
            tensors[checkpoint_tensor(model, key, layer)] = randn(*shape)
    return tensors


def write_checkpoint(folder, tensors, shards=2):
    """Sharded safetensors files with an index, as Hugging Face writes them."""
    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    weight_map = {}
    for shard in range(shards):
        file = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: tensors[name] for name in names[shard::shards]}
        save_file(part, str(folder / file))
        weight_map.update(dict.fromkeys(part, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def expected_slice(model, tensors, name, tp, rank, rows):
    """The rank's slice cut by hand from the whole tensors, as Megatron-Bridge merges and splits them."""
    if name == "embedding.word_embeddings.weight":
        return tensors[checkpoint_tensor(model, "embed_tokens")].chunk(tp)[rank][:rows]
    layer = int(name.split(".")[2])
    kind = model.attention_kind(model.layer_kind(layer))

    def hf(key):
        return tensors[checkpoint_tensor(model, key, layer)]

    suffix = name.split(".", 3)[3]
    norms = {
        "self_attention.linear_proj.post_layernorm.weight": "post_attention_layernorm",
        "self_attention.linear_qkv.layer_norm_weight": "input_layernorm",
        "self_attention.q_layernorm.weight": "q_norm",
        "self_attention.k_layernorm.weight": "k_norm",
        "mlp.linear_fc1.layer_norm_weight": "pre_feedforward_layernorm",
        "post_ffn_layernorm.weight": "post_feedforward_layernorm",
    }
    if suffix in norms:
        return hf(norms[suffix])
    if suffix == "self_attention.linear_qkv.weight":
        groups, d, hidden = kind.kv_heads, kind.head_dim, model.field("hidden_size")
        q = hf("q_proj").view(groups, -1, d, hidden)
        k = hf("k_proj").view(groups, 1, d, hidden)
        v = k if kind.name == "global" else hf("v_proj").view(groups, 1, d, hidden)
        return torch.cat([q, k, v], dim=1).reshape(-1, hidden).chunk(tp)[rank]
    if suffix == "mlp.linear_fc1.weight":
        return torch.cat([hf("gate_proj").chunk(tp)[rank], hf("up_proj").chunk(tp)[rank]])
    if suffix == "self_attention.linear_proj.weight":
        return hf("o_proj").chunk(tp, dim=1)[rank]
    if suffix == "mlp.linear_fc2.weight":
        return hf("down_proj").chunk(tp, dim=1)[rank]
    raise AssertionError(f"no hand slicing for {name}")


@pytest.mark.parametrize("rank", [0, 1])
def test_checkpoint_slices_match_hand_slicing(tiny, tmp_path, rank):
    tensors = full_tensors(tiny)
    folder = write_checkpoint(tmp_path / "ckpt", tensors)
    params = param_slices(tiny, tp=2, tp_rank=rank, layers=LAYERS, embedding_rows=5)
    assert len(params) == 21
    for param in params:
        values = load_slice(folder, param)
        assert values.dtype == torch.bfloat16 and tuple(values.shape) == param.shape, param.name
        assert torch.equal(values, expected_slice(tiny, tensors, param.name, 2, rank, 5)), param.name


def test_global_layer_v_rows_are_k_rows(tiny, tmp_path):
    tensors = full_tensors(tiny)
    folder = write_checkpoint(tmp_path / "ckpt", tensors)
    qkv = next(p for p in param_slices(tiny, tp=2, tp_rank=1, layers=[5], embedding_rows=1)
               if p.name.endswith("linear_qkv.weight"))
    values = load_slice(folder, qkv).view(1, -1, 6, 8)  # one local group: 4 query heads, k, v
    assert values.shape[1] == 6
    assert torch.equal(values[0, 4], values[0, 5])
    assert torch.equal(values[0, 4], tensors[checkpoint_tensor(tiny, "k_proj", 5)][6:12])  # group 1's K


def test_single_file_checkpoint(tiny, tmp_path):
    tensors = full_tensors(tiny)
    (tmp_path / "one").mkdir()
    save_file(tensors, str(tmp_path / "one" / "model.safetensors"))
    param = param_slices(tiny, tp=2, tp_rank=1, layers=[0], embedding_rows=3)[4]
    assert param.name.endswith("linear_qkv.weight")
    assert torch.equal(load_slice(tmp_path / "one", param), expected_slice(tiny, tensors, param.name, 2, 1, 3))


class RecordingOpen:
    """Wraps safetensors' safe_open: records every block read through get_slice; a whole-tensor
    read (get_tensor) fails the test."""

    def __init__(self, real):
        self.real, self.reads = real, []

    def __call__(self, path, framework):
        recorder, real = self, self.real

        class Handle:
            def __enter__(self):
                self.inner = real(path, framework=framework)
                self.file = self.inner.__enter__()
                return self

            def __exit__(self, *exc):
                return self.inner.__exit__(*exc)

            def keys(self):
                return self.file.keys()

            def get_tensor(self, name):
                raise AssertionError(f"whole tensor {name} read")

            def get_slice(self, name):
                part = self.file.get_slice(name)

                class Part:
                    def get_shape(self):
                        return part.get_shape()

                    def __getitem__(self, key):
                        block = part[key]
                        recorder.reads.append((name, block.numel()))
                        return block

                return Part()

        return Handle()


def test_only_the_slice_is_read(tiny, tmp_path, monkeypatch):
    tensors = full_tensors(tiny)
    folder = write_checkpoint(tmp_path / "ckpt", tensors)
    recording = RecordingOpen(safetensors.safe_open)
    monkeypatch.setattr(safetensors, "safe_open", recording)  # what slices imports when it reads
    for param in param_slices(tiny, tp=2, tp_rank=1, layers=LAYERS, embedding_rows=2):
        recording.reads.clear()
        load_slice(folder, param)
        assert sum(count for _, count in recording.reads) == param.numel, param.name
        assert {name for name, _ in recording.reads} == {piece.tensor for piece in param.sources}


def test_checkpoint_errors(tiny, gemma, gemma_recipe, tmp_path):
    tensors = full_tensors(tiny)
    params = param_slices(tiny, tp=2, tp_rank=0, layers=LAYERS, embedding_rows=5)
    qkv0 = params[4]
    assert qkv0.name == "decoder.layers.0.self_attention.linear_qkv.weight"

    def fails(folder, param, message):
        with pytest.raises(CaseInputError, match=message) as raised:
            load_slice(folder, param)
        assert "\n" not in str(raised.value)

    fails(tmp_path / "absent", qkv0, r"checkpoint folder .*absent does not exist")
    (tmp_path / "empty").mkdir()
    fails(tmp_path / "empty", qkv0, r"has neither model\.safetensors\.index\.json nor model\.safetensors")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "model.safetensors.index.json").write_text("{not json")
    fails(tmp_path / "bad", qkv0, r"checkpoint index .*unreadable or without a weight_map")

    v_name = checkpoint_tensor(tiny, "v_proj", 0)
    write_checkpoint(tmp_path / "no-v", {n: t for n, t in tensors.items() if n != v_name})
    fails(tmp_path / "no-v", qkv0, rf"has no tensor {v_name} \(needed for {qkv0.name}\)")

    q_name = checkpoint_tensor(tiny, "q_proj", 0)
    write_checkpoint(tmp_path / "short-q", {**tensors, q_name: tensors[q_name][:8]})
    short = rf"checkpoint tensor {q_name} has shape \[8, 8\]; {qkv0.name} needs its rows 8:16"  # group 1's q heads
    fails(tmp_path / "short-q", qkv0, short)

    folder = write_checkpoint(tmp_path / "missing-shard", tensors)
    embedding = params[0]
    shard = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"][embedding.sources[0].tensor]
    (folder / shard).unlink()
    fails(folder, embedding, rf"file {shard} \(holding {embedding.sources[0].tensor}\) is missing")

    smoke = recipe_slices(gemma_recipe, gemma, scale=SMOKE)[1]
    fails(tmp_path / "ckpt", smoke, rf"{smoke.name}: smoke-scale slices have no checkpoint values")


# --- synthetic values --------------------------------------------------------------------------


def test_synthetic_values_are_seeded_per_tensor(gemma_recipe, gemma):
    params = recipe_slices(gemma_recipe, gemma, scale=SMOKE)
    qkv = params[4]
    first = synthetic_slice(qkv, 0)
    assert first.dtype == torch.bfloat16 and tuple(first.shape) == qkv.shape
    assert torch.equal(first, synthetic_slice(qkv, 0))
    assert not torch.equal(first, synthetic_slice(qkv, 1))
    fc1_layer0, fc1_layer5 = params[8], params[18]
    assert fc1_layer0.shape == fc1_layer5.shape and fc1_layer0.name != fc1_layer5.name
    assert not torch.equal(synthetic_slice(fc1_layer0, 0), synthetic_slice(fc1_layer5, 0))
    rank1 = recipe_slices(gemma_recipe, gemma, scale=SMOKE, tp_rank=1)[4]
    assert not torch.equal(first, synthetic_slice(rank1, 0))


def test_synthetic_values_are_stable_across_runs(gemma_recipe, gemma):
    """A pinned digest: the stream depends only on the seed, the name, the rank and the scale."""
    gain = recipe_slices(gemma_recipe, gemma)[3]  # layer 0's input norm, 5,376 values
    values = synthetic_slice(gain, 1234)
    digest = hashlib.sha256(values.view(torch.int16).numpy().tobytes()).hexdigest()
    assert digest == PINNED_DIGEST


PINNED_DIGEST = "61add3bb4e691bfdc101f59037df393331766e3b59213dde9317075dc9bb9a3c"


def test_synthetic_magnitudes(gemma_recipe, gemma):
    params = {p.name: p for p in recipe_slices(gemma_recipe, gemma, scale=SMOKE)}
    embedding = synthetic_slice(params["embedding.word_embeddings.weight"], 0).double()
    assert abs(embedding.mean()) < 1e-3
    assert embedding.std() == pytest.approx(gemma.field("synthetic.embedding_std"), rel=0.02)
    for name in ("decoder.layers.0.self_attention.linear_qkv.weight", "decoder.layers.5.mlp.linear_fc2.weight"):
        param = params[name]
        values = synthetic_slice(param, 0).double()
        assert values.std() == pytest.approx(1 / math.sqrt(param.fan_in), rel=0.02)
    gains = synthetic_slice(recipe_slices(gemma_recipe, gemma)[3], 0).double()  # 5,376 gains
    assert gains.mean() == pytest.approx(gemma.field("synthetic.norm_gain_mean"), abs=0.01)
    assert gains.std() == pytest.approx(gemma.field("synthetic.norm_gain_std"), rel=0.1)


def test_synthetic_values_span_blocks(gemma_recipe, gemma, monkeypatch):
    monkeypatch.setattr(slices_module, "SYNTHETIC_CHUNK", 1001)  # odd blocks, a short last one
    param = recipe_slices(gemma_recipe, gemma, scale=SMOKE)[1]
    values = synthetic_slice(param, 3).double()
    assert torch.isfinite(values).all()
    assert values.std() == pytest.approx(1 / math.sqrt(param.fan_in), rel=0.03)


def test_synthetic_seed_must_be_an_integer(gemma_recipe, gemma):
    with pytest.raises(ValueError, match=r"synthetic seed 1\.5 is not an integer"):
        synthetic_slice(recipe_slices(gemma_recipe, gemma, scale=SMOKE)[2], 1.5)


def test_gemma_slices_are_all_dense(gemma_recipe, gemma, fraction):
    params = recipe_slices(gemma_recipe, gemma)
    assert {(p.optimizer, p.ep, p.ep_rank, p.expert) for p in params} == {("dense", 1, 0, None)}
    summary = offload_summary(params, fraction)
    assert list(summary.optimizers) == ["dense"]
    dense = summary.optimizers["dense"]
    assert (dense.cpu, dense.gpu, dense.gpu_numel) == (summary.cpu, summary.gpu, summary.gpu_numel)
    assert (dense.tensors, dense.parameters) == (21, 556_051_968)
    assert first_layer_of_each_kind(gemma) == LAYERS


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


# --- Nemotron-3-Super: hybrid Mamba-2 / MoE / attention at TP 4, EP 8 ---------------------------
#
# The recipe's offload fraction is 0.55 for each of Megatron's two optimizers. The figures below
# are this derivation's result (nothing upstream states them): the recipe scale has 147 tensors,
# 443,705,952 parameters (dense 19 / 91,384,416, expert 128 / 352,321,536); at 0.55 the dense
# optimizer keeps the embedding slice and its 8 1-D tensors on the GPU (33,571,424, 36.74%), the
# expert optimizer the first 57 experts' linear_fc1 (156,893,184, 44.53%).

EMBEDDING = "embedding.word_embeddings.weight"


def nemotron_slices(gemma_recipe, model, scale=RECIPE, **changes):
    arguments = {
        "tp": gemma_recipe.tp, "tp_rank": 0, "ep": gemma_recipe.field("layout.ep"), "ep_rank": 0,
        "etp": gemma_recipe.field("layout.etp"), "layers": first_layer_of_each_kind(model),
        "embedding_rows": EMBEDDING_ROWS, "scale": scale, **changes,
    }
    return param_slices(model, **arguments)


MAMBA = [
    "mixer.dt_bias", "mixer.A_log", "mixer.D", "mixer.in_proj.layer_norm_weight", "mixer.in_proj.weight",
    "mixer.conv1d.weight", "mixer.conv1d.bias", "mixer.norm.weight", "mixer.out_proj.weight",
]
MOE_DENSE = [
    "pre_mlp_layernorm.weight", "mlp.router.weight", "mlp.fc1_latent_proj.weight", "mlp.fc2_latent_proj.weight",
]
MOE_SHARED = ["mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc2.weight"]
ATTENTION = [
    "self_attention.linear_proj.weight", "self_attention.linear_qkv.layer_norm_weight",
    "self_attention.linear_qkv.weight",
]


def test_nemotron_layers_come_from_the_pattern(nemotron):
    symbols = nemotron.field("layer_pattern.symbols")
    kinds = nemotron.field("layer_pattern.kinds")
    assert layer_kinds(nemotron) == ("mamba", "moe", "attention")
    expected = tuple(sorted(symbols.index(symbol) for symbol in kinds))
    assert first_layer_of_each_kind(nemotron) == expected == (0, 1, 7)
    assert [nemotron.layer_kind(layer) for layer in expected] == ["mamba", "moe", "attention"]


def test_nemotron_recipe_inventory(nemotron_recipe, nemotron):
    params = nemotron_slices(nemotron_recipe, nemotron)
    assert (nemotron_recipe.tp, nemotron_recipe.field("layout.ep"), nemotron_recipe.field("layout.etp")) == (4, 8, 1)
    assert len(params) == 147 and sum(p.numel for p in params) == 443_705_952
    assert [p.index for p in params] == list(range(147))
    local = nemotron.field("moe.experts") // 8
    assert local == 64
    experts = [f"mlp.experts.linear_fc1.weight{i}" for i in range(local)]
    experts += [f"mlp.experts.linear_fc2.weight{i}" for i in range(local)]
    assert [p.name for p in params] == (
        [EMBEDDING]
        + [f"decoder.layers.0.{n}" for n in MAMBA]
        + [f"decoder.layers.1.{n}" for n in MOE_DENSE + experts + MOE_SHARED]
        + [f"decoder.layers.7.{n}" for n in ATTENTION]
    )
    dense = [p for p in params if p.optimizer == "dense"]
    expert = [p for p in params if p.optimizer == "expert"]
    assert (len(dense), sum(p.numel for p in dense)) == (19, 91_384_416)
    assert (len(expert), sum(p.numel for p in expert)) == (128, 352_321_536)
    assert {p.kind for p in expert} == {"expert"} and all(".experts." in p.name for p in expert)
    assert [p.expert for p in expert] == list(range(local)) * 2
    for param in params:
        assert (param.tp, param.tp_rank, param.ep, param.ep_rank, param.scale) == (4, 0, 8, 0, "recipe")
        assert param.weight_decay == (len(param.shape) >= 2 and not param.name.endswith(".bias"))
        assert (param.expert is None) == (param.optimizer == "dense")
    assert {p.layer_kind for p in params} == {None, "mamba", "moe", "attention"}

    by_name = {p.name: p for p in params}
    f = nemotron.field
    tp, hidden = 4, f("hidden_size")
    heads, head_dim, groups, state = f("mamba.heads"), f("mamba.head_dim"), f("mamba.groups"), f("mamba.state_size")
    inner, bc = heads * head_dim, groups * state
    attention = nemotron.attention_kind("attention")
    shapes = {
        EMBEDDING: (EMBEDDING_ROWS, hidden),
        "decoder.layers.0.mixer.dt_bias": (heads // tp,),
        "decoder.layers.0.mixer.A_log": (heads // tp,),
        "decoder.layers.0.mixer.D": (heads // tp,),
        "decoder.layers.0.mixer.in_proj.layer_norm_weight": (hidden,),
        "decoder.layers.0.mixer.in_proj.weight": ((2 * inner + 2 * bc + heads) // tp, hidden),
        "decoder.layers.0.mixer.conv1d.weight": ((inner + 2 * bc) // tp, 1, f("mamba.conv_kernel")),
        "decoder.layers.0.mixer.conv1d.bias": ((inner + 2 * bc) // tp,),
        "decoder.layers.0.mixer.norm.weight": (inner // tp,),
        "decoder.layers.0.mixer.out_proj.weight": (hidden, inner // tp),
        "decoder.layers.1.pre_mlp_layernorm.weight": (hidden,),
        "decoder.layers.1.mlp.router.weight": (f("moe.experts"), hidden),
        "decoder.layers.1.mlp.fc1_latent_proj.weight": (f("moe.latent_size"), hidden),
        "decoder.layers.1.mlp.fc2_latent_proj.weight": (hidden, f("moe.latent_size")),
        "decoder.layers.1.mlp.experts.linear_fc1.weight0": (f("moe.expert_ffn_hidden_size"), f("moe.latent_size")),
        "decoder.layers.1.mlp.experts.linear_fc2.weight63": (f("moe.latent_size"), f("moe.expert_ffn_hidden_size")),
        "decoder.layers.1.mlp.shared_experts.linear_fc1.weight": (f("moe.shared_expert_ffn_hidden_size") // tp, hidden),
        "decoder.layers.1.mlp.shared_experts.linear_fc2.weight": (hidden, f("moe.shared_expert_ffn_hidden_size") // tp),
        "decoder.layers.7.self_attention.linear_proj.weight": (
            hidden, attention.query_heads * attention.head_dim // tp),
        "decoder.layers.7.self_attention.linear_qkv.layer_norm_weight": (hidden,),
        # The fused [16 q, k0, v0, 16 q, k1, v1] rows split evenly: 1,152 rows, 9 query heads' worth.
        "decoder.layers.7.self_attention.linear_qkv.weight": (
            (attention.query_heads + 2 * attention.kv_heads) * attention.head_dim // tp, hidden),
    }
    assert {name: by_name[name].shape for name in shapes} == shapes
    assert shapes["decoder.layers.7.self_attention.linear_qkv.weight"] == (1152, 4096)
    assert shapes["decoder.layers.0.mixer.in_proj.weight"] == (4640, 4096)
    assert shapes["decoder.layers.0.mixer.conv1d.weight"] == (2560, 1, 4)
    kinds = {
        "decoder.layers.0.mixer.A_log": "column-parallel", "decoder.layers.0.mixer.out_proj.weight": "row-parallel",
        "decoder.layers.1.mlp.router.weight": "replicated", "decoder.layers.1.pre_mlp_layernorm.weight": "norm",
        "decoder.layers.1.mlp.fc2_latent_proj.weight": "replicated",
    }
    assert {name: by_name[name].kind for name in kinds} == kinds
    assert by_name["decoder.layers.0.mixer.conv1d.weight"].weight_decay  # 3-D: Megatron decays it
    assert not by_name["decoder.layers.0.mixer.conv1d.bias"].weight_decay


def test_nemotron_checkpoint_pieces(nemotron_recipe, nemotron):
    """Rank 0's rows of the fused tensors, as Megatron-Bridge assembles them."""
    by_name = {p.name: p for p in nemotron_slices(nemotron_recipe, nemotron)}

    def pieces(name):
        return [(s.tensor.removeprefix("backbone."), s.rows, s.cols, s.at) for s in by_name[name].sources]

    inner, bc, heads = 8192, 1024, 128
    assert pieces("decoder.layers.0.mixer.in_proj.weight") == [
        ("layers.0.mixer.in_proj.weight", (0, 2048), (0, 4096), 0),  # z
        ("layers.0.mixer.in_proj.weight", (inner, inner + 2048), (0, 4096), 2048),  # x
        ("layers.0.mixer.in_proj.weight", (2 * inner, 2 * inner + 256), (0, 4096), 4096),  # B: groups 0-1
        ("layers.0.mixer.in_proj.weight", (2 * inner + bc, 2 * inner + bc + 256), (0, 4096), 4352),  # C
        ("layers.0.mixer.in_proj.weight", (2 * inner + 2 * bc, 2 * inner + 2 * bc + 32), (0, 4096), 4608),  # dt
    ]
    assert 2 * inner + 2 * bc + heads == 18_560
    assert pieces("decoder.layers.0.mixer.conv1d.weight") == [
        ("layers.0.mixer.conv1d.weight", (0, 2048), None, 0),
        ("layers.0.mixer.conv1d.weight", (inner, inner + 256), None, 2048),
        ("layers.0.mixer.conv1d.weight", (inner + bc, inner + bc + 256), None, 2304),
    ]
    assert pieces("decoder.layers.0.mixer.A_log") == [("layers.0.mixer.A_log", (0, 32), None, 0)]
    assert pieces("decoder.layers.7.self_attention.linear_qkv.weight") == [
        ("layers.7.mixer.q_proj.weight", (0, 1152), (0, 4096), 0),  # query heads 0-8, no K/V rows
    ]
    assert pieces("decoder.layers.1.mlp.experts.linear_fc2.weight5") == [
        ("layers.1.mixer.experts.5.down_proj.weight", (0, 1024), (0, 2688), 0)]
    assert pieces("decoder.layers.1.mlp.router.weight") == [("layers.1.mixer.gate.weight", (0, 512), (0, 4096), 0)]
    assert pieces("decoder.layers.1.pre_mlp_layernorm.weight") == [("layers.1.norm.weight", (0, 4096), None, 0)]


@pytest.mark.parametrize("rank, expected", [
    (0, [("q", (0, 1152), 0)]),
    (1, [("q", (1152, 2048), 0), ("k", (0, 128), 896), ("v", (0, 128), 1024)]),
    (2, [("q", (2048, 3200), 0)]),
    (3, [("q", (3200, 4096), 0), ("k", (128, 256), 896), ("v", (128, 256), 1024)]),
])
def test_nemotron_qkv_rows_per_tp_rank(nemotron_recipe, nemotron, rank, expected):
    qkv = next(p for p in nemotron_slices(nemotron_recipe, nemotron, tp_rank=rank, layers=[7])
               if p.name.endswith("linear_qkv.weight"))
    assert qkv.shape == (1152, 4096)
    assert [(s.tensor.split(".")[-2][0], s.rows, s.at) for s in qkv.sources] == expected


def test_nemotron_recipe_split(nemotron_recipe, nemotron):
    params = nemotron_slices(nemotron_recipe, nemotron)
    fraction = optimizer_config(nemotron_recipe).offload_fraction
    assert fraction == 0.55
    summary = offload_summary(params, fraction)
    dense, expert = summary.optimizers["dense"], summary.optimizers["expert"]
    assert (dense.tensors, dense.parameters, len(dense.gpu), dense.gpu_numel) == (19, 91_384_416, 9, 33_571_424)
    assert round(100 * dense.gpu_share, 2) == 36.74
    one_d = {p.name for p in params if len(p.shape) == 1}
    assert len(one_d) == 8
    assert set(dense.gpu) == one_d | {EMBEDDING}
    assert dense.cpu[-1] == "decoder.layers.0.mixer.in_proj.weight"  # the tensor that crosses 55%
    assert (expert.tensors, expert.parameters, len(expert.cpu), len(expert.gpu)) == (128, 352_321_536, 71, 57)
    assert expert.gpu_numel == 156_893_184 and round(100 * expert.gpu_share, 2) == 44.53
    fc1 = "decoder.layers.1.mlp.experts.linear_fc1.weight"
    assert expert.gpu == tuple(f"{fc1}{i}" for i in range(56, -1, -1))  # reverse model order
    assert (summary.tensors, summary.gpu_numel) == (147, 190_464_608)
    assert round(100 * summary.gpu_share, 2) == 42.93
    split = offload_split(params, fraction)
    assert split == {**{n: CPU for n in dense.cpu}, **{n: GPU for n in dense.gpu},
                     **{n: CPU for n in expert.cpu}, **{n: GPU for n in expert.gpu}}
    # Each optimizer on its own: the dense split does not move when the experts are left out.
    alone = offload_split([p for p in params if p.optimizer == "dense"], fraction)
    assert alone == {name: split[name] for name in alone}
    order = [p.name for p in offload_orders(params)["dense"]]
    assert order[:3] == [
        "decoder.layers.7.self_attention.linear_qkv.weight",
        "decoder.layers.7.self_attention.linear_proj.weight",
        "decoder.layers.1.mlp.shared_experts.linear_fc2.weight",
    ]
    assert order[10] == EMBEDDING and order[-1] == "decoder.layers.0.mixer.dt_bias"


def test_nemotron_smoke_scale(nemotron_recipe, nemotron):
    big = nemotron_slices(nemotron_recipe, nemotron)
    params = nemotron_slices(nemotron_recipe, nemotron, scale=SMOKE)
    assert [(p.name, p.kind, p.weight_decay, p.index, p.optimizer, p.expert) for p in params] == [
        (p.name, p.kind, p.weight_decay, p.index, p.optimizer, p.expert) for p in big
    ]
    assert len(params) == 147 and sum(p.numel for p in params) == 1_865_472
    assert sum(p.numel for p in params if p.optimizer == "dense") == 489_216
    assert sum(p.numel for p in params if p.optimizer == "expert") == 1_376_256
    for small, large in zip(params, big):
        assert small.sources == () and small.scale == "smoke"
        if small.kind in ("expert", "row-parallel", "embedding") or small.name.endswith("latent_proj.weight"):
            assert small.numel * 256 == large.numel, small.name
    by_name = {p.name: p for p in params}
    assert by_name["decoder.layers.0.mixer.in_proj.weight"].shape == (320, 256)  # 128 + 128 + 16 + 16 + 32 heads
    assert by_name["decoder.layers.0.mixer.conv1d.weight"].shape == (160, 1, 4)
    assert by_name["decoder.layers.1.mlp.router.weight"].shape == (512, 256)  # expert rows kept
    assert by_name["decoder.layers.7.self_attention.linear_qkv.weight"].shape == (72, 256)
    summary = offload_summary(params, 0.55)
    dense, expert = summary.optimizers["dense"], summary.optimizers["expert"]
    assert (len(dense.gpu), dense.gpu_numel, round(100 * dense.gpu_share, 2)) == (11, 214_784, 43.9)
    assert (len(expert.gpu), expert.gpu_numel) == (57, 612_864)
    recipe_summary = offload_summary(big, 0.55)
    assert expert.gpu == recipe_summary.optimizers["expert"].gpu
    # The unscaled router (512 expert rows) weighs more at the smoke scale: the dense cut moves by
    # two tensors, Mamba's in_proj and conv1d weight, which stay on the GPU here.
    assert set(dense.gpu) - set(recipe_summary.optimizers["dense"].gpu) == {
        "decoder.layers.0.mixer.in_proj.weight", "decoder.layers.0.mixer.conv1d.weight"}
    assert set(recipe_summary.optimizers["dense"].gpu) < set(dense.gpu)


def test_nemotron_other_expert_ranks(nemotron_recipe, nemotron):
    rank0 = nemotron_slices(nemotron_recipe, nemotron, scale=SMOKE)
    rank7 = nemotron_slices(nemotron_recipe, nemotron, ep_rank=7)
    assert [p.name for p in rank7] == [p.name for p in rank0]  # local expert names repeat
    experts = [p for p in rank7 if p.optimizer == "expert"]
    assert [p.expert for p in experts] == list(range(448, 512)) * 2
    assert experts[0].sources[0].tensor == "backbone.layers.1.mixer.experts.448.up_proj.weight"
    rank7_smoke = nemotron_slices(nemotron_recipe, nemotron, ep_rank=7, scale=SMOKE)
    same_dense = [(a, b) for a, b in zip(rank0, rank7_smoke) if a.optimizer == "dense"]
    assert all(torch.equal(synthetic_slice(a, 0), synthetic_slice(b, 0)) for a, b in same_dense[:3])
    first0, first7 = (next(p for p in params if p.optimizer == "expert") for params in (rank0, rank7_smoke))
    assert first0.name == first7.name
    assert not torch.equal(synthetic_slice(first0, 0), synthetic_slice(first7, 0))


def test_nemotron_without_expert_parallelism(nemotron):
    params = param_slices(nemotron, tp=4, tp_rank=0, layers=[1], embedding_rows=16, scale=SMOKE)
    experts = [p for p in params if p.kind == "expert"]
    assert len(experts) == 2 * nemotron.field("moe.experts")
    assert {p.optimizer for p in params} == {"dense"}  # EP 1: Megatron's allreduce=True, one optimizer
    assert experts[-1].name == "decoder.layers.1.mlp.experts.linear_fc2.weight511"


@pytest.mark.parametrize(
    "changes, error, message",
    [
        ({"ep_rank": 8}, ShapeError, r"Nemotron-3-Super-120B-A12B: EP rank 8 outside 0\.\.7"),
        ({"ep_rank": -1}, ShapeError, r"EP rank -1 outside 0\.\.7"),
        ({"ep_rank": True}, ShapeError, r"EP rank True outside"),
        ({"ep": 0}, ShapeError, r"EP size 0 must be a positive integer"),
        ({"ep": 3, "ep_rank": 0}, ShapeError, r"512 experts do not split evenly over EP 3"),
        ({"etp": 2}, ShapeError, r"expert tensor parallelism 2 is not modelled \(ETP 1 only\)"),
        ({"etp": 0}, ShapeError, r"ETP size 0 must be a positive integer"),
        ({"tp_rank": 4}, ShapeError, r"TP rank 4 outside 0\.\.3"),
        ({"tp": 3, "tp_rank": 0}, ShapeError, r"vocabulary 131072 does not split evenly over TP 3"),
        ({"tp": 16, "tp_rank": 0}, ShapeError,
         r"mixer\.in_proj\.weight: Mamba groups 8 does not split evenly over TP 16"),
        ({"layers": (0, 88)}, RecipeError, r"layer 88 outside 0\.\.87"),
        ({"layers": (1, 1)}, ShapeError, r"layer 1 is listed twice"),
        ({"embedding_rows": 32_769}, ShapeError, r"embedding rows 32769 outside 1\.\.32768"),
        ({"embedding_rows": 8200, "scale": SMOKE}, ShapeError, r"smoke scale: embedding rows 8200 is not divisible"),
    ],
)
def test_nemotron_inventory_errors(nemotron_recipe, nemotron, changes, error, message):
    with pytest.raises(error, match=message) as raised:
        nemotron_slices(nemotron_recipe, nemotron, **changes)
    assert "\n" not in str(raised.value)


def test_nemotron_spec_errors(nemotron):
    data = copy.deepcopy(nemotron.data)
    del data["megatron"]["layer_tensors"]["moe"]
    broken = ModelFacts(name="Broken", short_name="broken", data=data)
    with pytest.raises(RecipeError, match=r"megatron\.layer_tensors has no tensors for layer kind 'moe'"):
        param_slices(broken, tp=4, tp_rank=0, ep=8, layers=[1], embedding_rows=8)
    data = copy.deepcopy(nemotron.data)
    data["megatron"]["layer_tensors"]["mamba"][0]["parts"] = ["head_dim"]
    broken = ModelFacts(name="Broken", short_name="broken", data=data)
    with pytest.raises(RecipeError, match=r"dimension head_dim needs an attention layer kind, not 'mamba'"):
        param_slices(broken, tp=4, tp_rank=0, layers=[0], embedding_rows=8)
    data = copy.deepcopy(nemotron.data)
    data["megatron"]["layer_tensors"]["mamba"].append(data["megatron"]["layer_tensors"]["attention"][2])
    broken = ModelFacts(name="Broken", short_name="broken", data=data)
    with pytest.raises(RecipeError, match=r"linear_qkv\.weight: qkv-grouped needs an attention layer kind"):
        param_slices(broken, tp=4, tp_rank=0, layers=[0], embedding_rows=8)
    data = copy.deepcopy(nemotron.data)
    data["attention"]["kinds"]["attention"]["kv_heads"] = 3
    broken = ModelFacts(name="Broken", short_name="broken", data=data)
    with pytest.raises(ShapeError, match=r"32 query heads do not divide into 3 groups"):
        param_slices(broken, tp=4, tp_rank=0, layers=[7], embedding_rows=8)
    data["attention"]["query_heads"], data["attention"]["kinds"]["attention"]["kv_heads"] = 24, 3
    broken = ModelFacts(name="Broken", short_name="broken", data=data)
    with pytest.raises(ShapeError, match=r"3 key-value heads do not spread evenly over TP 4"):
        param_slices(broken, tp=4, tp_rank=0, layers=[7], embedding_rows=8)
    data = copy.deepcopy(nemotron.data)
    data["megatron"]["layer_tensors"]["mamba"][1]["parts"] = ["mamba_head"]
    broken = ModelFacts(name="Broken", short_name="broken", data=data)
    with pytest.raises(RecipeError, match=r"megatron tensor mixer\.A_log: part 'mamba_head' is not one of \['hidden'"):
        param_slices(broken, tp=4, tp_rank=0, layers=[0], embedding_rows=8)
    data = copy.deepcopy(nemotron.data)
    del data["synthetic"]["tensors"]["A_log"]
    broken = ModelFacts(name="Broken", short_name="broken", data=data)
    with pytest.raises(RecipeError, match=r"missing field synthetic\.tensors\.A_log\.mean"):
        param_slices(broken, tp=4, tp_rank=0, layers=[0], embedding_rows=8)


def test_nemotron_synthetic_magnitudes(nemotron_recipe, nemotron):
    params = {p.name: p for p in nemotron_slices(nemotron_recipe, nemotron, scale=SMOKE)}
    for name, key in (("mixer.A_log", "A_log"), ("mixer.dt_bias", "dt_bias"), ("mixer.conv1d.weight", "conv1d_weight")):
        param = params[f"decoder.layers.0.{name}"]
        magnitudes = nemotron.field(f"synthetic.tensors.{key}")
        assert (param.init_mean, param.init_std) == (magnitudes["mean"], magnitudes["std"])
    conv = synthetic_slice(params["decoder.layers.0.mixer.conv1d.weight"], 0).double()  # 640 values
    assert conv.shape == (160, 1, 4)
    assert conv.std() == pytest.approx(nemotron.field("synthetic.tensors.conv1d_weight.std"), rel=0.1)
    gain = params["decoder.layers.0.mixer.norm.weight"]  # a TP-split gain: drawn like a norm gain
    assert (gain.init_mean, gain.init_std) == (nemotron.field("synthetic.norm_gain_mean"),
                                               nemotron.field("synthetic.norm_gain_std"))
    expert = params["decoder.layers.1.mlp.experts.linear_fc2.weight3"]
    assert expert.fan_in == nemotron.field("moe.expert_ffn_hidden_size") // 16
    values = synthetic_slice(expert, 0).double()
    assert values.std() == pytest.approx(1 / math.sqrt(expert.fan_in), rel=0.05)


# --- Nemotron-3 values from a checkpoint: a tiny Nemotron-H in a fake checkpoint -----------------


@pytest.fixture(scope="module")
def tiny_nemotron(nemotron):
    """Nemotron-3-Super's layout at toy size: 8 query heads over 2 key-value groups (fewer than TP 4),
    8 Mamba heads of dim 2 in 4 groups of state 3, 8 experts over EP 2."""
    data = copy.deepcopy(nemotron.data)
    data.update(name="Tiny-Nemotron-H", short_name="tiny-nh", layers=4, hidden_size=4, vocab_size=32)
    data["layer_pattern"]["symbols"] = "ME*M"
    data["attention"]["query_heads"] = 8
    data["attention"]["kinds"]["attention"].update(kv_heads=2, head_dim=2)
    data["mamba"].update(heads=8, head_dim=2, state_size=3, groups=4, conv_kernel=4)
    data["moe"].update(experts=8, expert_ffn_hidden_size=6, latent_size=2, shared_expert_ffn_hidden_size=8)
    return ModelFacts(name="Tiny-Nemotron-H", short_name="tiny-nh", data=data)


def nemotron_full_tensors(model):
    generator = torch.Generator().manual_seed(11)
    f = model.field
    hidden, heads, head_dim = f("hidden_size"), f("mamba.heads"), f("mamba.head_dim")
    inner, bc, kernel = heads * head_dim, f("mamba.groups") * f("mamba.state_size"), f("mamba.conv_kernel")
    q_heads, attention = f("attention.query_heads"), model.attention_kind("attention")
    latent, ffn, shared = f("moe.latent_size"), f("moe.expert_ffn_hidden_size"), f("moe.shared_expert_ffn_hidden_size")

    def randn(*shape):
        return torch.randn(shape, generator=generator).to(torch.bfloat16)

    def hf(key, layer, expert=None):
        return checkpoint_tensor(model, key, layer, expert)

    tensors = {checkpoint_tensor(model, "embed_tokens"): randn(f("vocab_size"), hidden)}
    for layer in range(model.layers):
        tensors[hf("norm", layer)] = randn(hidden)
        kind = model.layer_kind(layer)
        if kind == "mamba":
            shapes = {"in_proj": (2 * inner + 2 * bc + heads, hidden), "conv1d_weight": (inner + 2 * bc, 1, kernel),
                      "conv1d_bias": (inner + 2 * bc,), "dt_bias": (heads,), "A_log": (heads,), "D": (heads,),
                      "mixer_norm": (inner,), "out_proj": (hidden, inner)}
        elif kind == "moe":
            shapes = {"router": (f("moe.experts"), hidden), "fc1_latent_proj": (latent, hidden),
                      "fc2_latent_proj": (hidden, latent), "shared_up_proj": (shared, hidden),
                      "shared_down_proj": (hidden, shared)}
            for expert in range(f("moe.experts")):
                tensors[hf("expert_up_proj", layer, expert)] = randn(ffn, latent)
                tensors[hf("expert_down_proj", layer, expert)] = randn(latent, ffn)
        else:
            kv = attention.kv_heads * attention.head_dim
            shapes = {"q_proj": (q_heads * attention.head_dim, hidden), "k_proj": (kv, hidden),
                      "v_proj": (kv, hidden), "o_proj": (hidden, q_heads * attention.head_dim)}
        for key, shape in shapes.items():
            tensors[hf(key, layer)] = randn(*shape)
    return tensors


def nemotron_expected_slice(model, tensors, param, tp, rank, rows):
    """The rank's slice cut by hand from the whole tensors, as Megatron-Bridge's Nemotron-H mappings
    (QKVMapping, MambaInProjMapping, MambaConv1dMapping, Column/RowParallelMapping) cut them."""
    if param.name == EMBEDDING:
        return tensors[checkpoint_tensor(model, "embed_tokens")].chunk(tp)[rank][:rows]
    f = model.field
    hidden, heads, inner = f("hidden_size"), f("mamba.heads"), f("mamba.heads") * f("mamba.head_dim")
    bc = f("mamba.groups") * f("mamba.state_size")
    layer = param.layer
    suffix = param.name.split(".", 3)[3]

    def hf(key):
        return tensors[checkpoint_tensor(model, key, layer)]

    def by_parts(whole, sizes):
        parts = whole.split(sizes)
        return torch.cat([part.reshape(tp, -1, *whole.shape[1:]) for part in parts], dim=1)[rank]

    if suffix.endswith(("layer_norm_weight", "pre_mlp_layernorm.weight")):
        return hf("norm")
    if param.kind == "expert":
        key = "expert_up_proj" if "linear_fc1" in suffix else "expert_down_proj"
        return tensors[checkpoint_tensor(model, key, layer, param.expert)]
    simple = {
        "mixer.out_proj.weight": ("out_proj", "row"), "self_attention.linear_proj.weight": ("o_proj", "row"),
        "mlp.shared_experts.linear_fc2.weight": ("shared_down_proj", "row"),
        "mlp.shared_experts.linear_fc1.weight": ("shared_up_proj", "column"),
        "mixer.A_log": ("A_log", "column"), "mixer.D": ("D", "column"), "mixer.dt_bias": ("dt_bias", "column"),
        "mixer.norm.weight": ("mixer_norm", "column"),
        "mlp.router.weight": ("router", "whole"), "mlp.fc1_latent_proj.weight": ("fc1_latent_proj", "whole"),
        "mlp.fc2_latent_proj.weight": ("fc2_latent_proj", "whole"),
    }
    if suffix in simple:
        key, how = simple[suffix]
        whole = hf(key)
        return whole if how == "whole" else whole.chunk(tp, dim=1 if how == "row" else 0)[rank]
    if suffix == "mixer.in_proj.weight":
        return by_parts(hf("in_proj"), [inner, inner, bc, bc, heads])
    if suffix in ("mixer.conv1d.weight", "mixer.conv1d.bias"):
        return by_parts(hf("conv1d_weight" if suffix.endswith("weight") else "conv1d_bias"), [inner, bc, bc])
    if suffix == "self_attention.linear_qkv.weight":
        kind = model.attention_kind("attention")
        groups, d = kind.kv_heads, kind.head_dim
        q = hf("q_proj").view(groups, -1, d, hidden)
        k, v = hf("k_proj").view(groups, 1, d, hidden), hf("v_proj").view(groups, 1, d, hidden)
        return torch.cat([q, k, v], dim=1).reshape(-1, hidden).chunk(tp)[rank]
    raise AssertionError(f"no hand slicing for {param.name}")


@pytest.mark.parametrize("tp_rank, ep_rank", [(0, 0), (1, 1), (3, 1)])
def test_nemotron_checkpoint_slices_match_hand_slicing(tiny_nemotron, tmp_path, tp_rank, ep_rank):
    tensors = nemotron_full_tensors(tiny_nemotron)
    folder = write_checkpoint(tmp_path / "ckpt", tensors, shards=3)
    params = param_slices(tiny_nemotron, tp=4, tp_rank=tp_rank, ep=2, ep_rank=ep_rank,
                          layers=first_layer_of_each_kind(tiny_nemotron), embedding_rows=5)
    assert first_layer_of_each_kind(tiny_nemotron) == (0, 1, 2)
    assert len(params) == 1 + 9 + 4 + 2 * 4 + 2 + 3
    assert {p.expert for p in params if p.optimizer == "expert"} == set(range(4 * ep_rank, 4 * ep_rank + 4))
    for param in params:
        values = load_slice(folder, param)
        assert values.dtype == torch.bfloat16 and tuple(values.shape) == param.shape, param.name
        assert torch.equal(values, nemotron_expected_slice(tiny_nemotron, tensors, param, 4, tp_rank, 5)), param.name


def test_nemotron_checkpoint_conv_shape_is_checked(tiny_nemotron, tmp_path):
    tensors = nemotron_full_tensors(tiny_nemotron)
    name = checkpoint_tensor(tiny_nemotron, "conv1d_weight", 0)
    tensors[name] = tensors[name][:, 0]  # stored 2-D instead of [channels, 1, kernel]
    folder = write_checkpoint(tmp_path / "ckpt", tensors)
    conv = next(p for p in param_slices(tiny_nemotron, tp=4, tp_rank=0, layers=[0], embedding_rows=1)
                if p.name.endswith("conv1d.weight"))
    message = rf"checkpoint tensor {re.escape(name)} has shape \[40, 4\]; {conv.name} needs its rows 0:4$"
    with pytest.raises(CaseInputError, match=message):
        load_slice(folder, conv)
