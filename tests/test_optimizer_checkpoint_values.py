"""Checkpoint values: the slices read from fake Hugging Face checkpoints of a tiny Gemma-4 and a tiny
Nemotron-H are the slices cut by hand as Megatron-Bridge cuts them, only the slice is read, and a
missing, short or malformed checkpoint is refused."""

import copy
import dataclasses
import json
import re

import pytest
import safetensors
import torch
from safetensors.torch import save_file

from correctness.errors import CaseInputError
from correctness.models import ModelFacts
from correctness.optimizer.checkpoint_values import load_slice
from correctness.megatron.layout import SMOKE, checkpoint_tensor, first_layer_of_each_kind, param_slices
from optimizer_params import EMBEDDING, LAYERS, recipe_slices


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

                    def get_dtype(self):
                        return part.get_dtype()

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
    monkeypatch.setattr(safetensors, "safe_open", recording)  # what checkpoint_values imports when it reads
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


def test_a_quantised_checkpoint_tensor_or_an_unreadable_source_is_refused(tiny, tmp_path):
    """An FP8 tensor would need its block scales (DeepSeek-V3's checkpoint): refused, never cast."""
    tensors = full_tensors(tiny)
    params = param_slices(tiny, tp=2, tp_rank=0, layers=LAYERS, embedding_rows=2)
    target = params[1]
    name = target.sources[0].tensor
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    folder = write_checkpoint(tmp_path / "fp8", tensors)
    with pytest.raises(CaseInputError, match=f"checkpoint tensor {name} is F8_E4M3; .* needs a BF16"):
        load_slice(folder, target)
    unreadable = dataclasses.replace(target, unsupported_source="stored fused and interleaved")
    with pytest.raises(CaseInputError, match="its checkpoint values cannot be read: stored fused and interleaved"):
        load_slice(folder, unreadable)
