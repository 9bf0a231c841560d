"""Capture what the attention kernel receives in a trained model, for the lever's checkpoint cases.

One forward pass of a Hugging Face checkpoint over one of the recipe's pre-tokenized rows, with a
capturing attention function registered in transformers' attention interface. For each chosen layer
that function saves q, k and v exactly as the kernel gets them (after q_norm, k_norm, v_norm and
RoPE), the attention output the model computed, and delegates the computation itself to
transformers' own "sdpa" or "eager" attention so that the forward pass goes on unchanged. Once the
deepest chosen layer is saved it stops the forward pass (no later layer, no logits).

File format (`correctness.attention-capture`, version 1): one safetensors file per layer,
`layer-NN.safetensors` (`correctness.attention.inputs.checkpoint_file`), holding

    q    [batch, seq, heads, head_dim]   BF16, the TP rank's query heads, after q_norm and RoPE
    k    [batch, seq, groups, head_dim]  BF16, the TP rank's key-value groups, after k_norm and RoPE
    v    [batch, seq, groups, head_dim]  BF16, after v_norm (Gemma 4's global layers take V from k_proj)
    out  [batch, seq, heads, head_dim]   BF16, the model's attention output for those query heads

TP rank r of TP size t holds query heads r*H/t .. (r+1)*H/t - 1 and key-value groups
r*G/t .. (r+1)*G/t - 1 (whole groups with their query heads, as Megatron splits them). Metadata
(str -> str; numbers and windows as JSON): see `METADATA_KEYS`.

transformers and pyarrow (the `capture` extra) are imported here, inside the functions that need
them, and nowhere else in the project.
"""

import hashlib
import importlib
import importlib.util
import json
import math
import os
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from correctness.attention.inputs import CAPTURE_FORMAT, CAPTURE_FORMAT_VERSION, checkpoint_file
from correctness.attention.backend_lever import checkpoint_layers
from correctness.errors import CaseInputError, CorrectnessError, ShapeError
from correctness.models import ModelFacts, facts_for, load_facts
from correctness.recipes import Recipe
from correctness.attention.shapes import AttentionShape, attention_shape
from correctness.shapes import RECIPE_SCALE

FORMAT, FORMAT_VERSION = CAPTURE_FORMAT, CAPTURE_FORMAT_VERSION  # shared with the reader (inputs.py)
DELEGATES = ("sdpa", "eager")  # transformers' attention functions the capture may delegate to
ATTENTION_NAME = "correctness_capture"  # the name registered in transformers' attention interface
TOKEN_COLUMNS = ("input_ids", "tokens", "token_ids")  # tried in order, then the recipe's --input-key
PARQUET_SHA256_FIELD = "workload.dataset.build.parquet_sha256"
METADATA_KEYS = (
    "format", "format_version",
    "model", "model_short_name", "checkpoint", "revision",
    "recipe", "recipe_sha256", "rows_file", "rows_file_sha256", "row_index", "token_column",
    "layer", "layer_kind", "window_hf", "window_te", "softmax_scale", "head_dim",
    "kv_groups", "query_heads", "tp_rank", "tp_size", "batch", "seq_len", "dtype",
    "attn_implementation", "transformers", "torch", "device",
)
_SNAPSHOT = re.compile(r"/snapshots/([0-9a-f]{40})(/|$)")


class _Stop(Exception):
    """Raised by the capturing attention function once the deepest wanted layer is saved."""


@dataclass(frozen=True, kw_only=True)
class Row:
    """One pre-tokenized row of the recipe's rows file, checked against the recipe."""

    path: Path
    sha256: str
    index: int
    column: str
    tokens: torch.Tensor  # [1, row_tokens], int64


@dataclass(frozen=True, kw_only=True)
class CapturedLayer:
    layer: int
    kind: str
    path: Path
    shapes: dict[str, tuple[int, ...]]
    out_rms: float
    metadata: dict[str, str]


@dataclass(kw_only=True)
class CaptureResult:
    folder: Path
    row: Row
    layers: list[CapturedLayer] = field(default_factory=list)
    attention_calls: int = 0  # decoder attention calls made before the forward pass stopped
    stopped_early: bool = False  # the forward pass was cut after the deepest captured layer
    seconds: float = 0.0
    load_seconds: float = 0.0
    peak_gpu_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "folder": str(self.folder),
            "rows_file": str(self.row.path),
            "rows_file_sha256": self.row.sha256,
            "row_index": self.row.index,
            "token_column": self.row.column,
            "attention_calls": self.attention_calls,
            "stopped_early": self.stopped_early,
            "seconds": self.seconds,
            "load_seconds": self.load_seconds,
            "peak_gpu_bytes": self.peak_gpu_bytes,
            "layers": [
                {"layer": c.layer, "kind": c.kind, "file": str(c.path), "out_rms": c.out_rms,
                 "shapes": {name: list(size) for name, size in c.shapes.items()}, "metadata": c.metadata}
                for c in self.layers
            ],
        }


