"""The parameters an optimizer test updates: one TP rank's slices of named Megatron tensors.

`param_slices` lists them in model order (the embedding, then each layer's tensors in Megatron's
named_parameters() order), each with its rank-local shape, kind, weight-decay group and how to
assemble it from a Hugging Face checkpoint. Everything model-specific comes from the model's
fixture (fixtures/models/<name>.yaml): the `megatron:` section (names, kinds, layouts, module
order), the `checkpoint:` section (HF tensor names per layer) and the `synthetic:` magnitudes.

Megatron's layout at TP size t, rank r (megatron-core 0.16 with Megatron-Bridge's QKV and gated-MLP
conversions, read in NVIDIA-NeMo/Megatron-Bridge src/megatron/bridge/models/conversion/
param_mapping.py `merge_qkv_weights` and `GatedMLPMapping.hf_to_megatron`):
- linear_qkv (column-parallel, "qkv-grouped"): rows grouped per key-value group g, [the group's
  query heads, k_g, v_g], each head `head_dim` rows; the fused tensor splits evenly by rows, so
  rank r holds groups r*G/t .. (r+1)*G/t - 1 whole. Where the layer kind has k_eq_v (Gemma-4's
  global layers: no v_proj in the checkpoint) the V rows are copies of the group's K rows, as
  Megatron-Bridge's Gemma 4 bridge copies them on import (`maybe_modify_loaded_hf_weight`).
- linear_fc1 (column-parallel, "gate-up"): rank r holds its 1/t of gate's rows, then its 1/t of
  up's rows.
- linear_proj and linear_fc2 (row-parallel): all output rows, input columns r/t .. (r+1)/t.
- the embedding (vocab-parallel): rank r holds vocabulary rows r*V/t .. (r+1)*V/t - 1; a test takes
  its first `embedding_rows` of them. Megatron pads V to a multiple of 128 x t; a vocabulary that
  does not divide evenly is refused rather than modelled.
- norm gains: whole, replicated on every rank.

Scales: RECIPE keeps the model's dimensions. SMOKE divides hidden, FFN, head dims and the embedding
rows by 16 and keeps head counts, the GQA layout, the tensor list, order, kinds and TP split: every
2-D tensor is then 1/256 of its recipe size (norms 1/16), so the offload split falls at the same
tensors. Smoke slices have no checkpoint counterpart (`sources` is empty); use synthetic values.

Values: `load_slice` reads only the slice (safetensors' get_slice), never a whole tensor.
`synthetic_slice` draws seeded normal values: seeded from the seed, the tensor's name, the TP
rank and the scale through SHA-256 (stable across runs and platforms), uniforms from numpy's PCG64
turned into normals by Box-Muller in FP64 (no rejection sampling, so a last-ulp difference in a
platform's log or cos cannot shift the stream), scaled in FP64, rounded to FP32, then to BF16.
Magnitudes: norm gains normal(norm_gain_mean, norm_gain_std) from the fixture (Gemma-4's RMSNorm
multiplies by the stored gain, initialised to 1); embedding rows normal(0, embedding_std);
projection weights normal(0, 1/sqrt(fan_in)), fan_in the whole tensor's input features at the
slice's scale.
"""

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path as FilePath
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from correctness.errors import CaseInputError, RecipeError, ShapeError
from correctness.models import ModelFacts

KINDS = ("embedding", "column-parallel", "row-parallel", "norm")
DIMENSIONS = ("hidden", "ffn", "attention", "head_dim")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SYNTHETIC_CHUNK = 1 << 22  # values drawn per block (bounds memory; part of the stream's definition)


@dataclass(frozen=True, kw_only=True)
class ParamScale:
    """How big the parameters are: `divisor` divides hidden, FFN, head dims and embedding rows."""

    name: str
    divisor: int = 1


RECIPE = ParamScale(name="recipe")
SMOKE = ParamScale(name="smoke", divisor=16)
PARAM_SCALES = {scale.name: scale for scale in (RECIPE, SMOKE)}


