"""The paths of the FP8 lever on any device: the FP8 linear as TE's recipe quantises it (its GEMMs with
Hopper's arithmetic where correctness.fp8.hopper models them, else the named FP32 stand-in,
correctness.fp8.scaling.fp8_gemm), its deliberate mistakes (the negative
controls, and the wrong implementations of correctness.fp8.wrong), the BF16 linear (the default),
the FP64 reference, and FP64 on the recipe's FP8 operands: with FP64 outputs the secondary
reference (which separates the quantisation from the GEMM's own rounding), with outputs rounded to
the candidate's dtypes the format floor.

A linear y = x W^T runs three GEMMs, each reading its operands quantised along its contraction
(TE's Linear; its "rowwise" and "columnwise" usages):

    fprop  y     = x W^T       x along in_features,  W along in_features     (forward format)
    dgrad  dgrad = dy W        dy along out_features, W along out_features   (dy: backward format)
    wgrad  wgrad = dy^T x      dy along tokens,       x along tokens

y and dgrad come out in BF16 (the activation dtype); wgrad in FP32 where Megatron's gradient
accumulation fusion writes it into the FP32 main_grad, else BF16 (--no-gradient-accumulation-fusion).
"""

import time
from dataclasses import dataclass
from typing import Any

import torch

from correctness.fp8.inputs import LinearInputs
from correctness.fp8.scaling import Fp8Dtype, Quantized, fp8_gemm, quantize
from correctness.lever import ImplementationOutput
from references.linear import linear_forward_backward

# The negative controls: each must fail the format bound on every case.
SCALE_NOT_APPLIED = "scales not applied on dequantisation"
INPUT_AMAX_OF_WEIGHT = "the input scaled from the weight's amax"
SCALE_INV_TWICE = "inverse scales applied twice on dequantisation"
MISTAKES = (SCALE_NOT_APPLIED, INPUT_AMAX_OF_WEIGHT, SCALE_INV_TWICE)
TIMES_SCALED = {SCALE_NOT_APPLIED: 0, SCALE_INV_TWICE: 2}  # the dequantisation mistakes; else once
# Wrong implementations in the same format (correctness.fp8.wrong).
TRUNCATED_CAST = "FP8 cast by truncation (toward zero) instead of round-to-nearest-even"
BLOCK_SCALE_TOWARD_SATURATION = "power-of-two block scale rounded toward saturation (MXFP8: E8M0 down; blockwise: up)"
GEMM_KINDS = {"y": "fprop", "dgrad": "dgrad", "wgrad": "wgrad"}
PROBE_ROWS = 16  # the torch._scaled_mm probe: rows of each GEMM's first operand
PROBE_COLUMNS = 32  # and of its second


@dataclass(frozen=True, kw_only=True)
class Operands:
    """The six quantised operands of the three GEMMs, each [rows, contraction]."""

    x_fprop: Quantized
    w_fprop: Quantized
    dy_dgrad: Quantized
    w_dgrad: Quantized
    dy_wgrad: Quantized
    x_wgrad: Quantized

    def gemms(self) -> dict[str, tuple[Quantized, Quantized]]:
        return {"y": (self.x_fprop, self.w_fprop), "dgrad": (self.dy_dgrad, self.w_dgrad),
                "wgrad": (self.dy_wgrad, self.x_wgrad)}

    def read(self, gemm: str, name: str, t: torch.Tensor) -> torch.Tensor:
        """references.linear's operand hook: the dequantised FP8 operand `gemm` reads in place of
        input `name`, in FP64 (exact), in the reference's layout (the backward GEMMs' copies are
        stored [rows, contraction], the transpose of it)."""
        field, transposed = READS[gemm, name]
        values = getattr(self, field).dequantize(dtype=torch.float64)
        return values.t() if transposed else values


