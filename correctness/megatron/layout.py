"""Megatron's parameter layout: which slices of which named tensors one TP/EP rank holds.
`param_slices` lists them in model order (the embedding, then each layer's tensors in Megatron's
named_parameters() order) at a `ParamScale` (RECIPE or SMOKE), each with its rank-local shape, kind,
weight-decay group, optimizer ("dense" or "expert"), the checkpoint blocks it is assembled from
(`SourcePiece`, read by checkpoint_values) and its synthetic magnitudes (drawn by synthetic_values).
Everything model-specific comes from the model's fixture (fixtures/models/<name>.yaml) or its
architecture family (correctness/families.yaml): the `megatron:` section (names, kinds, layouts,
module order; one list for every layer, or one list per layer kind for a hybrid model), the
`checkpoint:` section (HF tensor names per layer) and the `synthetic:` magnitudes.

Spec keys beyond name, kind and source: the dimensions (`rows`, `cols`, `size`, `parts`, `trailing`:
symbols of DIMENSIONS), `layout` (qkv-grouped, gate-up, parts), `init` (a synthetic magnitude),
`if_set` / `if_null` (a dotted model field: the tensor exists only where the field is set / null,
e.g. MLA's linear_q_proj where attention.mla.q_lora_rank is null), `bias` (on a routed-expert spec:
the expert's bias, which TE's GroupedLinear registers right after each expert's weight) and
`unsupported_source` (instead of `source`: why the checkpoint's tensor cannot be read as row blocks;
the slice then has no `sources` at any scale and `unsupported_source` says why)."""

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from correctness.errors import RecipeError, ShapeError
from correctness.models import ModelFacts

KINDS = ("embedding", "column-parallel", "row-parallel", "norm", "replicated", "expert")
OPTIMIZERS = ("dense", "expert")  # Megatron's chained optimizers, in its order
# Dimension symbols a tensor spec may use (see _Dimensions).
DIMENSIONS = (
    "hidden", "ffn", "attention", "head_dim", "mamba_inner", "mamba_heads", "mamba_state_groups",
    "conv_kernel", "experts", "expert_ffn", "latent", "shared_ffn",
    "query_heads", "attention_v", "mla_q", "q_lora_rank", "kv_lora_rank", "mla_kv_down", "mla_kv_up",
)
NORM_GAIN = "norm_gain"  # an `init` naming the fixture's norm gain magnitudes


@dataclass(frozen=True, kw_only=True)
class ParamScale:
    """How big the parameters are: `divisor` divides hidden, FFN, head dims and embedding rows."""

    name: str
    divisor: int = 1


# Scales: RECIPE keeps the model's dimensions. SMOKE divides hidden, FFN, head dims (attention,
# MLA's and Mamba's), MLA's latent ranks, the Mamba state size, the expert, latent and shared-expert
# FFN sizes and the embedding rows by 16, and keeps head, group and expert counts, the conv kernel,
# the tensor list, order, kinds and the TP/EP split. For a dense model every 2-D tensor is then
# 1/256 of its recipe size (norms 1/16), so the offload split falls at the same tensors; tensors with
# an unscaled dimension (the router's expert rows, Mamba's per-head rows, attention sinks) shrink
# less, so a hybrid or MoE model's split may move. Smoke slices have no checkpoint counterpart
# (`sources` is empty); use synthetic values.
RECIPE = ParamScale(name="recipe")
SMOKE = ParamScale(name="smoke", divisor=16)
PARAM_SCALES = {scale.name: scale for scale in (RECIPE, SMOKE)}


@dataclass(frozen=True, kw_only=True)
class SourcePiece:
    """One block of a checkpoint tensor: its rows [start, stop) and columns [start, stop) (None for
    a 1-D tensor, or all trailing dimensions of an N-D one), landing at rank-local row `at` across
    all of the slice's columns."""

    tensor: str
    rows: tuple[int, int]
    cols: tuple[int, int] | None
    at: int

    @property
    def shape(self) -> tuple[int, ...]:
        rows = (self.rows[1] - self.rows[0],)
        return rows if self.cols is None else (*rows, self.cols[1] - self.cols[0])

    def text(self) -> str:
        cols = "" if self.cols is None else f", cols {self.cols[0]}:{self.cols[1]}"
        return f"rows {self.rows[0]}:{self.rows[1]}{cols}"


@dataclass(frozen=True, kw_only=True)
class ParamSlice:
    """One rank's part of a named Megatron parameter."""

    name: str  # Megatron's name, e.g. decoder.layers.0.self_attention.linear_qkv.weight
    shape: tuple[int, ...]  # rank-local
    layer: int | None  # None for the embedding
    layer_kind: str | None  # its layer's kind (Gemma: sliding, global; Nemotron: mamba, moe, attention); None: emb.
    kind: str  # one of KINDS
    weight_decay: bool  # Megatron's default groups: weights yes, 1-D tensors and biases no
    index: int  # position in model order among the slices listed together
    sources: tuple[SourcePiece, ...]  # how to assemble it from the checkpoint; empty at the smoke scale
    fan_in: int | None  # input features of the whole projection; None for norms, the embedding and 1-D tensors
    init_mean: float  # synthetic values: normal(init_mean, init_std)
    init_std: float
    tp: int
    tp_rank: int
    scale: str
    optimizer: str = "dense"  # one of OPTIMIZERS: Megatron's dense or expert-parallel optimizer
    ep: int = 1
    ep_rank: int = 0
    expert: int | None = None  # a routed expert's global index; None for every other tensor
    # Why the checkpoint's tensor cannot be read as row blocks (GPT-OSS's fused, interleaved expert
    # tensors); `sources` is then empty at every scale. None for every tensor that has sources.
    unsupported_source: str | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def group(self) -> str:
        return "weight-decay" if self.weight_decay else "no-weight-decay"


