"""Megatron's parameter layout for the optimizer lever: the TP/EP slices of Gemma-4-31B and
Nemotron-3-Super (names, shapes, kinds, checkpoint pieces, optimizers), the offload split they give,
and the refusal of bad inputs.

The recipe's numbers (21 tensors, 556,051,968 parameters, 19.8% on the GPU at fraction 0.8: the
embedding slice, layer 0's linear_qkv and linear_proj, every norm gain) are the specification the
derivation from the model facts must reproduce; they are stated in the recipe's correctness block.
"""

import copy
import math

import pytest
import torch

from correctness.adam.config import optimizer_config
from correctness.adam.split import CPU, GPU, offload_order, offload_orders, offload_split, offload_summary
from correctness.adam.synthetic_values import synthetic_slice
from correctness.errors import RecipeError, ShapeError
from correctness.models import ModelFacts
from correctness.megatron.layout import RECIPE, SMOKE, first_layer_of_each_kind, layer_kinds, param_slices
from optimizer_params import EMBEDDING, EMBEDDING_ROWS, LAYERS, nemotron_slices, recipe_slices


@pytest.fixture(scope="module")
def fraction(gemma_recipe):
    return gemma_recipe.field("layout.offload.optimizer_fraction")


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


def test_gemma_slices_are_all_dense(gemma_recipe, gemma, fraction):
    params = recipe_slices(gemma_recipe, gemma)
    assert {(p.optimizer, p.ep, p.ep_rank, p.expert) for p in params} == {("dense", 1, 0, None)}
    summary = offload_summary(params, fraction)
    assert list(summary.optimizers) == ["dense"]
    dense = summary.optimizers["dense"]
    assert (dense.cpu, dense.gpu, dense.gpu_numel) == (summary.cpu, summary.gpu, summary.gpu_numel)
    assert (dense.tensors, dense.parameters) == (21, 556_051_968)
    assert first_layer_of_each_kind(gemma) == LAYERS


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


# --- Nemotron-3-Super: hybrid Mamba-2 / MoE / attention at TP 4, EP 8 ---------------------------
#
# The recipe's offload fraction is 0.55 for each of Megatron's two optimizers. The figures below
# are this derivation's result (nothing upstream states them): the recipe scale has 147 tensors,
# 443,705,952 parameters (dense 19 / 91,384,416, expert 128 / 352,321,536); at 0.55 the dense
# optimizer keeps the embedding slice and its 8 1-D tensors on the GPU (33,571,424, 36.74%), the
# expert optimizer the first 57 experts' linear_fc1 (156,893,184, 44.53%).

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