@dataclass(frozen=True, kw_only=True)
class SourcePiece:
    """One block of a checkpoint tensor: its rows [start, stop) and columns [start, stop) (None for
    a 1-D tensor), landing at rank-local row `at` across all of the slice's columns."""

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
    """One TP rank's part of a named Megatron parameter."""

    name: str  # Megatron's name, e.g. decoder.layers.0.self_attention.linear_qkv.weight
    shape: tuple[int, ...]  # rank-local
    layer: int | None  # None for the embedding
    layer_kind: str | None  # the attention kind of its layer ("sliding", "global"); None for the embedding
    kind: str  # one of KINDS
    weight_decay: bool  # Megatron's default groups: 2-D weights yes, 1-D tensors and biases no
    index: int  # position in model order among the slices listed together
    sources: tuple[SourcePiece, ...]  # how to assemble it from the checkpoint; empty at the smoke scale
    fan_in: int | None  # input features of the whole projection; None for norms and the embedding
    init_mean: float  # synthetic values: normal(init_mean, init_std)
    init_std: float
    tp: int
    tp_rank: int
    scale: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def group(self) -> str:
        return "weight-decay" if self.weight_decay else "no-weight-decay"


def _spec_error(model: ModelFacts, what: str) -> RecipeError:
    return RecipeError(f"model facts {model.name}: {what}")


def checkpoint_tensor(model: ModelFacts, key: str, layer: int | None = None) -> str:
    """The checkpoint's name for a `checkpoint.tensors` key, with `{layer}` filled in."""
    templates = model.field("checkpoint.tensors")
    if not isinstance(templates, dict) or not isinstance(templates.get(key), str):
        raise _spec_error(model, f"no checkpoint tensor name checkpoint.tensors.{key}")
    template = templates[key]
    if ("{layer}" in template) != (layer is not None):
        raise _spec_error(model, f"checkpoint.tensors.{key} {template!r} does not fit layer {layer}")
    return template.format(layer=layer) if layer is not None else template


def _positive(model: ModelFacts, dotted: str) -> int:
    value = model.field(dotted)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _spec_error(model, f"field {dotted} must be a positive integer, got {value!r}")
    return value


def _divide(value: int, divisor: int, what: str, scale: ParamScale) -> int:
    if value % divisor:
        raise ShapeError(f"{scale.name} scale: {what} {value} is not divisible by {divisor}")
    return value // divisor


def _split(value: int, tp: int, what: str) -> int:
    if value % tp:
        raise ShapeError(f"{what} {value} does not split evenly over TP {tp}")
    return value // tp


@dataclass(frozen=True)
class _Kind:
    """One layer kind's dimensions at a scale."""

    name: str
    query_heads: int
    kv_heads: int
    head_dim: int
    k_eq_v: bool
    dims: dict[str, int]


def _layer_kind(model: ModelFacts, kind: str, hidden: int, ffn: int, scale: ParamScale) -> _Kind:
    facts = model.attention_kind(kind)
    head_dim = _divide(facts.head_dim, scale.divisor, f"{kind} head dim", scale)
    return _Kind(
        name=kind,
        query_heads=facts.query_heads,
        kv_heads=facts.kv_heads,
        head_dim=head_dim,
        k_eq_v=bool(model.field(f"attention.kinds.{kind}").get("k_eq_v", False)),
        dims={"hidden": hidden, "ffn": ffn, "attention": facts.query_heads * head_dim, "head_dim": head_dim},
    )


def _dim(model: ModelFacts, spec: dict[str, Any], key: str, kind: _Kind) -> int:
    symbol = spec.get(key)
    if symbol not in DIMENSIONS:
        raise _spec_error(
            model, f"megatron tensor {spec.get('name')}: {key} {symbol!r} is not one of {list(DIMENSIONS)}"
        )
    return kind.dims[symbol]


def _sources(model: ModelFacts, spec: dict[str, Any], roles: Sequence[str]) -> dict[str, str]:
    source = spec.get("source")
    if len(roles) == 1 and isinstance(source, str):
        return {roles[0]: source}
    if not isinstance(source, dict) or sorted(source) != sorted(roles):
        raise _spec_error(model, f"megatron tensor {spec.get('name')}: source must name {list(roles)}, got {source!r}")
    return source