def _spec_error(model: ModelFacts, what: str) -> RecipeError:
    return RecipeError(f"model facts {model.name}: {what}")


def checkpoint_tensor(model: ModelFacts, key: str, layer: int | None = None, expert: int | None = None) -> str:
    """The checkpoint's name for a `checkpoint.tensors` key, with `{layer}` and `{expert}` filled in."""
    templates = model.field("checkpoint.tensors")
    if not isinstance(templates, dict) or not isinstance(templates.get(key), str):
        raise _spec_error(model, f"no checkpoint tensor name checkpoint.tensors.{key}")
    template = templates[key]
    if ("{layer}" in template) != (layer is not None):
        raise _spec_error(model, f"checkpoint.tensors.{key} {template!r} does not fit layer {layer}")
    if ("{expert}" in template) != (expert is not None):
        raise _spec_error(model, f"checkpoint.tensors.{key} {template!r} does not fit expert {expert}")
    values = {"layer": layer, "expert": expert}
    return template.format(**{name: value for name, value in values.items() if value is not None})


def _positive(model: ModelFacts, dotted: str) -> int:
    value = model.field(dotted)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _spec_error(model, f"field {dotted} must be a positive integer, got {value!r}")
    return value


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _divide(value: int, divisor: int, what: str, scale: ParamScale) -> int:
    if value % divisor:
        raise ShapeError(f"{scale.name} scale: {what} {value} is not divisible by {divisor}")
    return value // divisor


def _split(value: int, tp: int, what: str) -> int:
    if value % tp:
        raise ShapeError(f"{what} {value} does not split evenly over TP {tp}")
    return value // tp


class _Dimensions:
    """One layer kind's dimensions at a scale, resolved from the model facts when a spec uses them.
    `units` is what TP must split whole: Mamba heads and groups, otherwise the rows themselves."""

    def __init__(self, model: ModelFacts, kind: str | None, scale: ParamScale):
        self.model, self.kind, self.scale = model, kind, scale
        self._values: dict[str, tuple[int, int, str]] = {}

    def _scaled(self, dotted: str, what: str) -> int:
        return _divide(_positive(self.model, dotted), self.scale.divisor, what, self.scale)

    def _attention(self, symbol: str) -> str:
        """The attention kind this layer kind runs (the layer kind itself, or the model's
        attention.kind_of_layer entry: Moonlight's dense and moe layers run its global attention)."""
        attention = None if self.kind is None else self.model.attention_kind_of(self.kind)
        if attention is None:
            raise _spec_error(self.model, f"dimension {symbol} needs an attention layer kind, not {self.kind!r}")
        return attention

    def _resolve(self, symbol: str) -> tuple[int, int, str]:
        model = self.model
        if symbol == "hidden":
            value = self._scaled("hidden_size", "hidden size")
        elif symbol == "ffn":
            value = self._scaled("ffn_hidden_size", "FFN hidden size")
        elif symbol in ("attention", "head_dim", "query_heads", "attention_v"):
            attention = self._attention(symbol)
            facts = model.attention_kind(attention)
            heads = facts.query_heads
            if symbol == "query_heads":
                return heads, heads, "query heads"
            if symbol == "attention_v":  # the kind's v_head_dim where it has one (MLA), else head_dim
                v_dim = model.field(f"attention.kinds.{attention}").get("v_head_dim", facts.head_dim)
                if not _count(v_dim) or v_dim < 1:
                    raise _spec_error(model, f"field attention.kinds.{attention}.v_head_dim must be a positive integer")
                v_dim = _divide(v_dim, self.scale.divisor, f"{attention} v head dim", self.scale)
                return heads * v_dim, heads, "query heads"
            head_dim = _divide(facts.head_dim, self.scale.divisor, f"{attention} head dim", self.scale)
            value = head_dim if symbol == "head_dim" else heads * head_dim
        elif symbol in ("mla_q", "q_lora_rank", "kv_lora_rank", "mla_kv_down", "mla_kv_up"):
            return self._mla(symbol)
        elif symbol == "mamba_heads":
            heads = _positive(model, "mamba.heads")
            return heads, heads, "Mamba heads"
        elif symbol == "mamba_inner":
            heads = _positive(model, "mamba.heads")
            return heads * self._scaled("mamba.head_dim", "Mamba head dim"), heads, "Mamba heads"
        elif symbol == "mamba_state_groups":
            groups = _positive(model, "mamba.groups")
            return groups * self._scaled("mamba.state_size", "Mamba state size"), groups, "Mamba groups"
        elif symbol == "conv_kernel":
            value = _positive(model, "mamba.conv_kernel")
        elif symbol == "experts":
            value = _positive(model, "moe.experts")
        elif symbol == "expert_ffn":
            value = self._scaled("moe.expert_ffn_hidden_size", "expert FFN hidden size")
        elif symbol == "latent":
            value = self._scaled("moe.latent_size", "MoE latent size")
        elif symbol == "shared_ffn":
            value = self._scaled("moe.shared_expert_ffn_hidden_size", "shared expert FFN hidden size")
        else:
            raise _spec_error(model, f"dimension {symbol!r} is not one of {list(DIMENSIONS)}")
        return value, value, symbol

    def _mla(self, symbol: str) -> tuple[int, int, str]:
        """Multi-head latent attention's dimensions (megatron/core/transformer/multi_latent_attention.py,
        MLASelfAttention): linear_q_proj / linear_q_up_proj rows heads x (qk_nope + qk_rope),
        linear_kv_down_proj rows kv_lora_rank + qk_rope, linear_kv_up_proj rows heads x (qk_nope +
        v_head_dim); the ranks are the latent sizes. Heads are the units TP splits."""
        heads = self.model.attention_kind(self._attention(symbol)).query_heads

        def mla(field: str) -> int:
            return self._scaled(f"attention.mla.{field}", f"MLA {field}")

        if symbol == "mla_q":
            return heads * (mla("qk_nope_head_dim") + mla("qk_rope_head_dim")), heads, "query heads"
        if symbol == "mla_kv_up":
            return heads * (mla("qk_nope_head_dim") + mla("v_head_dim")), heads, "query heads"
        if symbol == "mla_kv_down":
            value = mla("kv_lora_rank") + mla("qk_rope_head_dim")
            return value, value, symbol
        value = mla(symbol)  # q_lora_rank, kv_lora_rank
        return value, value, symbol

    def entry(self, symbol: str) -> tuple[int, int, str]:
        """(value, units, what the units are)."""
        if symbol not in self._values:
            self._values[symbol] = self._resolve(symbol)
        return self._values[symbol]

    def __getitem__(self, symbol: str) -> int:
        return self.entry(symbol)[0]