READS = {  # (GEMM, the reference's input) -> (the operand it reads, stored transposed)
    ("y", "x"): ("x_fprop", False), ("y", "weight"): ("w_fprop", False),
    ("dgrad", "grad_output"): ("dy_dgrad", False), ("dgrad", "weight"): ("w_dgrad", True),
    ("wgrad", "grad_output"): ("dy_wgrad", True), ("wgrad", "x"): ("x_wgrad", True),
}


def _transposed(q: Quantized) -> Quantized:
    """One scale per tensor: the transposed copy has the same values (TE transposes the FP8 data)."""
    return Quantized(data=q.data.t().contiguous(), scale_inv=q.scale_inv, block=None, saturated=q.saturated,
                     details=q.details)


def quantize_operands(inputs: LinearInputs, mistake: str | None = None) -> Operands:
    """The six operands as the config's recipe quantises them; `mistake`: one of the controls'
    or wrong implementations' quantisation mistakes."""
    config = inputs.config
    forward, backward = config.forward, config.backward
    amax = {role: None for role in ("input", "weight", "grad")}
    if config.recipe == "delayed":
        amax = {role: inputs.history_amax(role) for role in amax}
    if mistake == INPUT_AMAX_OF_WEIGHT:
        amax["input"] = amax["weight"] if amax["weight"] is not None else inputs.weight.abs().amax()

    def q(t: torch.Tensor, role: str, fmt: Fp8Dtype) -> Quantized:
        return quantize(t, config, role, fmt, amax_override=amax[role], truncate=mistake == TRUNCATED_CAST,
                        scale_toward_saturation=mistake == BLOCK_SCALE_TOWARD_SATURATION)

    x, w, dy = inputs.x, inputs.weight, inputs.grad_output
    x_fprop, w_fprop, dy_dgrad = q(x, "input", forward), q(w, "weight", forward), q(dy, "grad", backward)
    if config.block("input") is None:  # one scale per tensor
        return Operands(x_fprop=x_fprop, w_fprop=w_fprop, dy_dgrad=dy_dgrad, w_dgrad=_transposed(w_fprop),
                        dy_wgrad=_transposed(dy_dgrad), x_wgrad=_transposed(x_fprop))
    return Operands(x_fprop=x_fprop, w_fprop=w_fprop, dy_dgrad=dy_dgrad, w_dgrad=q(w.t(), "weight", forward),
                    dy_wgrad=q(dy.t(), "grad", backward), x_wgrad=q(x.t(), "input", forward))


def _out_dtypes(inputs: LinearInputs) -> dict[str, torch.dtype]:
    return {"y": inputs.x.dtype, "dgrad": inputs.x.dtype, "wgrad": inputs.wgrad_dtype}


def quantization_figures(operands: Operands) -> dict[str, dict[str, float | int]]:
    """Per operand: the elements clamped to the format's largest value and, for one scale per
    tensor, the amax the scale came from over the operand's own amax (above 1: headroom; below 1:
    the tensor outgrew its history and saturates)."""
    figures = {}
    for name in ("x_fprop", "w_fprop", "dy_dgrad", "dy_wgrad", "x_wgrad", "w_dgrad"):
        q = getattr(operands, name)
        entry: dict[str, float | int] = {"saturated": q.saturated, "dtype": str(q.data.dtype).removeprefix("torch.")}
        if "amax" in q.details and q.details["amax"] > 0:
            entry["scale_amax_over_amax"] = q.details["scale_amax"] / q.details["amax"]
        figures[name] = entry
    return figures


