"""Synthetic values: seeded normal values for a parameter slice, at any scale.
`synthetic_slice` draws normal(init_mean, init_std), the magnitudes layout.param_slices takes from
the model's fixture, seeded from the seed, the tensor's name, the TP rank, the scale and, for a
routed expert, its global index, through SHA-256 (stable across runs and platforms): uniforms from
numpy's PCG64 turned into normals by Box-Muller in FP64 (no rejection sampling, so a last-ulp
difference in a platform's log or cos cannot shift the stream), scaled in FP64, rounded to FP32,
then to BF16, drawn in blocks of SYNTHETIC_CHUNK values."""

import hashlib

import numpy as np
import torch

from correctness.megatron.layout import ParamSlice

SYNTHETIC_CHUNK = 1 << 22  # values drawn per block (bounds memory; part of the stream's definition)


def synthetic_seed(param: ParamSlice, seed: int) -> int:
    """A 128-bit generator seed from the seed, the tensor's name, the TP rank, the scale and a routed
    expert's global index."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"synthetic seed {seed!r} is not an integer")
    key = f"{seed}|{param.name}|tp{param.tp}/{param.tp_rank}|{param.scale}"
    if param.expert is not None:
        key += f"|expert{param.expert}"  # local names repeat on every EP rank
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