@dataclass(frozen=True)
class _Kind:
    """One layer kind: its attention geometry (attention kinds only) and dimensions at a scale."""

    name: str
    query_heads: int
    kv_heads: int
    head_dim: int
    k_eq_v: bool
    dims: _Dimensions


def _layer_kind(model: ModelFacts, kind: str, scale: ParamScale) -> _Kind:
    """A layer kind's dimensions, and the geometry of the attention it runs: its own where it is an
    attention kind (Gemma: sliding, global), `attention.kind_of_layer`'s where it only runs one
    (Moonlight: dense and moe layers, global attention), none for a layer without attention (Mamba)."""
    dims = _Dimensions(model, kind, scale)
    attention = model.attention_kind_of(kind)
    if attention is None:
        return _Kind(name=kind, query_heads=0, kv_heads=0, head_dim=0, k_eq_v=False, dims=dims)
    facts = model.attention_kind(attention)
    return _Kind(
        name=kind,
        query_heads=facts.query_heads,
        kv_heads=facts.kv_heads,
        head_dim=dims["head_dim"],
        k_eq_v=bool(model.field(f"attention.kinds.{attention}").get("k_eq_v", False)),
        dims=dims,
    )


def _symbol(model: ModelFacts, spec: dict[str, Any], key: str, symbol: object) -> str:
    if symbol not in DIMENSIONS:
        raise _spec_error(
            model, f"megatron tensor {spec.get('name')}: {key} {symbol!r} is not one of {list(DIMENSIONS)}"
        )
    return str(symbol)


def _dim(model: ModelFacts, spec: dict[str, Any], key: str, kind: _Kind) -> int:
    if key not in spec:
        raise _spec_error(model, f"megatron tensor {spec.get('name')}: no {key}")
    return kind.dims[_symbol(model, spec, key, spec[key])]


def _unsupported(model: ModelFacts, spec: dict[str, Any]) -> str | None:
    """The spec's `unsupported_source` reason, or None where it names a `source`."""
    reason = spec.get("unsupported_source")
    if reason is None:
        return None
    if not isinstance(reason, str) or not reason.strip():
        raise _spec_error(model, f"megatron tensor {spec.get('name')}: unsupported_source must say why, got {reason!r}")
    if "source" in spec:
        raise _spec_error(model, f"megatron tensor {spec.get('name')}: give source or unsupported_source, not both")
    return reason


def _sources(model: ModelFacts, spec: dict[str, Any], roles: Sequence[str]) -> dict[str, str]:
    """The checkpoint keys of the spec's roles; "" for each where the source is unsupported (the
    pieces naming them are dropped)."""
    if _unsupported(model, spec) is not None:
        return {role: "" for role in roles}
    source = spec.get("source")
    if len(roles) == 1 and isinstance(source, str):
        return {roles[0]: source}
    if not isinstance(source, dict) or sorted(source) != sorted(roles):
        raise _spec_error(model, f"megatron tensor {spec.get('name')}: source must name {list(roles)}, got {source!r}")
    return source