def _layer_tensor(
    model: ModelFacts, spec: dict[str, Any], layer: int, kind: _Kind, tp: int, tp_rank: int
) -> tuple[tuple[int, ...], int | None, list[SourcePiece]]:
    """Rank-local shape, fan-in and checkpoint pieces of one layer tensor."""
    name, tensor_kind = spec.get("name"), spec.get("kind")
    if not isinstance(name, str) or not name:
        raise _spec_error(model, f"megatron.layer_tensors entry {spec!r} has no name")

    def hf(key: str) -> str:
        return checkpoint_tensor(model, key, layer)

    if tensor_kind == "norm":
        size = _dim(model, spec, "size", kind)
        gain = hf(_sources(model, spec, ["gain"])["gain"])
        return (size,), None, [SourcePiece(tensor=gain, rows=(0, size), cols=None, at=0)]
    if tensor_kind == "row-parallel":
        rows, cols = _dim(model, spec, "rows", kind), _dim(model, spec, "cols", kind)
        local = _split(cols, tp, f"{name}: input features")
        start = tp_rank * local
        weight = hf(_sources(model, spec, ["weight"])["weight"])
        piece = SourcePiece(tensor=weight, rows=(0, rows), cols=(start, start + local), at=0)
        return (rows, local), cols, [piece]
    if tensor_kind != "column-parallel":
        raise _spec_error(model, f"megatron tensor {name}: kind {tensor_kind!r} is not one of {list(KINDS[1:])}")
    cols = _dim(model, spec, "cols", kind)
    layout = spec.get("layout")
    if layout == "qkv-grouped":
        source = _sources(model, spec, ["q", "k", "v"])
        q_name, k_name = hf(source["q"]), hf(source["k"])
        v_name = k_name if kind.k_eq_v else hf(source["v"])
        if kind.query_heads % kind.kv_heads:
            raise ShapeError(
                f"{model.name} {kind.name} attention: {kind.query_heads} query heads"
                f" do not divide into {kind.kv_heads} groups"
            )
        groups = _split(kind.kv_heads, tp, f"{model.name} {kind.name} attention: key-value heads")
        per_group, d = kind.query_heads // kind.kv_heads, kind.head_dim
        block = (per_group + 2) * d
        pieces = []
        for local in range(groups):
            group = tp_rank * groups + local
            at = local * block
            q_rows = (group * per_group * d, (group + 1) * per_group * d)
            kv_rows = (group * d, (group + 1) * d)
            pieces += [
                SourcePiece(tensor=q_name, rows=q_rows, cols=(0, cols), at=at),
                SourcePiece(tensor=k_name, rows=kv_rows, cols=(0, cols), at=at + per_group * d),
                SourcePiece(tensor=v_name, rows=kv_rows, cols=(0, cols), at=at + (per_group + 1) * d),
            ]
        return (groups * block, cols), cols, pieces
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
    raise _spec_error(model, f"megatron tensor {name}: layout {layout!r} is not one of ['qkv-grouped', 'gate-up']")


def _synthetic_magnitudes(model: ModelFacts) -> tuple[float, float, float]:
    values = []
    for key in ("norm_gain_mean", "norm_gain_std", "embedding_std"):
        value = model.field(f"synthetic.{key}")
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise _spec_error(model, f"field synthetic.{key} must be a number, got {value!r}")
        values.append(float(value))
    return values[0], values[1], values[2]