def scaled_mm_probe(operands: Operands) -> dict[str, object]:
    """torch._scaled_mm on the CPU, where it takes the layout, against the stand-in on a slice of each
    GEMM (its first PROBE_ROWS x PROBE_COLUMNS outputs, the whole contraction): the CPU kernel is a
    scalar loop (about 36 million multiply-adds a second here), too slow for the cases themselves.
    Its CPU dispatch takes one scale per tensor or per row only; block scales raise its "Invalid
    scaling configuration", recorded as the refusal."""
    figures: dict[str, object] = {}
    for name, (a, b) in operands.gemms().items():
        a_part = Quantized(data=a.data[:PROBE_ROWS], scale_inv=a.scale_inv, block=a.block)
        b_part = Quantized(data=b.data[:PROBE_COLUMNS], scale_inv=b.scale_inv, block=b.block)
        if a.block is not None:
            figures["refused"] = "torch._scaled_mm on the CPU takes tensorwise and rowwise scales only (block scales: ValueError, Invalid scaling configuration)"
            return figures
        try:
            torch_out = torch._scaled_mm(a_part.data, b_part.data.t(), scale_a=a.scale_inv, scale_b=b.scale_inv,
                                         out_dtype=torch.float32)
        except RuntimeError as error:  # oneDNN's FP8 matmul needs an ISA this CPU lacks (AVX2 only)
            figures["refused"] = f"torch._scaled_mm does not run on this CPU: {str(error).splitlines()[0]}"
            return figures
        ours = fp8_gemm(a_part, b_part, torch.float32)
        figures[name] = {
            "max_relative_difference": float((torch_out - ours).abs().max() / ours.abs().max().clamp(min=1e-30)),
            "bitwise_equal": bool(torch.equal(torch_out, ours)),
        }
    return figures


@dataclass(frozen=True)
class EmulatedFp8Linear:
    """The linear in FP8 as the config's TE recipe quantises it, in torch's float8 dtypes; `mistake` makes it a
    negative control. The GEMMs: by `gemms` where it models the config (correctness.fp8.hopper.HopperTeGemms:
    Hopper's arithmetic, per-tensor scales), else by the FP32 stand-in (scaling.fp8_gemm); the backend and the
    details say which ran."""

    name: str = "fp8-emulated"
    mistake: str | None = None
    probe_scaled_mm: bool = False
    gemms: Any = None  # HopperTeGemms or None

    def run(self, inputs: LinearInputs) -> ImplementationOutput:
        started = time.perf_counter()
        operands = quantize_operands(inputs, self.mistake)
        dtypes = _out_dtypes(inputs)
        times = TIMES_SCALED.get(self.mistake, 1)
        why_not = self.gemms.why_not(inputs.config) if self.gemms is not None else None
        if self.gemms is not None and why_not is None:
            tensors, gemm_details = self.gemms.run(inputs, operands.gemms(), dtypes, times)
            split = [n for n in tensors if n in self.gemms.split_accumulator]
            fast = [n for n in tensors if n not in self.gemms.split_accumulator]
            gemm_label = (f"GEMMs by {gemm_details['gemm']} {gemm_details['mmaemu']}: {gemm_details['profile_note']}; "
                          f"fast accumulation: {', '.join(GEMM_KINDS[n] for n in fast) or 'none'}, split accumulator: "
                          f"{', '.join(GEMM_KINDS[n] for n in split) or 'none'}")
        else:
            tensors = {name: fp8_gemm(a, b, dtypes[name], times_scaled=times)
                       for name, (a, b) in operands.gemms().items()}
            gemm_details = {"gemm": "fp32-stand-in"}
            gemm_label = "FP32-accumulating GEMM stand-in"
            if why_not is not None:
                gemm_details["hopper_gemms_not_run"] = why_not
                gemm_label = f"{gemm_label}, not Hopper's arithmetic ({why_not})"
        details: dict[str, object] = {
            "recipe": inputs.config.recipe, "format": inputs.config.format, **gemm_details,
            "operands": quantization_figures(operands), "gemm_seconds": round(time.perf_counter() - started, 4),
        }
        if self.probe_scaled_mm and inputs.x.device.type == "cpu":
            if "scaled_mm_probe" not in inputs.cache:
                inputs.cache["scaled_mm_probe"] = scaled_mm_probe(operands)
            details["scaled_mm_probe"] = inputs.cache["scaled_mm_probe"]
        backend = f"{self.name} ({inputs.config.id}, FP8 operands, {gemm_label})"
        if self.mistake:
            backend = f"{backend} (mutated: {self.mistake})"
            details["mutation"] = self.mistake
        return ImplementationOutput(tensors=tensors, backend=backend, details=details)