# --- model facts and layers -------------------------------------------------------------------


def load_model_facts(recipe: Recipe, path: str | Path | None = None) -> ModelFacts:
    """The recipe model's facts: the suite's own (correctness.models.load_model), or those in the
    file at `path` (a facts file or a config.json, for a model the suite has none of, such as the
    tests' tiny model). They must be for the recipe's model."""
    return facts_for(recipe, None if path is None else load_facts(path))


def default_layers(model: ModelFacts) -> tuple[int, ...]:
    """The attention lever's checkpoint layers, kind by kind (Gemma-4-31B: 0, 58, 5, 59)."""
    return tuple(layer for kind in model.attention_kinds for layer in checkpoint_layers(model, kind))


def _chosen_layers(model: ModelFacts, layers: Iterable[int] | None) -> tuple[int, ...]:
    chosen = default_layers(model) if layers is None else tuple(dict.fromkeys(int(layer) for layer in layers))
    if not chosen:
        raise CaseInputError("capture: no layers chosen")
    for layer in chosen:
        model.layer_kind(layer)  # raises for a layer outside the model
    return chosen


# --- rows ---------------------------------------------------------------------------------------


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while block := stream.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def _integer_lists(column_type) -> bool:
    import pyarrow as pa

    listed = pa.types.is_list(column_type) or pa.types.is_large_list(column_type) or pa.types.is_fixed_size_list(
        column_type
    )
    return listed and pa.types.is_integer(column_type.value_type)


def _token_column(schema, recipe: Recipe, path: Path, column: str | None) -> str:
    names = list(schema.names)
    if column is not None:
        if column not in names:
            raise CaseInputError(f"rows file {path}: no column {column!r} (has {names})")
        if not _integer_lists(schema.field(column).type):
            kind = schema.field(column).type
            raise CaseInputError(f"rows file {path}: column {column!r} holds {kind}, not token ids")
        return column
    input_key = recipe.argument("--input-key") or []
    candidates = list(dict.fromkeys([*TOKEN_COLUMNS, *input_key[:1]]))
    for name in candidates:
        if name in names and _integer_lists(schema.field(name).type):
            return name
    raise CaseInputError(
        f"rows file {path}: no column of token ids (lists of integers) among {candidates} (has {names});"
        " name it with --token-column"
    )


def read_row(recipe: Recipe, path: str | Path, index: int = 0, column: str | None = None) -> Row:
    """Row `index` of the recipe's parquet of pre-tokenized rows, after checking the file's sha256
    against the recipe's workload.dataset.build.parquet_sha256 and the row's length against its
    workload.row_tokens."""
    import pyarrow.parquet as pq

    path = Path(path)
    expected = str(recipe.field(PARQUET_SHA256_FIELD)).lower()
    if not path.is_file():
        raise CaseInputError(f"rows file {path}: not found")
    actual = file_sha256(path)
    if actual != expected:
        raise CaseInputError(
            f"rows file {path}: sha256 {actual} does not match the recipe's {PARQUET_SHA256_FIELD} {expected}"
        )
    rows = pq.ParquetFile(path)
    name = _token_column(rows.schema_arrow, recipe, path, column)
    total = rows.metadata.num_rows
    if not 0 <= index < total:
        raise CaseInputError(f"rows file {path}: row {index} outside 0..{total - 1}")
    first = 0
    for group in range(rows.num_row_groups):
        size = rows.metadata.row_group(group).num_rows
        if index < first + size:
            values = rows.read_row_group(group, columns=[name]).column(name)[index - first].as_py()
            break
        first += size
    if values is None:
        raise CaseInputError(f"rows file {path}: row {index} has no tokens (null)")
    expected_tokens = recipe.row_tokens
    if len(values) != expected_tokens:
        raise CaseInputError(
            f"rows file {path}: row {index} has {len(values)} tokens,"
            f" the recipe's workload.row_tokens is {expected_tokens}"
        )
    tokens = torch.tensor(values, dtype=torch.int64).unsqueeze(0)
    return Row(path=path, sha256=actual, index=index, column=name, tokens=tokens)