def param_slices(
    model: ModelFacts,
    *,
    tp: int,
    tp_rank: int,
    layers: Sequence[int],
    embedding_rows: int,
    scale: ParamScale = RECIPE,
) -> tuple[ParamSlice, ...]:
    """TP rank `tp_rank`'s slices of the embedding (its first `embedding_rows` vocabulary rows) and
    of every parameter of `layers`, in model order, at `scale`."""
    if not isinstance(scale, ParamScale) or not isinstance(scale.divisor, int) or scale.divisor < 1:
        raise ShapeError(f"parameter scale {scale!r}: expected a ParamScale with a positive integer divisor")
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ShapeError(f"{model.name}: TP size {tp!r} must be a positive integer")
    if not isinstance(tp_rank, int) or isinstance(tp_rank, bool) or not 0 <= tp_rank < tp:
        raise ShapeError(f"{model.name}: TP rank {tp_rank!r} outside 0..{tp - 1}")
    layer_list = list(layers)
    for layer in layer_list:
        if not isinstance(layer, int) or isinstance(layer, bool):
            raise ShapeError(f"{model.name}: layer {layer!r} is not an integer")
        model.layer_kind(layer)  # RecipeError naming the layer when it is outside the model
        if layer_list.count(layer) > 1:
            raise ShapeError(f"{model.name}: layer {layer} is listed twice")
    vocab = _positive(model, "vocab_size")
    vocab_part = _split(vocab, tp, f"{model.name}: vocabulary")
    if not isinstance(embedding_rows, int) or isinstance(embedding_rows, bool) or not 1 <= embedding_rows <= vocab_part:
        raise ShapeError(
            f"{model.name}: embedding rows {embedding_rows!r} outside 1..{vocab_part}"
            f" (TP rank {tp_rank}'s part of the {vocab}-row vocabulary)"
        )
    d = scale.divisor
    hidden = _divide(_positive(model, "hidden_size"), d, "hidden size", scale)
    ffn = _divide(_positive(model, "ffn_hidden_size"), d, "FFN hidden size", scale)
    rows = _divide(embedding_rows, d, "embedding rows", scale)
    gain_mean, gain_std, embedding_std = _synthetic_magnitudes(model)
    with_sources = scale.divisor == 1

    def make(index: int, name: str, shape, layer, layer_kind, kind, fan_in, pieces) -> ParamSlice:
        if kind == "norm":
            mean, std = gain_mean, gain_std
        elif kind == "embedding":
            mean, std = 0.0, embedding_std
        else:
            mean, std = 0.0, 1.0 / math.sqrt(fan_in)
        return ParamSlice(
            name=name, shape=tuple(shape), layer=layer, layer_kind=layer_kind, kind=kind,
            weight_decay=len(shape) >= 2 and not name.endswith(".bias"), index=index,
            sources=tuple(pieces) if with_sources else (), fan_in=fan_in, init_mean=mean, init_std=std,
            tp=tp, tp_rank=tp_rank, scale=scale.name,
        )

    embedding = model.field("megatron.embedding")
    if not isinstance(embedding, dict) or not isinstance(embedding.get("name"), str):
        raise _spec_error(model, "field megatron.embedding must name the embedding")
    start = tp_rank * vocab_part
    table = checkpoint_tensor(model, str(embedding.get("source", "")))
    piece = SourcePiece(tensor=table, rows=(start, start + rows), cols=(0, hidden), at=0)
    slices = [make(0, embedding["name"], (rows, hidden), None, None, "embedding", None, [piece])]

    prefix = model.field("megatron.layer_prefix")
    specs = model.field("megatron.layer_tensors")
    if not isinstance(specs, list) or not all(isinstance(spec, dict) for spec in specs):
        raise _spec_error(model, "field megatron.layer_tensors must be a list of tensors")
    kinds: dict[str, _Kind] = {}
    for layer in sorted(layer_list):
        kind_name = model.layer_kind(layer)
        if kind_name not in kinds:
            kinds[kind_name] = _layer_kind(model, kind_name, hidden, ffn, scale)
        kind = kinds[kind_name]
        for spec in specs:
            shape, fan_in, pieces = _layer_tensor(model, spec, layer, kind, tp, tp_rank)
            name = prefix.format(layer=layer) + spec["name"]
            slices.append(make(len(slices), name, shape, layer, kind_name, spec["kind"], fan_in, pieces))
    return tuple(slices)


# --- checkpoint values -------------------------------------------------------------------------


def _checkpoint_files(folder: FilePath) -> dict[str, FilePath]:
    """Each tensor's safetensors file, from the index or from a single model.safetensors."""
    if not folder.is_dir():
        raise CaseInputError(f"checkpoint folder {folder} does not exist")
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError):
            raise CaseInputError(f"checkpoint index {index}: unreadable or without a weight_map") from None
        if not isinstance(weight_map, dict):
            raise CaseInputError(f"checkpoint index {index}: weight_map is not a mapping")
        return {str(name): folder / str(file) for name, file in weight_map.items()}
    single = folder / SINGLE_FILE
    if single.is_file():
        with safe_open(str(single), framework="pt") as handle:
            return {name: single for name in handle.keys()}
    raise CaseInputError(f"checkpoint folder {folder} has neither {INDEX_FILE} nor {SINGLE_FILE}")


