"""Attention inputs: seeded synthetic ones that look like the model's, or captured ones.

Layout: BSHD, q [batch, seq, heads, head_dim], k [batch, seq, groups, head_dim], v [batch, seq,
groups, v_head_dim], grad_out [batch, seq, heads, v_head_dim]; THD packs the rows: [batch * seq,
heads or groups, head dim]. Where the shape has sinks, `sinks` holds one logit per query head [heads],
in the shape's dtype, as transformers' GptOssAttention holds its `sinks` parameter (the model's
dtype); every path takes them as they are (TE's unfused path rounds its FP32 offset to that dtype).

Synthetic inputs are drawn in FP32 from a generator seeded by the case, on the CPU (so they are the
same on every device), then rounded to the shape's dtype and moved to the device:
- q and k RMS-normalised per head over head_dim, times seeded per-dimension gains near 1 (q_norm,
  k_norm), so that under softmax scale 1.0 the logits have their real size (std near sqrt(head_dim));
- v RMS-normalised without a gain, as Gemma-4 does; the upstream gradient standard normal.
- sinks (drawn after the tensors above, so that a shape without them gets the same tensors): a
  seeded normal of mean SINK_MEAN and std SINK_STD. Trained GPT-OSS sink values were not at hand;
  what is known is that they are O(1), some larger. Std 2 around 0 gives heads from about -4 to 4:
  on the scale of one logit (std about 1 under a 1/sqrt(head_dim) scale), from a sink that takes
  almost nothing to one that takes a fifth of a query's weight over a 128-key window, and more
  on the first rows of a sequence, where few keys compete with it.
The "window-edge" variant then makes, for the first query head of every group, both keys at the
window's edge strong: the key just outside it and the farthest key inside it are each the query's
copy (a key serves two queries, so it is the sum of two copies). Each such query puts nearly all
its weight on the farthest key inside, whose logit is about head_dim: a window one too wide adds an
equally strong key, one too narrow drops the strong one, and either fails by a wide margin.
The "beyond-cap" variant (a shape with a logit softcap c) scales q and k each by
sqrt(c / (softmax_scale sqrt(head_dim))), so that the logits' RMS is c instead of about
softmax_scale sqrt(head_dim) (Gemma 2: 1, against a cap of 50, which model-like logits never come near):
a third of them lie beyond the cap, where it bends them, so that a kernel that ignored it fails.

Captured inputs (`correctness capture-attention`, correctness/attention/capture.py: safetensors,
one file per layer, q, k, v and the model's attention output `out`, BSHD, at the recipe's
rank-local shape, with metadata) are sliced to the case's heads (the first groups and their query
heads, which keeps the head-to-group mapping) and to its first seq_len tokens; `out` is sliced the
same way (causal attention: the first S queries see only the first S keys, so the sliced `out` is
still the model's output for them). Their upstream gradient is seeded standard normal scaled to the
RMS of the sliced `out` (FP32), so that dO has the size of the output it is the gradient of; a file
without `out` gets it unscaled. A file whose metadata does not fit the case (model, layer and its
kind, head dim, the key-value groups of the recipe-scale slice, window, softmax scale, TP rank and
size, format version) is refused with the reason; a file without capture metadata (hand-made, such
as the unit tests write, or with safetensors' own {"format": "pt"}) is taken as it is.
"""

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from correctness.errors import CaseInputError
from correctness.attention.shapes import AttentionShape
from correctness.model_config import same_model

GAIN_SPREAD = 0.1  # std of the synthetic q_norm / k_norm gains around 1
SINK_MEAN = 0.0  # the synthetic sink logits (see the module docstring)
SINK_STD = 2.0
VARIANTS = ("model-like", "window-edge", "beyond-cap")