# --- the capture --------------------------------------------------------------------------------


def _json(value: Any) -> str:
    return json.dumps(list(value) if isinstance(value, tuple) else value)


def _revision(checkpoint: Path, revision: str | None) -> str:
    if revision:
        return revision
    found = _SNAPSHOT.search(str(checkpoint.resolve()))
    return found.group(1) if found else "unknown"


def _heads_slice(shape: AttentionShape) -> tuple[slice, slice]:
    """Rank r's query heads and key-value groups: whole groups, contiguous, as Megatron splits them."""
    rank = shape.tp_rank
    return (
        slice(rank * shape.heads, (rank + 1) * shape.heads),
        slice(rank * shape.groups, (rank + 1) * shape.groups),
    )


def _delegate(name: str, module: torch.nn.Module) -> Callable:
    if name == "eager":  # the model's own eager attention (not in the interface's registry)
        return importlib.import_module(type(module).__module__).eager_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[name]


def _register(delegate: str, attend: Callable) -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, attend)
    # Without a mask function of its own a custom attention gets no mask at all (no sliding window):
    # it gets the delegate's.
    AttentionMaskInterface.register(ATTENTION_NAME, ALL_MASK_ATTENTION_FUNCTIONS[delegate])


def _first_line(error: BaseException, limit: int = 200) -> str:
    """An exception's message for a one-line error: its first line, at most `limit` characters."""
    lines = str(error).strip().splitlines()
    line = lines[0] if lines else type(error).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


def torch_device(name: str) -> torch.device:
    """`device` as a torch device this machine has, checked before anything is read or loaded."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError, ValueError):
        raise CorrectnessError(f"capture: device {name!r}: not a torch device (such as cpu, cuda, cuda:1)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise CorrectnessError(f"capture: device {name} asked for, but torch sees no CUDA device")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise CorrectnessError(f"capture: device {name}: torch sees {torch.cuda.device_count()} CUDA devices")
    elif device.type != "cpu":
        try:
            torch.empty(0, device=device)
        except Exception as error:  # torch raises several kinds for a backend it was not built with
            raise CorrectnessError(f"capture: device {name}: not usable here ({_first_line(error)})") from None
    return device


def _check_folder(folder: Path) -> None:
    """The capture folder is a folder, or can be made: checked before the checkpoint loads (minutes
    for a large model), not when the first layer is saved. Nothing is made yet."""
    if folder.exists() and not folder.is_dir():
        raise CaseInputError(f"capture folder {folder}: not a folder")
    existing = next(path for path in (folder.absolute(), *folder.absolute().parents) if path.exists())
    if not existing.is_dir():
        raise CaseInputError(f"capture folder {folder}: {existing} is a file, not a folder")


def _make_folder(folder: Path) -> None:
    """Make the capture folder and write a probe file in it (removed): a read-only folder or a full
    disk is refused before the checkpoint loads."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".capture-probe.{os.getpid()}.tmp"
        try:
            probe.write_bytes(b"\n")
        finally:
            probe.unlink(missing_ok=True)
    except OSError as error:
        raise CaseInputError(f"capture folder {folder}: cannot be written ({error.strerror or error})") from None