def _trailing(model: ModelFacts, spec: dict[str, Any], kind: _Kind) -> tuple[int, ...]:
    """Dimensions after the rows of an N-D tensor (conv1d's [1, kernel]): integers or symbols."""
    trailing = spec.get("trailing", [])
    if not isinstance(trailing, list):
        raise _spec_error(model, f"megatron tensor {spec.get('name')}: trailing must be a list, got {trailing!r}")
    return tuple(
        entry if _count(entry) and entry >= 1 else kind.dims[_symbol(model, spec, "trailing", entry)]
        for entry in trailing
    )


# Megatron's layout at TP size t, rank r (megatron-core 0.16 with Megatron-Bridge's conversions, read
# in NVIDIA-NeMo/Megatron-Bridge src/megatron/bridge/models/conversion/param_mapping.py
# `merge_qkv_weights`, `GatedMLPMapping.hf_to_megatron`, `MambaInProjMapping`, `MambaConv1dMapping`):
# - linear_qkv (column-parallel, "qkv-grouped"): rows grouped per key-value group g, [the group's
#   query heads, k_g, v_g], each head `head_dim` rows; the fused tensor splits evenly by rows. With
#   at least t groups (G % t == 0) rank r holds groups r*G/t .. (r+1)*G/t - 1 whole; with fewer
#   (t % G == 0, megatron/core/transformer/attention.py `num_query_groups < world_size`) the same
#   even row split cuts inside a group's block: at G 2, t 4 rank 0 holds query heads 0-8 of group 0
#   and no K/V rows, rank 1 query heads 9-15, k_0 and v_0 (Megatron all-gathers the output and picks
#   the rank's group and query heads). Where the layer kind has k_eq_v (Gemma-4's global layers: no
#   v_proj in the checkpoint) the V rows are copies of the group's K rows, as Megatron-Bridge's
#   Gemma 4 bridge copies them on import (`maybe_modify_loaded_hf_weight`).
# - linear_fc1 (column-parallel, "gate-up"): rank r holds its 1/t of gate's rows, then its 1/t of
#   up's rows.
# - column-parallel `parts` (Mamba's in_proj z|x|B|C|dt and conv1d x|B|C, 1-D per-head tensors, a
#   plain column-parallel projection): the tensor is its parts concatenated along rows; each part
#   splits over TP on its own and rank r holds its share of every part, in order. A part of Mamba
#   heads or groups must give every rank whole heads or groups (MambaMixer's asserts).
# - linear_proj, linear_fc2, out_proj (row-parallel): all output rows, input columns r/t .. (r+1)/t.
# - linear_qkv.bias (column-parallel, "qkv-grouped" without cols; GPT-OSS): the same rows as the
#   weight's, one value each (Bridge's QKVMapping merges q, k and v biases as it merges weights).
# - a row-parallel tensor's bias (`size`; GPT-OSS's linear_proj.bias): whole on every TP rank (Bridge's
#   RowParallelMapping: "bias (1D) is replicated across tp ranks"; TE adds it after the reduction).
# - column-parallel per-head vectors (`parts: [query_heads]`; GPT-OSS's attention sinks, TE
#   DotProductAttention's `softmax_offset`, [heads / t]): rank r holds heads r*H/t .. (r+1)*H/t - 1.
# - MLA (multi_latent_attention.py MLASelfAttention, TE spec): linear_q_proj, linear_q_up_proj and
#   linear_kv_up_proj are column-parallel (split by heads), linear_q_down_proj and
#   linear_kv_down_proj are TELinear with parallel_mode "duplicated" (whole on every rank, kind
#   replicated), linear_proj row-parallel over heads x v_head_dim.
# - replicated ("duplicated" TELinear, the MoE router and its bias): whole on every TP rank.
# - the embedding (vocab-parallel): rank r holds vocabulary rows r*V/t .. (r+1)*V/t - 1; a test takes
#   its first `embedding_rows` of them. Megatron pads V to a multiple of 128 x t; a vocabulary that
#   does not divide evenly is refused rather than modelled.
# - norm gains: whole, replicated on every rank.
# - routed experts (kind "expert", TEGroupedMLP `weight{i}`): EP rank e holds the experts
#   e*N .. (e+1)*N - 1, N = experts / EP, as local experts 0..N-1, whole at ETP 1 (ETP > 1 is
#   refused, not modelled). With EP > 1 Megatron marks them `allreduce=False` and puts them in its
#   separate expert-parallel optimizer (megatron/core/optimizer/__init__.py `get_megatron_optimizer`);
#   at EP 1 they stay in the dense one. A gated expert's linear_fc1 ("gate-up") is [gate; up], each
#   expert_ffn rows (Bridge's GatedMLPMapping at expert TP 1). With biases (GPT-OSS), TE's
#   GroupedLinear registers weight{i} then bias{i} for each local expert i in turn (`bias` below).
def _qkv_grouped(
    model: ModelFacts, spec: dict[str, Any], hf, kind: _Kind, cols: int | None, tp: int, tp_rank: int
) -> tuple[tuple[int, ...], list[SourcePiece]]:
    """Rank `tp_rank`'s rows of the fused [q heads, k, v] per group tensor, split evenly by rows
    (a weight with `cols` columns, or a bias with none)."""
    source = _sources(model, spec, ["q", "k", "v"])
    q_name, k_name = hf(source["q"]), hf(source["k"])
    v_name = k_name if kind.k_eq_v else hf(source["v"])
    what = f"{model.name} {kind.name} attention"
    if not kind.kv_heads:
        raise _spec_error(model, f"megatron tensor {spec.get('name')}: qkv-grouped needs an attention layer kind")
    if kind.query_heads % kind.kv_heads:
        raise ShapeError(f"{what}: {kind.query_heads} query heads do not divide into {kind.kv_heads} groups")
    groups = kind.kv_heads
    if groups >= tp:
        _split(groups, tp, f"{what}: key-value heads")
    elif tp % groups:
        raise ShapeError(f"{what}: {groups} key-value heads do not spread evenly over TP {tp}")
    _split(kind.query_heads, tp, f"{what}: query heads")
    per_group, d = kind.query_heads // groups, kind.head_dim
    block = (per_group + 2) * d
    local = _split(groups * block, tp, f"{what}: fused q|k|v rows")
    start, stop = tp_rank * local, (tp_rank + 1) * local
    pieces = []
    for group in range(groups):
        base = group * block
        for tensor, low, high, first in (
            (q_name, 0, per_group * d, group * per_group * d),
            (k_name, per_group * d, (per_group + 1) * d, group * d),
            (v_name, (per_group + 1) * d, block, group * d),
        ):
            lo, hi = max(start, base + low), min(stop, base + high)
            if lo < hi:
                rows = (first + lo - base - low, first + hi - base - low)
                columns = None if cols is None else (0, cols)
                pieces.append(SourcePiece(tensor=tensor, rows=rows, cols=columns, at=lo - start))
    return ((local,) if cols is None else (local, cols)), pieces


