"""The FP8 lever's GEMMs with Hopper's FP8 arithmetic, by mmaemu 0.1.0's `hopper-te` profile: Transformer
Engine's FP8 GEMMs as an H100 PCIe computes them (cuBLASLt 12.8.3.14), bit for bit: products added in blocks of 32,
aligned to the block's largest exponent and truncated to 13 fraction bits, the block result truncated to 13
fraction bits; fast accumulation runs one such chain over the whole contraction, the split accumulator a new chain
every 128 elements with the chains added in FP32; then the epilogue (alpha = scale_a x scale_b in FP32, one fused
multiply-add, the output rounded via FP32). The H100 PCIe is the nearest chip mmaemu models to the recipes'
H100 SXM and H200 (same sm_90 tensor cores; mmaemu does not model those two).

mmaemu models one scale per tensor only (delayed and current scaling); block scales raise there, so blockwise and
MXFP8 keep the FP32-accumulating stand-in (correctness.fp8.scaling.fp8_gemm), and the record says which ran.

Which accumulation each GEMM uses is TE 2.17's (pytorch/module/base.py: _2X_ACC_FPROP False, _2X_ACC_DGRAD and
_2X_ACC_WGRAD True; DelayedScaling and Float8CurrentScaling keep them): fprop with fast accumulation, dgrad and
wgrad with the split accumulator.

Split-K: mmaemu takes cuBLAS's split of K from a table recorded on the H100 or, for K from 1,024 up, from an
envelope; the smoke shapes' contractions (128 to 1,344) are mostly outside both and raise SplitKUnknownError.
There the decision is the one mmaemu makes at the recipe's own shape of the same GEMM (every seed GEMM: S = 1,
from the envelope, which mmaemu marks unvalidated for TE's 32 MiB workspace), passed explicitly and recorded with
its source; a GEMM whose recipe shape splits, or is undecided too, is refused
(ImplementationUnavailable), never guessed.

This is the only module that imports mmaemu, and only when a GEMM runs: without it the Hopper GEMMs are
unavailable (ImplementationUnavailable: the case skips with the reason).

`python -m correctness.fp8.hopper` measures how far Hopper's accumulation moves each GEMM's error from the FP32
stand-in's, at both seed recipes' smoke shapes (`accumulation_study`).
"""

import contextlib
import math
import sys
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from correctness.errors import ImplementationUnavailable
from correctness.fp8.inputs import LinearInputs
from correctness.fp8.paths import GEMM_KINDS
from correctness.fp8.scaling import Fp8Config, Quantized

PROFILE = "hopper-te"
PROFILE_NOTE = "H100 PCIe's arithmetic, the nearest chip mmaemu models to the recipe's H100 SXM / H200"
TE_SPLIT_ACCUMULATOR = ("dgrad", "wgrad")  # TE 2.17's _2X_ACC_DGRAD and _2X_ACC_WGRAD; _2X_ACC_FPROP is False
# mmaemu 0.1.0's documented `hopper` preset (mmaemu/model/presets.py, model/chain.py, model/plan.py): what
# documented_error_bound assumes; tests/test_fp8_hopper.py holds the installed mmaemu to it.
BLOCK_PRODUCTS = 32
FRACTION_BITS = 13  # of each aligned term, and of each block's result
SPLIT_CHUNK = 128  # the split accumulator's chain length
FP8_MANTISSA_BITS = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}
FP8_MIN_EXPONENT = {torch.float8_e4m3fn: -6, torch.float8_e5m2: -14}  # subnormals share it


def import_mmaemu() -> Any:
    try:
        import mmaemu
    except ImportError as missing:
        raise ImplementationUnavailable(
            f"mmaemu is not installed, so the Hopper FP8 GEMMs cannot run: {missing}") from None
    return mmaemu


def _subnormals_flushed() -> bool:
    return bool((torch.tensor(2.0 ** -130) * torch.tensor(0.5)) == 0)


@contextlib.contextmanager
def subnormals_kept() -> Iterator[None]:
    """FP32 subnormals kept while mmaemu runs: mmaemu refuses to run where they flush (its FP32 roundings would then
    differ from the GPU's), and the harness flushes them on the CPU (correctness.harness._cpu_settings)."""
    flushed = _subnormals_flushed()
    if flushed:
        torch.set_flush_denormal(False)
    try:
        yield
    finally:
        if flushed:
            torch.set_flush_denormal(True)