def _check_weights(checkpoint: Path) -> None:
    """Every safetensors file of the checkpoint opens (its header is read, no tensor): a truncated or
    corrupt file is named in one line before transformers starts loading the others."""
    from safetensors import SafetensorError, safe_open

    for path in sorted(checkpoint.glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt"):
                pass
        except (SafetensorError, OSError) as error:
            raise CaseInputError(
                f"checkpoint {checkpoint}: {path.name} is not a readable safetensors file ({_first_line(error)})"
            ) from None


def _load(checkpoint: Path, device: torch.device):
    from transformers import AutoModelForCausalLM

    placement = {}
    if device.type != "cpu":
        if importlib.util.find_spec("accelerate") is None:
            raise CorrectnessError(
                f"loading straight onto {device} needs accelerate (pip install -e '.[capture]')"
            )
        placement = {"device_map": {"": str(device)}}
    from safetensors import SafetensorError

    try:
        return AutoModelForCausalLM.from_pretrained(
            str(checkpoint), dtype=torch.bfloat16, attn_implementation=ATTENTION_NAME, **placement
        )
    except (OSError, SafetensorError) as error:
        raise CaseInputError(f"checkpoint {checkpoint}: cannot be loaded ({_first_line(error)})") from None


def _check_call(layer: int, kind, query, key, kwargs) -> None:
    """The model's attention call against the model facts: heads, groups, head dim, window, scale."""
    where = f"checkpoint layer {layer} ({kind.name})"
    got = {"query heads": query.shape[1], "key-value heads": key.shape[1], "head dim": query.shape[-1]}
    want = {"query heads": kind.query_heads, "key-value heads": kind.kv_heads, "head dim": kind.head_dim}
    for name in got:
        if got[name] != want[name]:
            raise ShapeError(f"{where}: {got[name]} {name}, the model facts say {want[name]}")
    window = kwargs.get("sliding_window")
    if window != kind.window:
        raise ShapeError(f"{where}: sliding window {window}, the model facts say {kind.window}")
    scale = kwargs.get("scaling")
    if scale is None or not math.isclose(float(scale), kind.softmax_scale, rel_tol=1e-6):
        raise ShapeError(f"{where}: softmax scale {scale}, the model facts say {kind.softmax_scale}")
    if kwargs.get("softcap") is not None:
        raise ShapeError(f"{where}: an attention-logit softcap, which the lever's paths do not model")


def _save(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    from safetensors.torch import save_file

    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(temporary), metadata=metadata)
        os.replace(temporary, path)
    except BaseException as error:
        temporary.unlink(missing_ok=True)
        if isinstance(error, OSError):  # a full disk, a folder made read-only meanwhile
            raise CaseInputError(f"capture file {path}: cannot be written ({error.strerror or error})") from None
        raise


def _check_capture_inputs(checkpoint: Path, folder: Path) -> None:
    """What can be refused before anything loads: the folder, the capture extras, the checkpoint's config."""
    _check_folder(folder)
    for module in ("transformers", "pyarrow"):
        if importlib.util.find_spec(module) is None:
            raise CorrectnessError(f"capture needs {module}: pip install -e '.[capture]'")
    if not (checkpoint / "config.json").is_file():
        raise CaseInputError(f"checkpoint {checkpoint}: no config.json (not a Hugging Face checkpoint folder)")


def _common_metadata(
    facts: ModelFacts, recipe: Recipe, checkpoint: Path, revision: str | None, row: Row, delegate: str,
    transformers_version: str,
) -> dict[str, str]:
    """The metadata every layer's capture file carries: the model, checkpoint, recipe, row and versions."""
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "model": facts.name, "model_short_name": facts.short_name,
        "checkpoint": checkpoint.resolve().name, "revision": _revision(checkpoint, revision),
        "recipe": recipe.id, "recipe_sha256": recipe.sha256,
        "rows_file": row.path.name, "rows_file_sha256": row.sha256, "row_index": str(row.index),
        "token_column": row.column, "dtype": "bf16", "attn_implementation": delegate,
        "transformers": transformers_version, "torch": torch.__version__,
    }


def _capture_layer(
    layer: int, shape: AttentionShape, kind, call: tuple[torch.Tensor, ...], kwargs: dict,
    common: dict[str, str], folder: Path,
) -> CapturedLayer:
    """One layer's attention call checked against the facts, its rank's heads of q, k, v and out
    (BSHD, BF16, on the CPU) written to the layer's capture file."""
    query, key, value, out = call
    _check_call(layer, kind, query, key, kwargs)
    heads, groups = _heads_slice(shape)

    def kept(x: torch.Tensor, which: slice, heads_dim: int) -> torch.Tensor:
        x = x.narrow(heads_dim, which.start, which.stop - which.start)
        x = x.transpose(1, 2) if heads_dim == 1 else x  # BHSD to BSHD
        return x.to(device="cpu", dtype=torch.bfloat16).contiguous()

    tensors = {"q": kept(query, heads, 1), "k": kept(key, groups, 1), "v": kept(value, groups, 1),
               "out": kept(out, heads, 2)}
    metadata = {
        **common,
        "layer": str(layer), "layer_kind": shape.layer_kind,
        "window_hf": _json(kind.window), "window_te": _json(shape.window),
        "softmax_scale": _json(float(kwargs["scaling"])), "head_dim": str(shape.head_dim),
        "kv_groups": str(shape.groups), "query_heads": str(shape.heads),
        "tp_rank": str(shape.tp_rank), "tp_size": str(shape.tp_size),
        "batch": str(tensors["q"].shape[0]), "seq_len": str(tensors["q"].shape[1]),
        "device": str(query.device),
    }
    path = checkpoint_file(folder, layer)
    _save(path, tensors, metadata)
    return CapturedLayer(
        layer=layer, kind=shape.layer_kind, path=path, metadata=metadata,
        shapes={name: tuple(t.shape) for name, t in tensors.items()},
        out_rms=float(tensors["out"].float().square().mean().sqrt()),
    )