def _parts(
    model: ModelFacts, spec: dict[str, Any], hf, kind: _Kind, tp: int, tp_rank: int
) -> tuple[tuple[int, ...], int | None, list[SourcePiece]]:
    """A column-parallel tensor concatenated from parts along its rows, each split over TP."""
    name, parts = spec.get("name"), spec.get("parts")
    if not isinstance(parts, list) or not parts:
        raise _spec_error(model, f"megatron tensor {name}: parts must be a list of dimensions, got {parts!r}")
    cols = _dim(model, spec, "cols", kind) if "cols" in spec else None
    trailing = _trailing(model, spec, kind)
    if cols is not None and trailing:
        raise _spec_error(model, f"megatron tensor {name}: give cols or trailing, not both")
    tensor = hf(_sources(model, spec, ["weight"])["weight"])
    pieces, offset, at = [], 0, 0
    for part in parts:
        size, units, unit_name = kind.dims.entry(_symbol(model, spec, "part", part))
        _split(units, tp, f"{name}: {unit_name}")
        local = size // tp
        start = offset + tp_rank * local
        columns = None if cols is None else (0, cols)
        pieces.append(SourcePiece(tensor=tensor, rows=(start, start + local), cols=columns, at=at))
        offset += size
        at += local
    shape = (at, cols) if cols is not None else (at, *trailing)
    return shape, cols, pieces


def _layer_tensor(
    model: ModelFacts, spec: dict[str, Any], layer: int, kind: _Kind, tp: int, tp_rank: int
) -> tuple[tuple[int, ...], int | None, list[SourcePiece]]:
    """Rank-local shape, fan-in and checkpoint pieces of one layer tensor (not a routed expert)."""
    name, tensor_kind = spec.get("name"), spec.get("kind")

    def hf(key: str) -> str:
        return checkpoint_tensor(model, key, layer) if key else ""  # "": an unsupported source

    if tensor_kind in ("norm", "replicated") and "size" in spec:
        size = _dim(model, spec, "size", kind)
        role = "gain" if tensor_kind == "norm" else "weight"
        tensor = hf(_sources(model, spec, [role])[role])
        return (size,), None, [SourcePiece(tensor=tensor, rows=(0, size), cols=None, at=0)]
    if tensor_kind == "replicated":
        rows, cols = _dim(model, spec, "rows", kind), _dim(model, spec, "cols", kind)
        weight = hf(_sources(model, spec, ["weight"])["weight"])
        return (rows, cols), cols, [SourcePiece(tensor=weight, rows=(0, rows), cols=(0, cols), at=0)]
    if tensor_kind == "norm":
        _dim(model, spec, "size", kind)  # names the missing size
    if tensor_kind == "row-parallel" and "size" in spec:  # its bias: whole on every TP rank
        size = _dim(model, spec, "size", kind)
        tensor = hf(_sources(model, spec, ["bias"])["bias"])
        return (size,), None, [SourcePiece(tensor=tensor, rows=(0, size), cols=None, at=0)]
    if tensor_kind == "row-parallel":
        rows, cols = _dim(model, spec, "rows", kind), _dim(model, spec, "cols", kind)
        local = _split(cols, tp, f"{name}: input features")
        start = tp_rank * local
        weight = hf(_sources(model, spec, ["weight"])["weight"])
        piece = SourcePiece(tensor=weight, rows=(0, rows), cols=(start, start + local), at=0)
        return (rows, local), cols, [piece]
    if tensor_kind != "column-parallel":
        raise _spec_error(model, f"megatron tensor {name}: kind {tensor_kind!r} is not one of {list(KINDS[1:])}")
    layout = spec.get("layout", "parts" if "parts" in spec else None)
    if layout == "parts":
        return _parts(model, spec, hf, kind, tp, tp_rank)
    if layout == "qkv-grouped" and "cols" not in spec:  # the fused q|k|v bias
        shape, pieces = _qkv_grouped(model, spec, hf, kind, None, tp, tp_rank)
        return shape, None, pieces
    cols = _dim(model, spec, "cols", kind)
    if layout == "qkv-grouped":
        shape, pieces = _qkv_grouped(model, spec, hf, kind, cols, tp, tp_rank)
        return shape, cols, pieces
    if layout == "gate-up":
        source = _sources(model, spec, ["gate", "up"])
        rows = _dim(model, spec, "rows", kind)
        local = _split(rows, tp, f"{name}: output features")
        start = tp_rank * local
        pieces = [
            SourcePiece(tensor=hf(source["gate"]), rows=(start, start + local), cols=(0, cols), at=0),
            SourcePiece(tensor=hf(source["up"]), rows=(start, start + local), cols=(0, cols), at=local),
        ]
        return (2 * local, cols), cols, pieces
    raise _spec_error(
        model, f"megatron tensor {name}: layout {layout!r} is not one of ['qkv-grouped', 'gate-up', 'parts']"
    )


