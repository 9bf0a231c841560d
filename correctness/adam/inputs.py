"""The Adam levers' inputs (optimizer offload, precision-aware Adam), streamed one unit (a block of
rows of one parameter) at a time.

Gradients are synthetic and seeded: for every unit and step, standard normal FP32 values from a
generator seeded by (seed, parameter name, step, first row), then scaled per step so that the
global L2 norm over every parameter equals the step's given pre-clip norm. That takes one pass
over the gradients before the streaming pass ("norms first"): the raw norms give the FP32 scales,
and scale x raw norm is the pre-clip norm the paths see (rounding the scaled values to FP32 moves
it by about 1e-11 relative: independent roundings of at most 2^-24 average out).

The default pre-clip norms are 8, 4 and 2: above the recipes' clip value (1.0), so every step is
clipped, and different at every step, so that a path that skips clipping shows on the weights as
well as on the moments (Adam is invariant to a gradient scale that is the same at every step).
Replace them with a run's measured norms where those are known.
"""

import hashlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from correctness.errors import CaseInputError
from correctness.adam.config import OptimizerConfig
from correctness.megatron.layout import ParamSlice
from references.adamw import weight_decay_multiplier

DEFAULT_PRECLIP_NORMS = (8.0, 4.0, 2.0)
UNIT_ELEMENTS = 1 << 21  # elements per unit at most: bounds memory (and keeps blocks small enough for
# the allocator to reuse, not map and fault in afresh); part of the gradients' definition
FIRST_ITERATION = 1  # the run's first iterations: lr 0 at iteration 1 changes only the moments


@dataclass(frozen=True, kw_only=True)
class OptimizerUnit:
    """Rows [rows) of one parameter: its BF16 weights, its FP32 gradients (before clipping) for each
    step, the global pre-clip norm of each step, and the optimizer settings."""

    param: ParamSlice
    rows: tuple[int, int]
    weights: torch.Tensor
    grads: tuple[torch.Tensor, ...]
    grad_norms: tuple[float, ...]
    config: OptimizerConfig
    first_iteration: int = FIRST_ITERATION

    @property
    def weight_decay_multiplier(self) -> float:
        return weight_decay_multiplier(self.param.shape, is_bias=self.param.name.endswith(".bias"))

    def iterations(self) -> range:
        return range(self.first_iteration, self.first_iteration + len(self.grads))

    def with_config(self, **changes: Any) -> "OptimizerUnit":
        return replace(self, config=replace(self.config, **changes))


def row_blocks(param: ParamSlice) -> list[tuple[int, int]]:
    rows = param.shape[0]
    per_row = math.prod(param.shape[1:])
    step = max(1, UNIT_ELEMENTS // per_row)
    return [(start, min(start + step, rows)) for start in range(0, rows, step)]


# Bytes per element of the largest parameter, whose BF16 weights are drawn whole and its units cut
# from them: the weights and what the allocator keeps of drawing them (Nemotron's offload case grew
# 109 MB from 1/4 of the recipe's dimensions to the recipe's, its largest parameter by 25.2M elements).
WHOLE_WEIGHTS_BYTES_PER_ELEMENT = 4


def streamed_memory(params: Sequence[ParamSlice], *, per_unit_element: int, fixed: int) -> dict[str, Any]:
    """Case.memory_bytes and memory_driver of a case that streams these parameters' units, one at a
    time: `fixed` bytes, `per_unit_element` bytes per element of the largest unit (its inputs and
    every path's outputs and comparisons, measured per lever) and the largest parameter's weights
    drawn whole. It grows with the largest unit (at most UNIT_ELEMENTS), not with the inventory."""
    unit = max(((stop - start) * math.prod(p.shape[1:]) for p in params for start, stop in row_blocks(p)), default=0)
    whole = max((p.numel for p in params), default=0)
    return {"memory_bytes": fixed + per_unit_element * unit + WHOLE_WEIGHTS_BYTES_PER_ELEMENT * whole,
            "memory_driver": f"units of up to {unit:,} elements, about {per_unit_element} bytes each over the case's"
                             f" paths, and {whole:,} weights drawn whole"}


def _generator(seed: int, param: ParamSlice, step: int, first_row: int) -> torch.Generator:
    key = f"grad|{seed}|{param.name}|tp{param.tp}/{param.tp_rank}|{param.scale}|step{step}|row{first_row}"
    return torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little"))


def raw_gradient(param: ParamSlice, rows: tuple[int, int], step: int, seed: int) -> torch.Tensor:
    shape = (rows[1] - rows[0], *param.shape[1:])
    return torch.randn(shape, generator=_generator(seed, param, step, rows[0]), dtype=torch.float32)


def raw_global_norms(params: Sequence[ParamSlice], steps: int, seed: int) -> list[float]:
    """FP64 global norm, per step, of the raw gradients."""
    squares = [0.0] * steps
    for param in params:
        for rows in row_blocks(param):
            for step in range(steps):
                squares[step] += torch.linalg.vector_norm(raw_gradient(param, rows, step, seed).double()).item() ** 2
    return [math.sqrt(square) for square in squares]


def gradient_scales(
    params: Sequence[ParamSlice], seed: int, preclip_norms: Sequence[float]
) -> tuple[list[float], list[float]]:
    """Per-step FP32 scales of the raw gradients, and the pre-clip global norms they give."""
    if not preclip_norms or not all(math.isfinite(n) and n > 0 for n in preclip_norms):
        raise CaseInputError(f"pre-clip gradient norms must be finite and positive, got {list(preclip_norms)}")
    raw = raw_global_norms(params, len(preclip_norms), seed)
    scales = [float(torch.tensor(target / norm, dtype=torch.float32)) for target, norm in zip(preclip_norms, raw)]
    return scales, [scale * norm for scale, norm in zip(scales, raw)]


def optimizer_units(
    params: Sequence[ParamSlice],
    *,
    seed: int,
    preclip_norms: Sequence[float],
    weights: Callable[[ParamSlice], torch.Tensor],
    config: OptimizerConfig,
) -> Iterator[OptimizerUnit]:
    """Every parameter's units in order; `weights(param)` gives the whole slice's BF16 values."""
    scales, norms = gradient_scales(params, seed, preclip_norms)
    for param in params:
        values = weights(param)
        if tuple(values.shape) != param.shape or values.dtype != torch.bfloat16:
            raise CaseInputError(
                f"weights of {param.name}: {tuple(values.shape)} {values.dtype}, expected {param.shape} bfloat16"
            )
        for rows in row_blocks(param):
            grads = tuple(raw_gradient(param, rows, step, seed) * scales[step] for step in range(len(scales)))
            for step, grad in enumerate(grads):
                if not bool(torch.isfinite(grad).all()):
                    raise CaseInputError(f"gradient of {param.name} rows {rows} at step {step + 1} is not finite")
            yield OptimizerUnit(
                param=param,
                rows=rows,
                weights=values[rows[0] : rows[1]],
                grads=grads,
                grad_norms=tuple(norms),
                config=config,
            )