@dataclass(frozen=True)
class Bf16Linear:
    """The default: the same three GEMMs in BF16 by torch's matmul on the inputs' device (FP32
    accumulation). A wgrad in FP32 (gradient accumulation fusion) is the FP32 matmul of the BF16
    operands: every product of two BF16 values is exact in FP32, so that is a BF16 GEMM with FP32
    accumulation and output (torch has no BF16-in, FP32-out mm on the CPU: aten::mm.dtype is not
    implemented there)."""

    name: str = "bf16"

    def run(self, inputs: LinearInputs) -> ImplementationOutput:
        x, w, dy = inputs.x, inputs.weight, inputs.grad_output
        wgrad = dy.t() @ x if inputs.wgrad_dtype == torch.bfloat16 else dy.t().float() @ x.float()
        return ImplementationOutput(tensors={"y": x @ w.t(), "dgrad": dy @ w, "wgrad": wgrad.to(inputs.wgrad_dtype)},
                          backend=f"{self.name} (torch matmul, {x.device.type})")


@dataclass(frozen=True)
class Fp64Linear:
    name: str = "fp64-linear"

    def run(self, inputs: LinearInputs) -> ImplementationOutput:
        y, dgrad, wgrad = linear_forward_backward(inputs.x, inputs.weight, inputs.grad_output)
        return ImplementationOutput(tensors={"y": y, "dgrad": dgrad, "wgrad": wgrad}, backend=self.name)


def recipe_operands(inputs: LinearInputs) -> Operands:
    """The operands as the recipe quantises them, once per case (the format floor and the secondary
    reference read the same; the candidate quantises on its own, so that its runs are its own)."""
    if "operands" not in inputs.cache:
        inputs.cache["operands"] = quantize_operands(inputs)
    return inputs.cache["operands"]


def _fp64_on_recipe_operands(inputs: LinearInputs) -> dict[str, torch.Tensor]:
    """The FP64 linear on the recipe's FP8 operands, once per case (the floor rounds it)."""
    if "fp64_on_fp8_operands" not in inputs.cache:
        y, dgrad, wgrad = linear_forward_backward(inputs.x, inputs.weight, inputs.grad_output,
                                                  recipe_operands(inputs).read)
        inputs.cache["fp64_on_fp8_operands"] = {"y": y, "dgrad": dgrad, "wgrad": wgrad}
    return inputs.cache["fp64_on_fp8_operands"]


@dataclass(frozen=True)
class Fp64OnFp8Operands:
    """The FP64 reference (references/linear.py) on the recipe's FP8 operands: each GEMM reads its
    operands quantised as the recipe prescribes (the same scales, blocks and formats as the
    candidate's emulation), the products and sums exact in FP64.

    With FP64 outputs, the secondary reference: the candidate's error against it is the GEMM's own
    (accumulation and output rounding), the rest of its error against the FP64 reference is the
    quantisation. With `round_outputs`, the format floor: its outputs rounded once to the
    candidate's dtypes (y and dgrad BF16, wgrad FP32 or BF16): the error no FP8 implementation of
    the recipe avoids."""

    name: str = "fp64-on-fp8-operands"
    round_outputs: bool = False

    def run(self, inputs: LinearInputs) -> ImplementationOutput:
        tensors = dict(_fp64_on_recipe_operands(inputs))
        if self.round_outputs:
            dtypes = _out_dtypes(inputs)
            tensors = {name: t.to(dtypes[name]) for name, t in tensors.items()}
        return ImplementationOutput(tensors=tensors, backend=f"{self.name} ({inputs.config.id})")