@dataclass(frozen=True, kw_only=True)
class AttentionInputs:
    shape: AttentionShape
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    grad_out: torch.Tensor
    sinks: torch.Tensor | None = None  # [heads], where shape.sinks

    def __post_init__(self):
        if self.shape.sinks != (self.sinks is not None):
            raise CaseInputError(f"attention inputs for {self.shape.id}: sinks given {self.sinks is not None},"
                                 f" the shape says {self.shape.sinks}")

    def with_shape(self, **changes: Any) -> "AttentionInputs":
        """The same tensors under a changed shape record (how controls change window or scale)."""
        return replace(self, shape=self.shape.with_changes(**changes))

    def without_sinks(self) -> "AttentionInputs":
        return replace(self, shape=self.shape.with_changes(sinks=False), sinks=None)


def _rms_normalise(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(dim=-1, keepdim=True))


def _packed(shape: AttentionShape, x: torch.Tensor) -> torch.Tensor:
    """BSHD to the shape's layout (THD merges batch and sequence)."""
    return x.reshape(-1, *x.shape[2:]) if shape.qkv_format == "thd" else x


def _finish(shape: AttentionShape, device: torch.device, q, k, v, grad_out, sinks=None) -> AttentionInputs:
    def place(x: torch.Tensor) -> torch.Tensor:
        return _packed(shape, x).to(dtype=shape.torch_dtype).to(device).contiguous()

    return AttentionInputs(shape=shape, q=place(q), k=place(k), v=place(v), grad_out=place(grad_out),
                           sinks=None if sinks is None else sinks.to(dtype=shape.torch_dtype).to(device))


def _sinks(shape: AttentionShape, generator: torch.Generator) -> torch.Tensor | None:
    if not shape.sinks:
        return None
    return SINK_MEAN + SINK_STD * torch.randn(shape.heads, generator=generator, dtype=torch.float32)


def synthetic_inputs(shape: AttentionShape, seed: int, device: torch.device, variant: str) -> AttentionInputs:
    if variant not in VARIANTS:
        raise CaseInputError(f"synthetic attention inputs: unknown variant {variant!r} (known: {VARIANTS})")
    generator = torch.Generator().manual_seed(seed)
    b, s, h, g, d, dv = shape.batch, shape.seq_len, shape.heads, shape.groups, shape.head_dim, shape.v_head_dim

    def normal(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator, dtype=torch.float32)

    q_gain = 1.0 + GAIN_SPREAD * normal(d)
    k_gain = 1.0 + GAIN_SPREAD * normal(d)
    q = _rms_normalise(normal(b, s, h, d)) * q_gain
    k = _rms_normalise(normal(b, s, g, d)) * k_gain
    v = _rms_normalise(normal(b, s, g, dv))
    grad_out = normal(b, s, h, dv)
    sinks = _sinks(shape, generator)
    if variant == "window-edge":
        if shape.window is None or shape.window[0] + 1 >= s:
            raise CaseInputError(f"window-edge inputs need a window shorter than the sequence ({shape.id})")
        width = shape.window[0] + 1  # the query itself and window[0] keys before it
        first_heads = torch.arange(g) * shape.gqa_ratio
        k[:, : s - width + 1] = q[:, width - 1 :, first_heads]  # the farthest key inside query i's window: i - width + 1
        k[:, : s - width] += q[:, width:, first_heads]  # the key just outside it: i - width
    if variant == "beyond-cap":
        if shape.softcap is None:
            raise CaseInputError(f"beyond-cap inputs need a logit softcap ({shape.id})")
        factor = math.sqrt(shape.softcap / (abs(shape.softmax_scale) * math.sqrt(d)))
        q, k = q * factor, k * factor
    return _finish(shape, device, q, k, v, grad_out, sinks)


def checkpoint_file(folder: Path, layer: int) -> Path:
    return Path(folder) / f"layer-{layer:02d}.safetensors"


CAPTURE_FORMAT = "correctness.attention-capture"
CAPTURE_FORMAT_VERSION = "1"


