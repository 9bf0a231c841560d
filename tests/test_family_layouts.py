"""Megatron's parameter layout for the three MoE families of correctness/families.yaml (qwen3_moe,
gpt_oss, deepseek_v3), on model facts generated from their configs (fixtures/configs/<Model>/
config.json, correctness/model_config.py): the TP 2 / EP 4 slices of the first layer of each layer
kind at the recipe and smoke scales (names in named_parameters() order, shapes, counts, experts per
EP rank, checkpoint pieces), read back from a fake checkpoint, and compared with megatron-core's own
layers built on the CPU.

Every expected number is computed here from the config's own fields (hidden_size,
num_attention_heads, ...), not from the generated facts, so that a mistake in either the generator
or the layout shows. Megatron's layers are built with megatron-core's local spec (no Transformer
Engine on the CPU); where the TE spec the recipes run differs (fused norms, MLA's duplicated down
projections, TE GroupedLinear's names) the mapping is spelled out in `te_name`.
"""

import copy
import json
import math
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from correctness.adam.split import offload_split, offload_summary
from correctness.adam.synthetic_values import synthetic_slice
from correctness.errors import CaseInputError, RecipeError
from correctness.fixtures import CONFIGS_DIR
from correctness.model_config import facts_from_config
from correctness.models import ModelFacts
from correctness.optimizer.checkpoint_values import load_slice
from correctness.megatron.layout import RECIPE, SMOKE, first_layer_of_each_kind, layer_kinds, param_slices

CONFIGS = CONFIGS_DIR
QWEN, GPT_OSS, MOONLIGHT = "Qwen3-30B-A3B", "GPT-OSS-20B", "Moonlight-16B-A3B"
MODELS = (QWEN, GPT_OSS, MOONLIGHT)
FAMILY = {QWEN: "qwen3_moe", GPT_OSS: "gpt_oss", MOONLIGHT: "deepseek_v3"}
DEEPSEEK_V3_Q_LORA_RANK = 1536  # DeepSeek-V3's config (not among the fixtures): q_lora_rank 1536
TP, EP = 2, 4
EMBEDDING_ROWS = 8192
EMBEDDING = "embedding.word_embeddings.weight"
SCALES = (RECIPE, SMOKE)


def config(model: str) -> dict:
    return json.loads((CONFIGS / model / "config.json").read_text())


def facts(model: str, **mla) -> ModelFacts:
    """The generated model facts; `mla` overrides attention.mla fields (DeepSeek-V3's q_lora_rank)."""
    data = facts_from_config(CONFIGS / model / "config.json")
    if mla:
        data = copy.deepcopy(data)
        data["attention"]["mla"].update(mla)
    return ModelFacts(name=data["name"], short_name=data["short_name"], data=data)


@pytest.fixture(scope="module", params=MODELS)
def model_name(request):
    return request.param


def slices(model: ModelFacts, scale=RECIPE, tp=TP, tp_rank=0, ep=EP, ep_rank=0, layers=None):
    return param_slices(model, tp=tp, tp_rank=tp_rank, ep=ep, ep_rank=ep_rank, scale=scale,
                        layers=first_layer_of_each_kind(model) if layers is None else layers,
                        embedding_rows=EMBEDDING_ROWS)


def by_layer(params, layer):
    """{name without the layer prefix: slice} of one layer, in order."""
    prefix = f"decoder.layers.{layer}."
    return {p.name.removeprefix(prefix): p for p in params if p.layer == layer}