# Synthetic magnitudes (init_mean, init_std; synthetic_values draws normal(mean, std)): norm gains
# normal(norm_gain_mean, norm_gain_std) from the fixture (Gemma-4's RMSNorm multiplies by the stored
# gain, initialised to 1); embedding rows normal(0, embedding_std); a tensor whose spec names `init`
# takes synthetic.tensors.<init> (mean, std; `norm_gain` for a gain that is not a replicated norm);
# other weights normal(0, 1/sqrt(fan_in)), fan_in the whole tensor's input features at the slice's
# scale.
def _number(model: ModelFacts, dotted: str) -> float:
    value = model.field(dotted)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise _spec_error(model, f"field {dotted} must be a number, got {value!r}")
    return float(value)


def _synthetic_magnitudes(model: ModelFacts) -> tuple[float, float, float]:
    values = [_number(model, f"synthetic.{key}") for key in ("norm_gain_mean", "norm_gain_std", "embedding_std")]
    return values[0], values[1], values[2]


def _init(model: ModelFacts, spec: dict[str, Any]) -> tuple[float, float] | None:
    """The spec's named synthetic magnitude (mean, std), or None for the kind's rule."""
    name = spec.get("init")
    if name is None:
        return None
    if name == NORM_GAIN:
        mean, std, _ = _synthetic_magnitudes(model)
        return mean, std
    if not isinstance(name, str):
        raise _spec_error(model, f"megatron tensor {spec.get('name')}: init {name!r} is not a name")
    return _number(model, f"synthetic.tensors.{name}.mean"), _number(model, f"synthetic.tensors.{name}.std")


def _layer_specs(model: ModelFacts, kind: str) -> list[dict[str, Any]]:
    """The tensor specs of a layer kind: one list for every layer, or a list per kind."""
    specs = model.field("megatron.layer_tensors")
    if isinstance(specs, dict):
        if kind not in specs:
            raise _spec_error(model, f"field megatron.layer_tensors has no tensors for layer kind {kind!r}")
        specs = specs[kind]
    if not isinstance(specs, list) or not all(isinstance(spec, dict) for spec in specs):
        raise _spec_error(model, "field megatron.layer_tensors must be a list of tensors (or one per layer kind)")
    for spec in specs:
        if not isinstance(spec.get("name"), str) or not spec["name"]:
            raise _spec_error(model, f"megatron.layer_tensors entry {spec!r} has no name")
    return [spec for spec in specs if _present(model, spec)]


def _present(model: ModelFacts, spec: dict[str, Any]) -> bool:
    """Whether the model has the tensor: `if_set` / `if_null` name a field that must be set / null
    (DeepSeek-V3's linear_q_down_proj where attention.mla.q_lora_rank is set, Moonlight's
    linear_q_proj where it is null); a spec with neither is always present."""
    present = True
    for key, want_set in (("if_set", True), ("if_null", False)):
        if key in spec:
            dotted = spec[key]
            if not isinstance(dotted, str) or not dotted:
                raise _spec_error(model, f"megatron tensor {spec['name']}: {key} must name a field, got {dotted!r}")
            present = present and (model.field(dotted) is not None) == want_set
    return present


def layer_kinds(model: ModelFacts) -> tuple[str, ...]:
    """The model's layer kinds in the order their first layers appear."""
    kinds: dict[str, None] = {}
    for layer in range(model.layers):
        kinds.setdefault(model.layer_kind(layer), None)
    return tuple(kinds)


def first_layer_of_each_kind(model: ModelFacts) -> tuple[int, ...]:
    """The first layer of every layer kind, from the layer pattern (Gemma-4: 0 and 5; Nemotron-3:
    0 Mamba, 1 MoE, 7 attention), in model order."""
    return tuple(sorted(model.layers_of_kind(kind)[0] for kind in layer_kinds(model)))