def _metadata_mismatch(
    shape: AttentionShape, metadata: dict[str, str], layer: int | None, recipe_groups: int
) -> str | None:
    """Why a capture's metadata does not fit the case (None where it fits)."""
    if metadata.get("format") != CAPTURE_FORMAT or metadata.get("format_version") != CAPTURE_FORMAT_VERSION:
        return (
            f"format {metadata.get('format')!r} version {metadata.get('format_version')!r},"
            f" not {CAPTURE_FORMAT!r} version {CAPTURE_FORMAT_VERSION}"
        )
    try:
        stored = {
            "model": metadata["model_short_name"],
            "layer kind": metadata["layer_kind"],
            "head dim": int(metadata["head_dim"]),
            "key-value groups": int(metadata["kv_groups"]),
            "query heads": int(metadata["query_heads"]),
            "window": None if (window := json.loads(metadata["window_te"])) is None else tuple(window),
            "TP size": int(metadata["tp_size"]),
            "TP rank": int(metadata["tp_rank"]),
        }
        scale = float(json.loads(metadata["softmax_scale"]))
        stored_layer = int(metadata["layer"])
    except KeyError as missing:
        return f"metadata lacks {missing.args[0]!r}"
    except (ValueError, TypeError) as error:
        return f"malformed metadata ({error})"
    expected = {
        "model": shape.model,
        "layer kind": shape.layer_kind,
        "head dim": shape.head_dim,
        "key-value groups": recipe_groups,
        "query heads": recipe_groups * shape.gqa_ratio,
        "window": shape.window,
        "TP size": shape.tp_size,
        "TP rank": shape.tp_rank,
    }
    if layer is not None and stored_layer != layer:
        return f"captured from layer {stored_layer}, the case is layer {layer}"
    for name, value in expected.items():
        if not (same_model(stored[name], value) if name == "model" else stored[name] == value):
            return f"{name} {stored[name]} in the capture, the case needs {value}"
    if not math.isclose(scale, shape.softmax_scale, rel_tol=1e-9):
        return f"softmax scale {scale} in the capture, the case needs {shape.softmax_scale}"
    return None


def checkpoint_inputs(
    shape: AttentionShape,
    path: Path,
    seed: int,
    device: torch.device,
    *,
    layer: int | None = None,
    recipe_groups: int | None = None,
) -> AttentionInputs:
    """The case's inputs from a captured file. `layer`: the layer the case names (checked against
    the metadata); `recipe_groups`: the key-value groups of the recipe-scale slice a capture holds
    (default: the shape's own, for a shape at recipe scale)."""
    from safetensors import safe_open

    if not path.is_file():
        raise CaseInputError(f"checkpoint case: file {path} not found")
    tensors = {}
    with safe_open(str(path), framework="pt") as captured:
        wrong = _metadata_mismatch(shape, captured.metadata() or {}, layer, recipe_groups or shape.groups)
        if wrong is not None:
            raise CaseInputError(f"checkpoint case {path.name}: {wrong}")
        names = set(captured.keys())
        for name, heads, dim in (("q", shape.heads, shape.head_dim), ("k", shape.groups, shape.head_dim),
                                 ("v", shape.groups, shape.v_head_dim), ("out", shape.heads, shape.v_head_dim)):
            if name not in names:
                raise CaseInputError(f"checkpoint case {path.name}: no tensor {name!r} (has {sorted(names)})")
            sliced = captured.get_slice(name)
            batch, seq, stored_heads, head_dim = sliced.get_shape()
            if batch < shape.batch or seq < shape.seq_len or stored_heads < heads or head_dim != dim:
                raise CaseInputError(
                    f"checkpoint case {path.name}: tensor {name} is {[batch, seq, stored_heads, head_dim]},"
                    f" too small for [{shape.batch}, {shape.seq_len}, {heads}, {dim}]"
                )
            tensors[name] = sliced[: shape.batch, : shape.seq_len, :heads, :]
    generator = torch.Generator().manual_seed(seed)
    grad_out = torch.randn(shape.batch, shape.seq_len, shape.heads, shape.v_head_dim, generator=generator)
    grad_out *= tensors["out"].float().square().mean().sqrt()
    # A capture holds no sink logits: they are drawn as for a synthetic case.
    return _finish(shape, device, tensors["q"], tensors["k"], tensors["v"], grad_out, _sinks(shape, generator))
