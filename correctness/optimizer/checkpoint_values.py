"""Checkpoint values: a parameter slice read from a Hugging Face safetensors checkpoint.
`load_slice` assembles a recipe-scale slice from its `sources` (the blocks layout.param_slices
derives), finding each tensor's file through model.safetensors.index.json or a single
model.safetensors, and reads only the slice (safetensors' get_slice), never a whole tensor.
safetensors is imported only when a checkpoint is read, so an image without it runs every case but
the checkpoint ones; smoke-scale slices have no checkpoint values (use synthetic_values)."""

import json
from pathlib import Path
from typing import Any

import torch

from correctness.errors import CaseInputError
from correctness.megatron.layout import ParamSlice, SourcePiece

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def _checkpoint_files(folder: Path) -> dict[str, Path]:
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
        with _safe_open(single) as handle:
            return {name: single for name in handle.keys()}
    raise CaseInputError(f"checkpoint folder {folder} has neither {INDEX_FILE} nor {SINGLE_FILE}")


def _safe_open(file: Path) -> Any:
    """safetensors' reader, imported only here: a GPU image without safetensors runs every case but
    the checkpoint ones."""
    try:
        from safetensors import safe_open
    except ImportError:
        raise CaseInputError(f"reading {file} needs safetensors, which is not installed (pip install safetensors)") from None
    return safe_open(str(file), framework="pt")


READABLE_DTYPES = ("BF16", "F16", "F32")  # safetensors dtype names


def _read_piece(handle: Any, piece: SourcePiece, param: ParamSlice) -> torch.Tensor:
    part = handle.get_slice(piece.tensor)
    stored = tuple(part.get_shape())
    dims = len(param.shape) if piece.cols is None else 2  # no cols: the rows with every trailing dimension
    fits = len(stored) == dims and piece.rows[1] <= stored[0]
    if fits and piece.cols is not None:
        fits = piece.cols[1] <= stored[1]
    if not fits or any(start < 0 or stop <= start for start, stop in filter(None, (piece.rows, piece.cols))):
        raise CaseInputError(
            f"checkpoint tensor {piece.tensor} has shape {list(stored)}; {param.name} needs its {piece.text()}"
        )
    dtype = str(part.get_dtype())
    if dtype not in READABLE_DTYPES:
        # An FP8 checkpoint (DeepSeek-V3's) stores block scales beside each weight: cast alone its
        # values would be wrong by those scales, silently.
        raise CaseInputError(f"checkpoint tensor {piece.tensor} is {dtype}; {param.name} needs a BF16, FP16 or FP32"
                             " checkpoint (a quantised one would need its scales)")
    if piece.cols is None:
        return part[piece.rows[0] : piece.rows[1]]
    return part[piece.rows[0] : piece.rows[1], piece.cols[0] : piece.cols[1]]


def load_slice(checkpoint_dir: str | Path, param: ParamSlice) -> torch.Tensor:
    """The slice's values (BF16) read from a Hugging Face safetensors checkpoint, block by block."""
    if param.unsupported_source:
        raise CaseInputError(f"{param.name}: its checkpoint values cannot be read: {param.unsupported_source}")
    if not param.sources:
        raise CaseInputError(
            f"{param.name}: {param.scale}-scale slices have no checkpoint values (use synthetic_slice)"
        )
    folder = Path(checkpoint_dir)
    files = _checkpoint_files(folder)
    by_file: dict[Path, list[SourcePiece]] = {}
    for piece in param.sources:
        if piece.tensor not in files:
            raise CaseInputError(f"checkpoint {folder} has no tensor {piece.tensor} (needed for {param.name})")
        by_file.setdefault(files[piece.tensor], []).append(piece)
    out = torch.empty(param.shape, dtype=torch.bfloat16)
    covered = 0
    for file, pieces in by_file.items():
        if not file.is_file():
            raise CaseInputError(f"checkpoint {folder}: file {file.name} (holding {pieces[0].tensor}) is missing")
        with _safe_open(file) as handle:
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