def _check_rank(model: ModelFacts, rank: object, size: int, what: str) -> int:
    if not _count(rank) or not 0 <= rank < size:
        raise ShapeError(f"{model.name}: {what} rank {rank!r} outside 0..{size - 1}")
    return rank


def _check_parallel_sizes(
    model: ModelFacts, scale: ParamScale, tp: int, tp_rank: int, ep: int, ep_rank: int, etp: int
) -> None:
    if not isinstance(scale, ParamScale) or not isinstance(scale.divisor, int) or scale.divisor < 1:
        raise ShapeError(f"parameter scale {scale!r}: expected a ParamScale with a positive integer divisor")
    if not _count(tp) or tp < 1:
        raise ShapeError(f"{model.name}: TP size {tp!r} must be a positive integer")
    _check_rank(model, tp_rank, tp, "TP")
    if not _count(ep) or ep < 1:
        raise ShapeError(f"{model.name}: EP size {ep!r} must be a positive integer")
    _check_rank(model, ep_rank, ep, "EP")
    if not _count(etp) or etp < 1:
        raise ShapeError(f"{model.name}: ETP size {etp!r} must be a positive integer")
    if etp != 1:
        raise ShapeError(f"{model.name}: expert tensor parallelism {etp} is not modelled (ETP 1 only)")


def _checked_layers(model: ModelFacts, layers: Sequence[int]) -> list[int]:
    """The layers as a list: integers, each in the model, none twice."""
    layer_list = list(layers)
    for layer in layer_list:
        if not _count(layer):
            raise ShapeError(f"{model.name}: layer {layer!r} is not an integer")
        model.layer_kind(layer)  # RecipeError naming the layer when it is outside the model
        if layer_list.count(layer) > 1:
            raise ShapeError(f"{model.name}: layer {layer} is listed twice")
    return layer_list


def _vocab_part(model: ModelFacts, tp: int, tp_rank: int, embedding_rows: int) -> int:
    """The vocabulary rows of one TP rank, with `embedding_rows` checked to lie within them."""
    vocab = _positive(model, "vocab_size")
    vocab_part = _split(vocab, tp, f"{model.name}: vocabulary")
    if not _count(embedding_rows) or not 1 <= embedding_rows <= vocab_part:
        raise ShapeError(
            f"{model.name}: embedding rows {embedding_rows!r} outside 1..{vocab_part}"
            f" (TP rank {tp_rank}'s part of the {vocab}-row vocabulary)"
        )
    return vocab_part


def _slice_maker(
    model: ModelFacts, scale: ParamScale, tp: int, tp_rank: int, ep: int, ep_rank: int
) -> Callable[..., ParamSlice]:
    """Makes a ParamSlice at these ranks and scale, with its synthetic magnitudes (the comment
    above `_number`) and, at the recipe scale, its checkpoint pieces."""
    gain_mean, gain_std, embedding_std = _synthetic_magnitudes(model)
    with_sources = scale.divisor == 1

    def make(index, name, shape, layer, layer_kind, kind, fan_in, pieces, init=None, expert=None,
             unsupported=None) -> ParamSlice:
        if init is not None:
            mean, std = init
        elif kind == "norm":
            mean, std = gain_mean, gain_std
        elif kind == "embedding":
            mean, std = 0.0, embedding_std
        elif fan_in is None:
            raise _spec_error(model, f"megatron tensor {name}: no fan-in for synthetic values; name an init")
        else:
            mean, std = 0.0, 1.0 / math.sqrt(fan_in)
        return ParamSlice(
            name=name, shape=tuple(shape), layer=layer, layer_kind=layer_kind, kind=kind,
            weight_decay=len(shape) >= 2 and not name.endswith(".bias"), index=index,
            sources=tuple(pieces) if with_sources and unsupported is None else (), fan_in=fan_in,
            init_mean=mean, init_std=std, tp=tp, tp_rank=tp_rank, scale=scale.name,
            optimizer="expert" if expert is not None and ep > 1 else "dense",
            ep=ep, ep_rank=ep_rank, expert=expert, unsupported_source=unsupported,
        )

    return make


def _embedding_slice(
    model: ModelFacts, make: Callable[..., ParamSlice], start: int, rows: int, hidden: int
) -> ParamSlice:
    """The embedding's rows [start, start + rows) at the slice's scale."""
    embedding = model.field("megatron.embedding")
    if not isinstance(embedding, dict) or not isinstance(embedding.get("name"), str):
        raise _spec_error(model, "field megatron.embedding must name the embedding")
    table = checkpoint_tensor(model, str(embedding.get("source", "")))
    piece = SourcePiece(tensor=table, rows=(start, start + rows), cols=(0, hidden), at=0)
    return make(0, embedding["name"], (rows, hidden), None, None, "embedding", None, [piece])