def recipe_gemm_shapes(shape: Any) -> dict[str, tuple[int, int, int]]:
    """Each GEMM's (M, N, K) at the recipe's scale, from the lever's Fp8LinearShape."""
    tokens, out_features, in_features = shape.recipe_shape
    return {"y": (tokens, out_features, in_features), "dgrad": (tokens, in_features, out_features),
            "wgrad": (out_features, in_features, tokens)}


def _decide(mmaemu: Any, mnk: tuple[int, int, int], a: torch.dtype, b: torch.dtype, out: torch.dtype,
            fast: bool) -> tuple[Any, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        decision = mmaemu.resolve_splitk(*mnk, a_dtype=a, b_dtype=b, out_dtype=out, use_fast_accum=fast,
                                         profile=PROFILE, dry=True)
    return decision, [str(w.message) for w in caught]


def split_decision(mmaemu: Any, smoke: tuple[int, int, int], recipe: tuple[int, int, int], a: torch.dtype,
                   b: torch.dtype, out: torch.dtype, fast: bool) -> tuple[tuple[int, str], dict[str, Any]]:
    """(splitk for mmaemu.scaled_mm, the decision as the record states it) of a GEMM of shape `smoke` whose
    recipe shape is `recipe`; ImplementationUnavailable where neither shape decides S = 1."""
    try:
        decision, said = _decide(mmaemu, smoke, a, b, out, fast)
        record = {"S": decision.S, "scheme": decision.scheme, "source": decision.source,
                  "verified": decision.verified, "note": decision.note, "warnings": said}
        return (decision.S, decision.scheme) if decision.S > 1 else 1, record
    except mmaemu.SplitKUnknownError as unknown:
        at_smoke = str(unknown).split(". Ways out")[0]
    try:
        decision, said = _decide(mmaemu, recipe, a, b, out, fast)
    except mmaemu.SplitKUnknownError as unknown:
        raise ImplementationUnavailable(
            f"mmaemu cannot decide cuBLAS's split-K of this GEMM ({at_smoke}) nor at the recipe's "
                              f"shape {recipe} ({str(unknown).split('. Ways out')[0]}): not guessed") from None
    if decision.S != 1:
        raise ImplementationUnavailable(f"{at_smoke}; at the recipe's shape {recipe} mmaemu splits K in {decision.S} "
                              f"({decision.source}), which the smoke shape's K cannot reproduce: not guessed")
    record = {"S": 1, "scheme": "none", "source": "explicit", "verified": decision.verified,
              "note": f"splitk=1 passed explicitly: {at_smoke}; at the recipe's shape (M, N, K) = {recipe} mmaemu "
                      f"decides S = 1 ({decision.source}: {decision.note})", "warnings": said}
    return 1, record


@dataclass(frozen=True)
class HopperTeGemms:
    """The three GEMMs of a per-tensor-scaled FP8 linear by mmaemu's `hopper-te` profile. `split_accumulator`:
    the GEMMs ("y", "dgrad", "wgrad") run with the split accumulator, the others with fast accumulation (TE's
    choice by default; the accumulation study overrides it)."""

    name: str = f"mmaemu {PROFILE}"
    split_accumulator: tuple[str, ...] = TE_SPLIT_ACCUMULATOR

    def why_not(self, config: Fp8Config) -> str | None:
        """Why these GEMMs cannot run the config (block scales), else None."""
        if config.block("input") is not None:
            return f"mmaemu models one scale per tensor only; {config.recipe} scales blocks"
        return None

    def run(self, inputs: LinearInputs, gemms: Mapping[str, tuple[Quantized, Quantized]],
            dtypes: Mapping[str, torch.dtype], times_scaled: int = 1) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        mmaemu = import_mmaemu()
        recipe_shapes = recipe_gemm_shapes(inputs.shape)
        tensors, figures = {}, {}
        with subnormals_kept(), torch.no_grad():
            for name, (a, b) in gemms.items():
                fast = name not in self.split_accumulator
                smoke = (a.data.shape[0], b.data.shape[0], a.data.shape[1])
                splitk, decided = split_decision(mmaemu, smoke, recipe_shapes[name], a.data.dtype, b.data.dtype,
                                                 dtypes[name], fast)
                scale_a, scale_b = (q.scale_inv.float().reshape(()) ** times_scaled for q in (a, b))
                started = time.perf_counter()
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    tensors[name] = mmaemu.scaled_mm(a.data, b.data.t(), scale_a, scale_b, out_dtype=dtypes[name],
                                                     use_fast_accum=fast, profile=PROFILE, splitk=splitk)
                figures[name] = {
                    "gemm": GEMM_KINDS[name], "m_n_k": list(smoke),
                    "accumulation": "fast" if fast else "split accumulator (a new chain every 128 of K, added in FP32)",
                    "split_k": decided, "warnings": [str(w.message) for w in caught],
                    "seconds": round(time.perf_counter() - started, 3),
                }
        details = {"gemm": self.name, "mmaemu": mmaemu.__version__, "profile": PROFILE, "profile_note": PROFILE_NOTE,
                   "gemms": figures}
        return tensors, details


def _exponents(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """floor(log2 |v|), clamped below at the format's smallest normal exponent; -inf for zeros."""
    exponent = (torch.frexp(values)[1] - 1).double().clamp_min(FP8_MIN_EXPONENT[dtype])
    return torch.where(values != 0, exponent, torch.full_like(exponent, -math.inf))


def _chain_error_bound(a: torch.Tensor, ea: torch.Tensor, b: torch.Tensor, eb: torch.Tensor, product_ulp_bits: int,
                       start: torch.Tensor, start_bound: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact sum, bound on |chain - exact sum|) of a chain over K of the FP64 values a [M, K], b [N, K] (their
    clamped exponents ea, eb), entering with the exact partial sum `start` and its bound."""
    exact, bound = start, start_bound
    unit = 2.0 ** -FRACTION_BITS
    for k0 in range(0, a.shape[1], BLOCK_PRODUCTS):
        pa, pb = a[:, k0:k0 + BLOCK_PRODUCTS], b[:, k0:k0 + BLOCK_PRODUCTS]
        products = pa[:, None, :] * pb[None, :, :]  # [M, N, block], exact in FP64
        exponents = ea[:, k0:k0 + BLOCK_PRODUCTS][:, None, :] + eb[:, k0:k0 + BLOCK_PRODUCTS][None, :, :]
        carried = exact.abs() + bound  # bounds |c|
        top = torch.maximum(exponents.amax(dim=-1), torch.floor(torch.log2(carried)))
        grid = torch.exp2(top - FRACTION_BITS)  # each term is truncated to a multiple of 2^(E - 13), E <= top
        # A product is a multiple of 2^(its exponent - mantissa bits): on the grid it loses nothing.
        off_grid = (exponents - product_ulp_bits) < (top - FRACTION_BITS)[..., None]
        terms = torch.where(off_grid, torch.minimum(products.abs(), grid[..., None]), torch.zeros_like(products))
        # The carried sum has 13 fraction bits at its own exponent: off the grid only when E is above its exponent.
        smallest_carried = (exact.abs() - bound).clamp_min(0)
        carried_on_grid = torch.floor(torch.log2(smallest_carried)) >= top
        carried_error = torch.where(carried_on_grid | (carried == 0), torch.zeros_like(grid), grid)
        exact = exact + products.sum(dim=-1)
        bound = bound + terms.sum(dim=-1) + carried_error
        bound = bound + unit * (exact.abs() + bound)  # the block result truncated to 13 fraction bits
    return exact, bound


def documented_error_bound(a: torch.Tensor, b: torch.Tensor, *, fast: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact FP64 product, bound on |accumulator - exact|) of FP8 a [M, K] times b [N, K] transposed, unsplit, by
    the arithmetic mmaemu documents for its `hopper` preset (model/chain.py, model/plan.py): per block of 32
    products plus the carried sum, every term truncated toward zero to a multiple of 2^(E - 13) (E: the largest
    exponent among them), the block's sum truncated to 13 fraction bits; the split accumulator (fast False) a
    chain per 128 elements of K, the chains' results added in FP32 with round to nearest. The accumulator before
    the epilogue; with power-of-two scales and an FP32 output the epilogue is exact."""
    values_a, values_b = a.double(), b.double()
    ea, eb = _exponents(values_a, a.dtype), _exponents(values_b, b.dtype)
    product_ulp_bits = FP8_MANTISSA_BITS[a.dtype] + FP8_MANTISSA_BITS[b.dtype]
    zero = torch.zeros(a.shape[0], b.shape[0], dtype=torch.float64)
    if fast:
        return _chain_error_bound(values_a, ea, values_b, eb, product_ulp_bits, zero, zero)
    exact, bound = zero, zero
    for k0 in range(0, a.shape[1], SPLIT_CHUNK):
        chunk = slice(k0, k0 + SPLIT_CHUNK)
        part, part_bound = _chain_error_bound(values_a[:, chunk], ea[:, chunk], values_b[:, chunk], eb[:, chunk],
                                              product_ulp_bits, zero, zero)
        exact, bound = exact + part, bound + part_bound
        bound = bound + 2.0 ** -24 * (exact.abs() + bound)  # the FP32 addition, round to nearest
    return exact, bound


def _relative_l2(x: torch.Tensor, reference: torch.Tensor) -> float:
    reference = reference.double()
    return float((x.double() - reference).norm() / reference.norm())


STUDY_RECIPES = ("gemma-4-31b/h100/attune-tp2-pp4-split13", "nemotron-3-super-120b-a12b/h200/attune-tp4-pp2-ep8-mt16k")


def accumulation_study(recipe_ids: tuple[str, ...] = STUDY_RECIPES, seed: int = 0) -> list[dict[str, Any]]:
    """Per recipe, linear, per-tensor configuration and GEMM: the relative L2 error against the FP64 reference
    (quantisation included) and against FP64 on the same FP8 operands (the GEMM's own error), of the FP32
    stand-in, of mmaemu hopper-te with fast accumulation and with the split accumulator, each with the candidate's
    output dtypes and with FP32 outputs; and the seconds each mmaemu GEMM took."""
    from correctness import LeverOptions
    from correctness.fp8 import lever as fp8
    from correctness.fp8.paths import Fp64Linear, Fp64OnFp8Operands, _out_dtypes, recipe_operands
    from correctness.fp8.scaling import fp8_gemm

    rows = []
    for recipe_id in recipe_ids:
        (lever,) = fp8.cpu_tier(recipe_id, LeverOptions())
        for case in lever.cases:
            if HopperTeGemms().why_not(case.shape.config):
                continue
            inputs = case.make_inputs(torch.device("cpu"))
            gemms = recipe_operands(inputs).gemms()
            reference = Fp64Linear().run(inputs).tensors
            on_operands = Fp64OnFp8Operands().run(inputs).tensors
            for out in ("candidate", "fp32"):
                dtypes = _out_dtypes(inputs) if out == "candidate" else dict.fromkeys(gemms, torch.float32)
                arms = {"fp32-stand-in": ({n: fp8_gemm(a, b, dtypes[n]) for n, (a, b) in gemms.items()}, {})}
                for arm, split in (("hopper-fast", False), ("hopper-split", True)):
                    tensors, details = HopperTeGemms(split_accumulator=tuple(gemms) if split else ()).run(
                        inputs, gemms, dtypes)
                    arms[arm] = (tensors, details["gemms"])
                for name in gemms:
                    row = {"recipe": recipe_id.split("/")[0], "linear": case.shape.linear,
                           "config": case.shape.config.id, "gemm": GEMM_KINDS[name], "out": out,
                           "dtype": str(dtypes[name]).removeprefix("torch."),
                           "te_accumulation": "split" if name in TE_SPLIT_ACCUMULATOR else "fast"}
                    for arm, (tensors, figures) in arms.items():
                        row[f"{arm}_vs_fp64"] = _relative_l2(tensors[name], reference[name])
                        row[f"{arm}_vs_fp8_operands"] = _relative_l2(tensors[name], on_operands[name])
                        if figures:
                            row[f"{arm}_seconds"] = figures[name]["seconds"]
                    rows.append(row)
    return rows


def main() -> None:
    torch.set_num_threads(1)
    rows = accumulation_study(tuple(sys.argv[1:]) or STUDY_RECIPES)
    columns = ("recipe", "linear", "config", "gemm", "out", "te_accumulation")
    arms = ("fp32-stand-in", "hopper-fast", "hopper-split")
    print("\t".join((*columns, *(f"{arm} {what}" for what in ("vs_fp64", "vs_fp8_operands") for arm in arms),
                     "fast s", "split s")))
    for row in rows:
        figures = [f"{row[f'{arm}_{what}']:.3e}" for what in ("vs_fp64", "vs_fp8_operands") for arm in arms]
        seconds = [str(row[f"{arm}_seconds"]) for arm in arms[1:]]
        print("\t".join((*(str(row[c]) for c in columns), *figures, *seconds)))


if __name__ == "__main__":
    main()