def attention_dims(cfg, divisor=1):
    """hidden, query heads, key-value heads, head dim of a config at a scale's divisor."""
    return (cfg["hidden_size"] // divisor, cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["head_dim"] // divisor)


def expert_names(local, *tensors):
    """TE GroupedLinear's names for `local` experts: each tensor group's weight{i} (and bias{i})."""
    return [name.format(i) for group in tensors for i in range(local) for name in group]


# --- the layer kinds and their first layers -------------------------------------------------------


def test_family_sections_and_first_layers(model_name):
    model, cfg = facts(model_name), config(model_name)
    assert model.field("family") == FAMILY[model_name]
    for section in ("megatron", "checkpoint", "synthetic"):
        assert isinstance(model.field(section), dict)
    if model_name == MOONLIGHT:
        dense = cfg["first_k_dense_replace"]
        assert layer_kinds(model) == ("dense", "moe")
        assert first_layer_of_each_kind(model) == (0, dense)
        assert model.attention_kind_of("dense") == model.attention_kind_of("moe") == "global"
    elif model_name == GPT_OSS:
        assert layer_kinds(model) == ("sliding", "global")
        first = {kind: cfg["layer_types"].index(hf) for kind, hf in (("sliding", "sliding_attention"),
                                                                     ("global", "full_attention"))}
        assert first_layer_of_each_kind(model) == tuple(sorted(first.values())) == (0, 1)
    else:
        assert layer_kinds(model) == ("global",) and first_layer_of_each_kind(model) == (0,)


# --- Qwen3-30B-A3B ---------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", SCALES, ids=lambda s: s.name)
def test_qwen3_moe_slices(scale):
    model, cfg = facts(QWEN), config(QWEN)
    d = scale.divisor
    hidden, heads, kv, head = attention_dims(cfg, d)
    experts, ffn = cfg["num_experts"], cfg["moe_intermediate_size"] // d
    local = experts // EP
    params = slices(model, scale, ep_rank=1)
    layer = by_layer(params, 0)
    assert params[0].name == EMBEDDING and params[0].shape == (EMBEDDING_ROWS // d, hidden)
    assert list(layer) == [
        "self_attention.linear_proj.weight",
        "self_attention.linear_qkv.layer_norm_weight",
        "self_attention.linear_qkv.weight",
        "self_attention.q_layernorm.weight",
        "self_attention.k_layernorm.weight",
        "pre_mlp_layernorm.weight",
        "mlp.router.weight",
    ] + expert_names(local, ["mlp.experts.linear_fc1.weight{}"], ["mlp.experts.linear_fc2.weight{}"])
    shapes = {
        "self_attention.linear_proj.weight": (hidden, heads * head // TP),
        "self_attention.linear_qkv.layer_norm_weight": (hidden,),
        "self_attention.linear_qkv.weight": ((heads + 2 * kv) * head // TP, hidden),
        "self_attention.q_layernorm.weight": (head,),
        "self_attention.k_layernorm.weight": (head,),
        "pre_mlp_layernorm.weight": (hidden,),
        "mlp.router.weight": (experts, hidden),
        "mlp.experts.linear_fc1.weight0": (2 * ffn, hidden),
        "mlp.experts.linear_fc2.weight0": (hidden, ffn),
    }
    for name, shape in shapes.items():
        assert layer[name].shape == shape, name
    fc1 = [p for p in layer.values() if ".linear_fc1." in p.name]
    assert [p.expert for p in fc1] == list(range(local, 2 * local))  # EP rank 1's experts
    assert {p.optimizer for p in layer.values() if p.expert is not None} == {"expert"}
    assert {p.optimizer for p in params if p.expert is None} == {"dense"}
    per_layer = (hidden * heads * head // TP + hidden + (heads + 2 * kv) * head * hidden // TP + 2 * head + hidden
                 + experts * hidden + local * 3 * ffn * hidden)
    assert sum(p.numel for p in params) == EMBEDDING_ROWS // d * hidden + per_layer
    assert len(params) == 1 + 7 + 2 * local
    if scale is RECIPE:
        first = layer["mlp.experts.linear_fc1.weight0"]
        assert [(s.tensor, s.rows, s.at) for s in first.sources] == [
            (f"model.layers.0.mlp.experts.{local}.gate_proj.weight", (0, ffn), 0),
            (f"model.layers.0.mlp.experts.{local}.up_proj.weight", (0, ffn), ffn),
        ]
    else:
        assert all(not p.sources for p in params)


# --- GPT-OSS-20B -----------------------------------------------------------------------------------


GPT_OSS_EXPERT_TENSORS = (
    ["mlp.experts.linear_fc1.weight{}", "mlp.experts.linear_fc1.bias{}"],
    ["mlp.experts.linear_fc2.weight{}", "mlp.experts.linear_fc2.bias{}"],
)


@pytest.mark.parametrize("scale", SCALES, ids=lambda s: s.name)
def test_gpt_oss_slices(scale):
    model, cfg = facts(GPT_OSS), config(GPT_OSS)
    d = scale.divisor
    hidden, heads, kv, head = attention_dims(cfg, d)
    experts, ffn = cfg["num_local_experts"], cfg["intermediate_size"] // d
    local = experts // EP
    params = slices(model, scale)
    qkv_rows = (heads + 2 * kv) * head // TP
    shapes = {
        "self_attention.core_attention.softmax_offset": (heads // TP,),
        "self_attention.linear_proj.weight": (hidden, heads * head // TP),
        "self_attention.linear_proj.bias": (hidden,),
        "self_attention.linear_qkv.layer_norm_weight": (hidden,),
        "self_attention.linear_qkv.weight": (qkv_rows, hidden),
        "self_attention.linear_qkv.bias": (qkv_rows,),
        "pre_mlp_layernorm.weight": (hidden,),
        "mlp.router.weight": (experts, hidden),
        "mlp.router.bias": (experts,),
    }
    expert_shapes = {"linear_fc1.weight": (2 * ffn, hidden), "linear_fc1.bias": (2 * ffn,),
                     "linear_fc2.weight": (hidden, ffn), "linear_fc2.bias": (hidden,)}
    for layer_number, kind in ((0, "sliding"), (1, "global")):
        layer = by_layer(params, layer_number)
        assert list(layer) == list(shapes) + expert_names(local, *GPT_OSS_EXPERT_TENSORS)
        assert {p.layer_kind for p in layer.values()} == {kind}
        for name, shape in shapes.items():
            assert layer[name].shape == shape, name
        for name, p in layer.items():
            if p.expert is not None:
                assert p.shape == expert_shapes[re.sub(r"^mlp\.experts\.|\d+$", "", name)], name
                assert p.unsupported_source and "HF's fused experts." in p.unsupported_source
                assert p.sources == () and p.optimizer == "expert" and p.expert < local
            else:
                assert p.unsupported_source is None
                assert bool(p.sources) == (scale is RECIPE), name
        # Biases, sinks and norms are not weight-decayed; every 2-D weight is.
        assert {name for name, p in layer.items() if not p.weight_decay} == {
            name for name, p in layer.items() if len(p.shape) == 1}
        for name in ("self_attention.linear_proj.bias", "self_attention.linear_qkv.bias", "mlp.router.bias",
                     "mlp.experts.linear_fc1.bias0", "self_attention.core_attention.softmax_offset"):
            assert (layer[name].init_mean, layer[name].init_std) == (0.0, 0.02), name
    per_layer = (heads // TP + hidden * heads * head // TP + 2 * hidden + qkv_rows * (hidden + 1) + hidden
                 + experts * (hidden + 1) + local * (2 * ffn * (hidden + 1) + hidden * (ffn + 1)))
    assert sum(p.numel for p in params) == EMBEDDING_ROWS // d * hidden + 2 * per_layer
    assert len(params) == 1 + 2 * (9 + 4 * local)


def test_gpt_oss_recipe_pieces():
    """The pieces of GPT-OSS's attention tensors at TP rank 1: the second half of the groups, of the
    query heads' sinks, and whole biases of the row-parallel and replicated tensors."""
    model, cfg = facts(GPT_OSS), config(GPT_OSS)
    hidden, heads, kv, head = attention_dims(cfg)
    layer = by_layer(slices(model, tp_rank=1, layers=[0]), 0)

    def pieces(name):
        return [(s.tensor.removeprefix("model.layers.0."), s.rows, s.cols, s.at) for s in layer[name].sources]

    assert pieces("self_attention.core_attention.softmax_offset") == [("self_attn.sinks", (heads // 2, heads), None, 0)]
    assert pieces("self_attention.linear_proj.bias") == [("self_attn.o_proj.bias", (0, hidden), None, 0)]
    assert pieces("mlp.router.bias") == [("mlp.router.bias", (0, cfg["num_local_experts"]), None, 0)]
    per_group = heads // kv
    block = (per_group + 2) * head
    expected, at = [], 0
    for group in range(kv // 2, kv):  # rank 1 holds the second half of the groups
        for tensor, first, rows in (("q_proj", group * per_group * head, per_group * head),
                                    ("k_proj", group * head, head), ("v_proj", group * head, head)):
            expected.append((f"self_attn.{tensor}.bias", (first, first + rows), None, at))
            at += rows
    assert pieces("self_attention.linear_qkv.bias") == expected and at == kv // 2 * block
    weight = [(t.replace(".bias", ".weight"), rows, (0, hidden), a) for t, rows, _, a in expected]
    assert pieces("self_attention.linear_qkv.weight") == weight


# --- Moonlight-16B-A3B (DeepSeek-V3's architecture) --------------------------------------------


def mla_dims(cfg, d):
    nope, rope, v = cfg["qk_nope_head_dim"] // d, cfg["qk_rope_head_dim"] // d, cfg["v_head_dim"] // d
    return nope, rope, v, cfg["kv_lora_rank"] // d


@pytest.mark.parametrize("scale", SCALES, ids=lambda s: s.name)
@pytest.mark.parametrize("q_lora_rank", [None, DEEPSEEK_V3_Q_LORA_RANK], ids=["moonlight", "deepseek-v3-q-lora"])
def test_deepseek_v3_slices(scale, q_lora_rank):
    model, cfg = facts(MOONLIGHT, q_lora_rank=q_lora_rank), config(MOONLIGHT)
    assert cfg["q_lora_rank"] is None  # Moonlight's own; DeepSeek-V3's 1536 is laid over it
    d = scale.divisor
    hidden, heads, vocab_rows = cfg["hidden_size"] // d, cfg["num_attention_heads"], EMBEDDING_ROWS // d
    nope, rope, v, kv_rank = mla_dims(cfg, d)
    experts, ffn = cfg["n_routed_experts"], cfg["moe_intermediate_size"] // d
    dense_ffn, shared = cfg["intermediate_size"] // d, cfg["n_shared_experts"] * ffn
    local = experts // EP
    params = slices(model, scale)
    if q_lora_rank is None:
        q_names = {"self_attention.linear_q_proj.weight": (heads * (nope + rope) // TP, hidden)}
    else:
        q_rank = q_lora_rank // d
        q_names = {
            "self_attention.linear_q_down_proj.weight": (q_rank, hidden),  # duplicated: whole on every rank
            "self_attention.linear_q_up_proj.layer_norm_weight": (q_rank,),
            "self_attention.linear_q_up_proj.weight": (heads * (nope + rope) // TP, q_rank),
        }
    attention = {
        "input_layernorm.weight": (hidden,),
        "self_attention.linear_proj.weight": (hidden, heads * v // TP),
        **q_names,
        "self_attention.linear_kv_down_proj.weight": (kv_rank + rope, hidden),  # duplicated
        "self_attention.linear_kv_up_proj.layer_norm_weight": (kv_rank,),
        "self_attention.linear_kv_up_proj.weight": (heads * (nope + v) // TP, kv_rank),
    }
    dense_mlp = {
        "mlp.linear_fc1.layer_norm_weight": (hidden,),
        "mlp.linear_fc1.weight": (2 * dense_ffn // TP, hidden),
        "mlp.linear_fc2.weight": (hidden, dense_ffn // TP),
    }
    moe_head = {"pre_mlp_layernorm.weight": (hidden,), "mlp.router.weight": (experts, hidden)}
    moe_tail = {"mlp.shared_experts.linear_fc1.weight": (2 * shared // TP, hidden),
                "mlp.shared_experts.linear_fc2.weight": (hidden, shared // TP)}
    dense_layer, moe_layer = first_layer_of_each_kind(model)
    dense, moe = by_layer(params, dense_layer), by_layer(params, moe_layer)
    assert {p.layer_kind for p in dense.values()} == {"dense"} and {p.layer_kind for p in moe.values()} == {"moe"}
    assert list(dense) == list(attention) + list(dense_mlp)
    experts_order = expert_names(local, ["mlp.experts.linear_fc1.weight{}"], ["mlp.experts.linear_fc2.weight{}"])
    assert list(moe) == list(attention) + list(moe_head) + experts_order + list(moe_tail)
    for layer, expected in ((dense, {**attention, **dense_mlp}), (moe, {**attention, **moe_head, **moe_tail})):
        for name, shape in expected.items():
            assert layer[name].shape == shape, name
    assert moe["mlp.experts.linear_fc1.weight0"].shape == (2 * ffn, hidden)
    assert moe["mlp.experts.linear_fc2.weight0"].shape == (hidden, ffn)
    replicated = {name for name, p in moe.items() if p.kind == "replicated"}
    assert replicated == {"mlp.router.weight", "self_attention.linear_kv_down_proj.weight"} | (
        {"self_attention.linear_q_down_proj.weight"} if q_lora_rank else set())
    attention_count = sum(math.prod(shape) for shape in attention.values())
    total = (vocab_rows * hidden + 2 * attention_count + sum(math.prod(s) for s in dense_mlp.values())
             + hidden + experts * hidden + local * 3 * ffn * hidden + 3 * shared * hidden // TP)
    assert sum(p.numel for p in params) == total
    if scale is RECIPE and q_lora_rank is None:
        q = dense["self_attention.linear_q_proj.weight"]
        assert [(s.tensor, s.rows, s.cols) for s in q.sources] == [
            ("model.layers.0.self_attn.q_proj.weight", (0, heads // TP * (nope + rope)), (0, hidden))]
        up = moe["self_attention.linear_kv_up_proj.weight"]
        assert [(s.tensor, s.rows) for s in up.sources] == [
            (f"model.layers.{moe_layer}.self_attn.kv_b_proj.weight", (0, heads // TP * (nope + v)))]


# --- every family: the split, pieces, errors ---------------------------------------------------


@pytest.mark.parametrize("scale", SCALES, ids=lambda s: s.name)
def test_offload_split_and_optimizers(model_name, scale):
    """The offload split takes these slices as it takes the seed models': every tensor gets a share,
    experts go to the expert optimizer at EP > 1 and stay dense at EP 1; at the smoke scale (the CPU
    tier's) every slice draws its synthetic values."""
    model = facts(model_name)
    params = slices(model, scale)
    if scale is SMOKE:
        for p in params:
            values = synthetic_slice(p, seed=0)
            assert values.shape == p.shape and values.dtype == torch.bfloat16 and torch.isfinite(values).all()
    shares = offload_split(params, 0.8)
    assert set(shares) == {p.name for p in params} and len(shares) == len(params)
    summary = offload_summary(params, 0.8)
    assert set(summary.optimizers) == {"dense", "expert"}
    assert summary.optimizers["expert"].tensors == sum(p.expert is not None for p in params)
    at_ep1 = slices(model, scale, ep=1)
    assert {p.optimizer for p in at_ep1} == {"dense"}
    local = model.field("moe.experts")
    assert sum(1 for p in at_ep1 if p.expert is not None and ".linear_fc1.weight" in p.name) == local * sum(
        model.layer_kind(layer) != "dense" for layer in first_layer_of_each_kind(model))


def test_recipe_pieces_cover_every_row(model_name):
    """At the recipe scale each slice with sources is covered exactly, block after block."""
    for tp_rank in range(TP):
        for p in slices(facts(model_name), tp_rank=tp_rank, ep_rank=EP - 1):
            if p.unsupported_source:
                assert p.sources == ()
                continue
            at = 0
            for piece in sorted(p.sources, key=lambda s: s.at):
                assert piece.at == at and piece.shape[1:] == p.shape[1:], p.name
                at += piece.shape[0]
            assert at == p.shape[0], p.name


def test_spec_errors():
    model = facts(GPT_OSS)
    data = copy.deepcopy(model.data)
    data["megatron"]["layer_tensors"][-1]["source"] = "expert_down_proj"
    broken = ModelFacts(name="Broken", short_name="broken", data=data)
    with pytest.raises(RecipeError, match=r"linear_fc2\.weight\{expert\}: give source or unsupported_source"):
        slices(broken, layers=[0])
    data = copy.deepcopy(model.data)
    data["megatron"]["layer_tensors"][-1]["unsupported_source"] = ""
    broken = ModelFacts(name="Broken", short_name="broken", data=data)
    with pytest.raises(RecipeError, match=r"unsupported_source must say why"):
        slices(broken, layers=[0])
    data = copy.deepcopy(facts(MOONLIGHT).data)
    data["megatron"]["layer_tensors"]["dense"][2]["if_null"] = 3
    broken = ModelFacts(name="Broken", short_name="broken", data=data)
    with pytest.raises(RecipeError, match=r"linear_q_proj\.weight: if_null must name a field"):
        slices(broken, layers=[0])
    data = copy.deepcopy(facts(MOONLIGHT).data)
    del data["attention"]["mla"]["q_lora_rank"]
    broken = ModelFacts(name="Broken", short_name="broken", data=data)
    with pytest.raises(RecipeError, match=r"missing field attention\.mla\.q_lora_rank"):
        slices(broken, layers=[0])
    data = copy.deepcopy(facts(MOONLIGHT).data)
    del data["attention"]["mla"]["kv_lora_rank"]
    broken = ModelFacts(name="Broken", short_name="broken", data=data)
    with pytest.raises(RecipeError, match=r"missing field attention\.mla\.kv_lora_rank"):
        slices(broken, layers=[0])


# --- values read back from a fake checkpoint -------------------------------------------------------


def tiny(model_name):
    """The family's layout at toy size (hidden 8, 4 query heads over 2 groups, 4 experts, head dims
    4): the checkpoint round trip does not need the real sizes."""
    model = facts(model_name)
    data = copy.deepcopy(model.data)
    data.update(hidden_size=8, vocab_size=16)
    data["attention"]["query_heads"] = 4
    for kind in data["attention"]["kinds"].values():
        kind.update(kv_heads=2 if model_name != MOONLIGHT else 4, head_dim=4)
    data["moe"].update(experts=4, expert_ffn_hidden_size=6)
    if model_name == MOONLIGHT:
        data.update(ffn_hidden_size=10)
        data["attention"]["kinds"]["global"]["v_head_dim"] = 2
        data["attention"]["mla"].update(kv_lora_rank=6, qk_nope_head_dim=3, qk_rope_head_dim=1, v_head_dim=2)
        data["moe"]["shared_expert_ffn_hidden_size"] = 12
    return ModelFacts(name="Tiny", short_name="tiny", data=data)


def bridge_slice(full, model, param, tp, tp_rank):
    """A slice cut the way Megatron-Bridge's mappings cut it (param_mapping.py: ColumnParallelMapping
    chunks dim 0, RowParallelMapping chunks dim 1 and keeps a 1-D bias whole, QKVMapping interleaves
    q, k, v per group before chunking, GatedMLPMapping chunks gate and up on their own; duplicated
    and replicated tensors are whole; experts whole at ETP 1), from the full HF tensors."""
    hf = {key.removeprefix(f"model.layers.{param.layer}."): value for key, value in full.items()}
    heads, groups = model.field("attention.query_heads"), model.attention_kind("global").kv_heads

    def chunk(tensor, dim=0):
        return torch.chunk(tensor, tp, dim=dim)[tp_rank]

    def qkv(suffix):
        q, k, v = (hf[f"self_attn.{t}_proj.{suffix}"] for t in "qkv")
        q = q.reshape(groups, heads // groups * q.shape[0] // heads, *q.shape[1:])
        k, v = (t.reshape(groups, t.shape[0] // groups, *t.shape[1:]) for t in (k, v))
        return chunk(torch.cat([q, k, v], dim=1).reshape(-1, *q.shape[2:]))

    def gated(prefix, split=True):
        gate, up = hf[f"{prefix}.gate_proj.weight"], hf[f"{prefix}.up_proj.weight"]
        return torch.cat([chunk(gate), chunk(up)]) if split else torch.cat([gate, up])

    table = {
        EMBEDDING: lambda: chunk(full["model.embed_tokens.weight"]),
        "self_attention.linear_qkv.weight": lambda: qkv("weight"),
        "self_attention.linear_qkv.bias": lambda: qkv("bias"),
        "self_attention.linear_qkv.layer_norm_weight": lambda: hf["input_layernorm.weight"],
        "input_layernorm.weight": lambda: hf["input_layernorm.weight"],
        "self_attention.linear_proj.weight": lambda: chunk(hf["self_attn.o_proj.weight"], 1),
        "self_attention.linear_proj.bias": lambda: hf["self_attn.o_proj.bias"],
        "self_attention.core_attention.softmax_offset": lambda: chunk(hf["self_attn.sinks"]),
        "self_attention.q_layernorm.weight": lambda: hf["self_attn.q_norm.weight"],
        "self_attention.k_layernorm.weight": lambda: hf["self_attn.k_norm.weight"],
        "self_attention.linear_q_proj.weight": lambda: chunk(hf["self_attn.q_proj.weight"]),
        "self_attention.linear_kv_down_proj.weight": lambda: hf["self_attn.kv_a_proj_with_mqa.weight"],
        "self_attention.linear_kv_up_proj.layer_norm_weight": lambda: hf["self_attn.kv_a_layernorm.weight"],
        "self_attention.linear_kv_up_proj.weight": lambda: chunk(hf["self_attn.kv_b_proj.weight"]),
        "pre_mlp_layernorm.weight": lambda: hf["post_attention_layernorm.weight"],
        "mlp.linear_fc1.layer_norm_weight": lambda: hf["post_attention_layernorm.weight"],
        "mlp.linear_fc1.weight": lambda: gated("mlp"),
        "mlp.linear_fc2.weight": lambda: chunk(hf["mlp.down_proj.weight"], 1),
        "mlp.router.weight": lambda: hf["mlp.gate.weight" if "mlp.gate.weight" in hf else "mlp.router.weight"],
        "mlp.router.bias": lambda: hf["mlp.router.bias"],
        "mlp.shared_experts.linear_fc1.weight": lambda: gated("mlp.shared_experts"),
        "mlp.shared_experts.linear_fc2.weight": lambda: chunk(hf["mlp.shared_experts.down_proj.weight"], 1),
    }
    name = param.name.removeprefix(f"decoder.layers.{param.layer}.")
    match = re.fullmatch(r"mlp\.experts\.linear_fc([12])\.weight(\d+)", name)
    if match:
        expert = int(match[2])  # EP 1: the local index is the global one
        if match[1] == "1":
            return gated(f"mlp.experts.{expert}", split=False)
        return hf[f"mlp.experts.{expert}.down_proj.weight"]
    return table[name]()


def hf_shapes(model_name, model, layer):
    """The HF tensors of one layer (and the embedding), with their shapes, for the toy model."""
    hidden, vocab, heads = model.field("hidden_size"), model.field("vocab_size"), model.field("attention.query_heads")
    experts, ffn = model.field("moe.experts"), model.field("moe.expert_ffn_hidden_size")
    at, attn = f"layers.{layer}.", f"layers.{layer}.self_attn."
    shapes = {"embed_tokens.weight": (vocab, hidden), at + "input_layernorm.weight": (hidden,),
              at + "post_attention_layernorm.weight": (hidden,)}

    def mlp(prefix, size):
        return {f"{prefix}gate_proj.weight": (size, hidden), f"{prefix}up_proj.weight": (size, hidden),
                f"{prefix}down_proj.weight": (hidden, size)}

    def routed(router):
        shapes[at + router] = (experts, hidden)
        for expert in range(experts):
            shapes.update(mlp(f"{at}mlp.experts.{expert}.", ffn))

    if model_name == MOONLIGHT:
        mla = model.field("attention.mla")
        nope, rope, v, rank = (mla[k] for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank"))
        shapes.update({
            attn + "q_proj.weight": (heads * (nope + rope), hidden), attn + "o_proj.weight": (hidden, heads * v),
            attn + "kv_a_proj_with_mqa.weight": (rank + rope, hidden), attn + "kv_a_layernorm.weight": (rank,),
            attn + "kv_b_proj.weight": (heads * (nope + v), rank),
        })
        if model.layer_kind(layer) == "dense":
            shapes.update(mlp(at + "mlp.", model.field("ffn_hidden_size")))
        else:
            routed("mlp.gate.weight")
            shapes.update(mlp(at + "mlp.shared_experts.", model.field("moe.shared_expert_ffn_hidden_size")))
        return shapes
    kind = model.attention_kind(model.attention_kind_of(model.layer_kind(layer)))
    d, kv = kind.head_dim, kind.kv_heads
    shapes.update({attn + "q_proj.weight": (heads * d, hidden), attn + "k_proj.weight": (kv * d, hidden),
                   attn + "v_proj.weight": (kv * d, hidden), attn + "o_proj.weight": (hidden, heads * d)})
    if model_name == QWEN:
        shapes.update({attn + "q_norm.weight": (d,), attn + "k_norm.weight": (d,)})
        routed("mlp.gate.weight")
    else:  # GPT-OSS: biases, sinks, the router's bias; the fused experts are not read
        shapes.update({attn + "q_proj.bias": (heads * d,), attn + "k_proj.bias": (kv * d,),
                       attn + "v_proj.bias": (kv * d,), attn + "o_proj.bias": (hidden,), attn + "sinks": (heads,),
                       at + "mlp.router.weight": (experts, hidden), at + "mlp.router.bias": (experts,)})
    return shapes


@pytest.mark.parametrize("tp_rank", range(TP))
def test_checkpoint_round_trip(model_name, tp_rank, tmp_path):
    """load_slice assembles every slice that has sources exactly as the Bridge cuts it; GPT-OSS's fused
    expert tensors have none and say why."""
    model = tiny(model_name)
    generator = torch.Generator().manual_seed(11)
    layers = first_layer_of_each_kind(model)
    shapes = {key: shape for layer in layers for key, shape in hf_shapes(model_name, model, layer).items()}
    full = {f"model.{key}": torch.randn(shape, generator=generator).to(torch.bfloat16) for key, shape in shapes.items()}
    save_file(full, str(tmp_path / "model.safetensors"))
    params = param_slices(model, tp=TP, tp_rank=tp_rank, layers=layers, embedding_rows=4)
    checked = 0
    for p in params:
        if p.unsupported_source:
            assert model_name == GPT_OSS and p.expert is not None
            with pytest.raises(CaseInputError):  # never read: no pieces to read
                load_slice(tmp_path, p)
            continue
        expected = bridge_slice(full, model, p, TP, tp_rank)
        if p.name == EMBEDDING:
            expected = expected[: p.shape[0]]
        assert torch.equal(load_slice(tmp_path, p), expected), p.name
        checked += 1
    assert checked == sum(not p.unsupported_source for p in params) > 8


# --- megatron-core's own layers, built on the CPU ---------------------------------------------------

MEGATRON_TP, MEGATRON_EP = 2, 2  # two gloo processes: TP rank r and EP rank r (ETP 1)


def te_name(name: str, *, mla: bool, dense: bool) -> str:
    """The TE spec's name for a local-spec parameter (megatron/core/models/gpt/gpt_layer_specs.py:
    the TE spec fuses the input norm into linear_qkv (not for MLA, which keeps input_layernorm), the
    dense layers' pre-MLP norm into linear_fc1 and, with qk_layernorm, MLA's latent norms into
    linear_q_up_proj / linear_kv_up_proj; TEGroupedMLP names experts weight{i} / bias{i} where the
    local SequentialMLP has local_experts.{i})."""
    match = re.fullmatch(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)", name)
    if match:
        return f"mlp.experts.{match[2]}.{match[3]}{match[1]}"
    renames = {"self_attention.kv_layernorm.weight": "self_attention.linear_kv_up_proj.layer_norm_weight"}
    if mla:
        renames["self_attention.q_layernorm.weight"] = "self_attention.linear_q_up_proj.layer_norm_weight"
    else:
        renames["input_layernorm.weight"] = "self_attention.linear_qkv.layer_norm_weight"
    if dense:
        renames["pre_mlp_layernorm.weight"] = "mlp.linear_fc1.layer_norm_weight"
    return renames.get(name, name)


FUSED_IN_TE = {
    "self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight", "self_attention.linear_q_up_proj.layer_norm_weight",
}
DUPLICATED_IN_TE = {"self_attention.linear_kv_down_proj.weight", "self_attention.linear_q_down_proj.weight"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def megatron_layers(tmp_path_factory):
    """named_parameters() of megatron-core's layers (local spec, meta device, recipe scale) on TP rank
    r / EP rank r, r = 0, 1: two processes over gloo, this file run as a script."""
    out = tmp_path_factory.mktemp("megatron")
    port = _free_port()
    workers = [subprocess.Popen([sys.executable, __file__, str(rank), str(port), str(out)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for rank in range(MEGATRON_TP)]
    logs = [worker.communicate(timeout=600)[0] for worker in workers]
    for worker, log in zip(workers, logs):
        assert worker.returncode == 0, log[-4000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(MEGATRON_TP)]


MEGATRON_CASES = [(QWEN, None), (GPT_OSS, None), (MOONLIGHT, None), (MOONLIGHT, DEEPSEEK_V3_Q_LORA_RANK)]


@pytest.mark.megatron
@pytest.mark.parametrize("model_name, q_lora_rank", MEGATRON_CASES,
                         ids=["qwen3-moe", "gpt-oss", "moonlight", "deepseek-v3-q-lora"])
def test_megatron_layers_agree(megatron_layers, model_name, q_lora_rank):
    """Names (mapped to the TE spec's), shapes, order and expert placement of megatron-core's own
    layers equal param_slices' at TP 2 / EP 2, ranks 0 and 1."""
    model = facts(model_name, **({"q_lora_rank": q_lora_rank} if q_lora_rank else {}))
    mla = model_name == MOONLIGHT
    key = f"{model_name}-{q_lora_rank}"
    for rank, built in enumerate(megatron_layers):
        assert (built["tp_rank"], built["ep_rank"]) == (rank, rank)
        for layer in first_layer_of_each_kind(model):
            kind = model.layer_kind(layer)
            params = slices(model, tp=MEGATRON_TP, tp_rank=rank, ep=MEGATRON_EP, ep_rank=rank, layers=[layer])
            ours = by_layer(params, layer)
            theirs = {te_name(name, mla=mla, dense=kind == "dense"): (tuple(shape), allreduce)
                      for name, shape, allreduce in built["layers"][f"{key}-{kind}"]}
            assert set(theirs) == set(ours), (kind, sorted(set(theirs) ^ set(ours)))
            for name, p in ours.items():
                shape, allreduce = theirs[name]
                if name in DUPLICATED_IN_TE:  # the local spec splits it over TP; TE's TELinear is duplicated
                    assert p.kind == "replicated" and shape == (p.shape[0] // MEGATRON_TP, p.shape[1]), name
                else:
                    assert shape == p.shape, name
                assert allreduce == (p.optimizer == "dense"), name  # Megatron: allreduce False for experts at EP > 1
            local_order = [n for n in theirs if n not in FUSED_IN_TE and ".experts." not in n]
            assert [n for n in ours if n not in FUSED_IN_TE and ".experts." not in n] == local_order
            expected_experts = built["experts"].get(f"{key}-{kind}")
            got_experts = sorted({p.expert for p in ours.values() if p.expert is not None})
            assert got_experts == (expected_experts or [])


def _megatron_worker(rank: int, port: int, out: Path) -> None:
    """Builds one layer of each case and kind with megatron-core's local spec on the meta device (TP 2,
    EP 2, ETP 1; recipe-scale sizes from the configs) and writes named_parameters(). Shims, only
    here: torch.cuda.current_device returns the meta device (the local DotProductAttention allocates
    its learnable softmax_offset there); multi_latent_attention.HAVE_TE is False (without TE,
    megatron.core.extensions.transformer_engine exports mocks, and MLA's isinstance check on TELinear
    fails); MLA's core attention is a parameter-free stand-in (the local DotProductAttention takes no
    k_channels / v_channels; TE's has no parameters with a vanilla softmax)."""
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=MEGATRON_TP)
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=MEGATRON_TP,
                                             expert_model_parallel_size=MEGATRON_EP, expert_tensor_parallel_size=1)
    import megatron.core.transformer.multi_latent_attention as mla_module
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    torch.cuda.current_device = lambda: torch.device("meta")
    mla_module.HAVE_TE = False

    class NoParameters(torch.nn.Module):
        def __init__(self, **_):
            super().__init__()

    common = dict(num_layers=1, use_cpu_initialization=True, perform_initialization=False, params_dtype=torch.bfloat16,
                  bf16=True, moe_grouped_gemm=False, gated_linear_unit=True, normalization="RMSNorm",
                  tensor_model_parallel_size=MEGATRON_TP, expert_model_parallel_size=MEGATRON_EP,
                  expert_tensor_parallel_size=1)
    cases = {}
    q = config(QWEN)
    cases[f"{QWEN}-None"] = (TransformerConfig(
        hidden_size=q["hidden_size"], num_attention_heads=q["num_attention_heads"],
        num_query_groups=q["num_key_value_heads"], kv_channels=q["head_dim"], ffn_hidden_size=q["intermediate_size"],
        num_moe_experts=q["num_experts"], moe_ffn_hidden_size=q["moe_intermediate_size"],
        moe_router_topk=q["num_experts_per_tok"], add_bias_linear=False, qk_layernorm=True, **common),
        {"global": q["num_experts"]}, False)
    g = config(GPT_OSS)
    cases[f"{GPT_OSS}-None"] = (TransformerConfig(
        hidden_size=g["hidden_size"], num_attention_heads=g["num_attention_heads"],
        num_query_groups=g["num_key_value_heads"], kv_channels=g["head_dim"], ffn_hidden_size=g["intermediate_size"],
        num_moe_experts=g["num_local_experts"], moe_ffn_hidden_size=g["intermediate_size"],
        moe_router_topk=g["num_experts_per_tok"], add_bias_linear=g["attention_bias"], softmax_type="learnable",
        qk_layernorm=False, **common), {"sliding": g["num_local_experts"], "global": g["num_local_experts"]}, False)
    m = config(MOONLIGHT)
    for q_lora_rank in (None, DEEPSEEK_V3_Q_LORA_RANK):
        cases[f"{MOONLIGHT}-{q_lora_rank}"] = (MLATransformerConfig(
            hidden_size=m["hidden_size"], num_attention_heads=m["num_attention_heads"], q_lora_rank=q_lora_rank,
            kv_lora_rank=m["kv_lora_rank"], qk_head_dim=m["qk_nope_head_dim"],
            qk_pos_emb_head_dim=m["qk_rope_head_dim"],
            v_head_dim=m["v_head_dim"], rope_type="rope", ffn_hidden_size=m["intermediate_size"],
            num_moe_experts=m["n_routed_experts"], moe_ffn_hidden_size=m["moe_intermediate_size"],
            moe_shared_expert_intermediate_size=m["moe_intermediate_size"] * m["n_shared_experts"],
            moe_router_topk=m["num_experts_per_tok"], add_bias_linear=False, qk_layernorm=True,
            multi_latent_attention=True, moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid",
            **common), {"dense": None, "moe": m["n_routed_experts"]}, True)
    layers, experts = {}, {}
    for key, (cfg, kinds, mla) in cases.items():
        for kind, num_experts in kinds.items():
            spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False,
                                            qk_layernorm=cfg.qk_layernorm, multi_latent_attention=mla,
                                            normalization="RMSNorm")
            if mla:
                spec.submodules.self_attention.submodules.core_attention = NoParameters
            with torch.device("meta"):
                layer = build_module(spec, config=cfg, layer_number=1)
            layers[f"{key}-{kind}"] = [(name, list(p.shape), getattr(p, "allreduce", True))
                                       for name, p in layer.named_parameters()]
            if num_experts:
                experts[f"{key}-{kind}"] = list(layer.mlp.local_expert_indices)
    result = {"tp_rank": parallel_state.get_tensor_model_parallel_rank(),
              "ep_rank": parallel_state.get_expert_model_parallel_rank(), "layers": layers, "experts": experts}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    _megatron_worker(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