def _checked_decoder(model, facts: ModelFacts, checkpoint: Path, row: Row):
    """The model's decoder, its layer count held to the facts and the row's tokens to its vocabulary."""
    decoder = model.get_decoder()
    stack = getattr(decoder, "layers", None)
    if stack is None or len(stack) != facts.layers:
        found = "no decoder layers" if stack is None else f"{len(stack)} decoder layers"
        raise ShapeError(f"checkpoint {checkpoint}: {found}, the model facts say {facts.layers}")
    vocab = decoder.config.vocab_size
    if int(row.tokens.max()) >= vocab or int(row.tokens.min()) < 0:
        raise CaseInputError(f"rows file {row.path}: row {row.index} holds token ids outside a vocabulary of {vocab}")
    return decoder


def _forward(decoder, row: Row, target: torch.device, result: CaptureResult) -> None:
    """One forward pass over the row, stopped early once every layer is captured (`_Stop`)."""
    if target.type == "cuda":
        torch.cuda.reset_peak_memory_stats(target)
    try:
        with torch.inference_mode():
            decoder(input_ids=row.tokens.to(target), use_cache=False)
    except _Stop:
        result.stopped_early = True


def capture_attention(
    *,
    checkpoint: str | Path,
    recipe: Recipe,
    rows: str | Path,
    folder: str | Path,
    row_index: int = 0,
    layers: Sequence[int] | None = None,
    tp_rank: int = 0,
    device: str = "cuda",
    delegate: str = "sdpa",
    token_column: str | None = None,
    model_facts: str | Path | None = None,
    revision: str | None = None,
) -> CaptureResult:
    """Capture q, k, v and out of `layers` (default: the lever's checkpoint layers) at TP rank
    `tp_rank` of the recipe's layout, from one forward pass over row `row_index` of `rows`."""
    started = time.perf_counter()
    if delegate not in DELEGATES:
        raise CorrectnessError(f"capture: unknown attention implementation {delegate!r} (known: {DELEGATES})")
    checkpoint, folder = Path(checkpoint), Path(folder)
    target = torch_device(device)
    _check_capture_inputs(checkpoint, folder)
    facts = load_model_facts(recipe, model_facts)
    chosen = _chosen_layers(facts, layers)
    shapes = {layer: attention_shape(recipe, facts, facts.layer_kind(layer), RECIPE_SCALE, tp_rank) for layer in chosen}
    row = read_row(recipe, rows, row_index, token_column)
    _check_weights(checkpoint)

    import transformers

    state = {"calls": 0, "left": set(chosen)}
    result = CaptureResult(folder=folder, row=row)
    _make_folder(folder)
    common = _common_metadata(facts, recipe, checkpoint, revision, row, delegate, transformers.__version__)
    decoder_layers: dict[int, int] = {}

    def attend(module, query, key, value, attention_mask, **kwargs):
        out, weights = _delegate(delegate, module)(module, query, key, value, attention_mask, **kwargs)
        layer = decoder_layers.get(id(module))
        if layer is None:  # another tower's attention (vision, audio): not ours
            return out, weights
        state["calls"] += 1
        if layer in state["left"]:
            shape = shapes[layer]
            result.layers.append(_capture_layer(
                layer, shape, facts.attention_kind(shape.layer_kind), (query, key, value, out), kwargs, common, folder,
            ))
            state["left"].discard(layer)
            if not state["left"]:
                raise _Stop
        return out, weights

    _register(delegate, attend)
    loading = time.perf_counter()
    model = _load(checkpoint, target)
    result.load_seconds = time.perf_counter() - loading
    model.eval()
    decoder = _checked_decoder(model, facts, checkpoint, row)
    decoder_layers.update((id(block.self_attn), index) for index, block in enumerate(decoder.layers))
    _forward(decoder, row, target, result)
    if state["left"]:
        missed = sorted(state["left"])
        raise ShapeError(f"checkpoint {checkpoint}: the forward pass never called attention on layers {missed}")
    if target.type == "cuda":
        result.peak_gpu_bytes = torch.cuda.max_memory_allocated(target)
    result.attention_calls = state["calls"]
    result.layers.sort(key=lambda captured: chosen.index(captured.layer))
    result.seconds = time.perf_counter() - started
    return result