def _read_piece(handle: Any, piece: SourcePiece, param: ParamSlice) -> torch.Tensor:
    part = handle.get_slice(piece.tensor)
    stored = tuple(part.get_shape())
    wanted = piece.shape
    fits = len(stored) == len(wanted) and piece.rows[1] <= stored[0]
    if fits and piece.cols is not None:
        fits = piece.cols[1] <= stored[1]
    if not fits or any(start < 0 or stop <= start for start, stop in filter(None, (piece.rows, piece.cols))):
        raise CaseInputError(
            f"checkpoint tensor {piece.tensor} has shape {list(stored)}; {param.name} needs its {piece.text()}"
        )
    if piece.cols is None:
        return part[piece.rows[0] : piece.rows[1]]
    return part[piece.rows[0] : piece.rows[1], piece.cols[0] : piece.cols[1]]


def load_slice(checkpoint_dir: str | FilePath, param: ParamSlice) -> torch.Tensor:
    """The slice's values (BF16) read from a Hugging Face safetensors checkpoint, block by block."""
    if not param.sources:
        raise CaseInputError(
            f"{param.name}: {param.scale}-scale slices have no checkpoint values (use synthetic_slice)"
        )
    folder = FilePath(checkpoint_dir)
    files = _checkpoint_files(folder)
    by_file: dict[FilePath, list[SourcePiece]] = {}
    for piece in param.sources:
        if piece.tensor not in files:
            raise CaseInputError(f"checkpoint {folder} has no tensor {piece.tensor} (needed for {param.name})")
        by_file.setdefault(files[piece.tensor], []).append(piece)
    out = torch.empty(param.shape, dtype=torch.bfloat16)
    covered = 0
    for file, pieces in by_file.items():
        if not file.is_file():
            raise CaseInputError(f"checkpoint {folder}: file {file.name} (holding {pieces[0].tensor}) is missing")
        with safe_open(str(file), framework="pt") as handle:
            for piece in pieces:
                block = _read_piece(handle, piece, param)
                stop = piece.at + block.shape[0]
                if stop > param.shape[0] or tuple(block.shape[1:]) != tuple(param.shape[1:]):
                    raise CaseInputError(
                        f"{param.name}: checkpoint block {piece.tensor} {piece.text()}"
                        f" does not fit shape {list(param.shape)}"
                    )
                out[piece.at : stop] = block
                covered += block.shape[0]
    if covered != param.shape[0]:
        raise CaseInputError(f"{param.name}: its checkpoint blocks cover {covered} of {param.shape[0]} rows")
    return out


# --- synthetic values --------------------------------------------------------------------------


def synthetic_seed(param: ParamSlice, seed: int) -> int:
    """A 128-bit generator seed from the seed, the tensor's name, the TP rank and the scale."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"synthetic seed {seed!r} is not an integer")
    key = f"{seed}|{param.name}|tp{param.tp}/{param.tp_rank}|{param.scale}"
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:16], "little")


def synthetic_slice(param: ParamSlice, seed: int) -> torch.Tensor:
    """Seeded values for the slice (BF16): normal(param.init_mean, param.init_std)."""
    rng = np.random.Generator(np.random.PCG64(synthetic_seed(param, seed)))
    out = torch.empty(param.numel, dtype=torch.bfloat16)
    for start in range(0, param.numel, SYNTHETIC_CHUNK):
        count = min(SYNTHETIC_CHUNK, param.numel - start)
        pairs = (count + 1) // 2
        radius = np.sqrt(-2.0 * np.log1p(-rng.random(pairs)))  # 1 - u in (0, 1]: log never sees 0
        angle = (2.0 * np.pi) * rng.random(pairs)
        normal = np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[:count]
        values = (normal * param.init_std + param.init_mean).astype(np.float32)
        out[start : start + count] = torch.from_numpy(values)
    return out.view(param.shape)