def _add_layer_slices(
    slices: list[ParamSlice], model: ModelFacts, make: Callable[..., ParamSlice], layers: list[int],
    scale: ParamScale, tp: int, tp_rank: int, ep: int, ep_rank: int,
) -> None:
    """Appends every parameter of `layers` (in model order) to `slices`, each indexed by its place."""
    prefix = model.field("megatron.layer_prefix")
    kinds: dict[str, _Kind] = {}
    for layer in sorted(layers):
        kind_name = model.layer_kind(layer)
        if kind_name not in kinds:
            kinds[kind_name] = _layer_kind(model, kind_name, scale)
        kind = kinds[kind_name]
        for spec in _layer_specs(model, kind_name):
            init = _init(model, spec)
            if spec.get("kind") == "expert":
                for expert, part, name, shape, fan_in, pieces in _experts(model, spec, layer, kind, ep, ep_rank):
                    slices.append(make(len(slices), prefix.format(layer=layer) + name, shape, layer, kind_name,
                                       "expert", fan_in, pieces, _init(model, part), expert,
                                       _unsupported(model, part)))
                continue
            shape, fan_in, pieces = _layer_tensor(model, spec, layer, kind, tp, tp_rank)
            name = prefix.format(layer=layer) + spec["name"]
            slices.append(make(len(slices), name, shape, layer, kind_name, spec["kind"], fan_in, pieces, init,
                               unsupported=_unsupported(model, spec)))


def param_slices(
    model: ModelFacts,
    *,
    tp: int,
    tp_rank: int,
    layers: Sequence[int],
    embedding_rows: int,
    scale: ParamScale = RECIPE,
    ep: int = 1,
    ep_rank: int = 0,
    etp: int = 1,
) -> tuple[ParamSlice, ...]:
    """TP rank `tp_rank` and EP rank `ep_rank`'s slices of the embedding (its first `embedding_rows`
    vocabulary rows) and of every parameter of `layers`, in model order, at `scale`. Routed experts
    are the EP rank's local experts, whole (ETP 1); they belong to the "expert" optimizer when EP > 1,
    every other tensor to the "dense" one."""
    _check_parallel_sizes(model, scale, tp, tp_rank, ep, ep_rank, etp)
    layer_list = _checked_layers(model, layers)
    vocab_part = _vocab_part(model, tp, tp_rank, embedding_rows)
    hidden = _Dimensions(model, None, scale)["hidden"]
    rows = _divide(embedding_rows, scale.divisor, "embedding rows", scale)
    make = _slice_maker(model, scale, tp, tp_rank, ep, ep_rank)
    slices = [_embedding_slice(model, make, tp_rank * vocab_part, rows, hidden)]
    _add_layer_slices(slices, model, make, layer_list, scale, tp, tp_rank, ep, ep_rank)
    return tuple(slices)


def _experts(model: ModelFacts, spec: dict[str, Any], layer: int, kind: _Kind, ep: int, ep_rank: int):
    """The EP rank's local experts of one grouped expert tensor: (global index, the spec it comes
    from, local name, shape, fan-in, pieces) each, in local order; whole tensors at ETP 1. With a
    `bias` spec each expert's weight is followed by its bias (TE GroupedLinear's registration order:
    weight0, bias0, weight1, bias1, ...)."""
    parts = [spec]
    if "bias" in spec:
        bias = spec["bias"]
        if not isinstance(bias, dict) or not isinstance(bias.get("name"), str):
            raise _spec_error(model, f"megatron tensor {spec['name']}: bias must be a tensor spec with a name")
        parts.append(bias)
    for part in parts:
        if "{expert}" not in part["name"]:
            raise _spec_error(model, f"megatron tensor {part['name']}: an expert tensor's name needs {{expert}}")
    experts = kind.dims["experts"]
    if experts % ep:
        raise ShapeError(f"{model.name}: {experts} experts do not split evenly over EP {ep}")
    local = experts // ep
    tensors = [_expert_tensor(model, part, kind) for part in parts]
    out = []
    for index in range(local):
        expert = ep_rank * local + index
        for part, (shape, fan_in, blocks) in zip(parts, tensors):
            pieces = [
                SourcePiece(tensor=checkpoint_tensor(model, key, layer, expert), rows=rows, cols=cols, at=at)
                for key, rows, cols, at in blocks if key
            ]
            out.append((expert, part, part["name"].format(expert=index), shape, fan_in, pieces))
    return out


def _expert_tensor(model: ModelFacts, spec: dict[str, Any], kind: _Kind):
    """One routed expert's tensor, whole (ETP 1): its shape, fan-in and checkpoint blocks (key, rows,
    cols, at). A weight has `rows` and `cols`, a bias `size`; "gate-up" stacks gate's rows, then
    up's (each `rows` or `size` long)."""
    layout = spec.get("layout")
    if layout not in (None, "gate-up"):
        raise _spec_error(model, f"megatron tensor {spec['name']}: an expert's layout {layout!r} is not 'gate-up'")
    if "size" in spec:
        rows, cols = _dim(model, spec, "size", kind), None
    else:
        rows, cols = _dim(model, spec, "rows", kind), _dim(model, spec, "cols", kind)
    columns = None if cols is None else (0, cols)
    if layout == "gate-up":
        source = _sources(model, spec, ["gate", "up"])
        blocks = [(source["gate"], (0, rows), columns, 0), (source["up"], (0, rows), columns, rows)]
        rows *= 2
    else:
        blocks = [(_sources(model, spec, ["weight"])["weight"], (0, rows), columns, 0)]
    shape = (rows,) if cols is None else (rows, cols)
    return shape, cols, blocks

