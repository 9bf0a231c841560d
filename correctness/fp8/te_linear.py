"""Transformer Engine's Linear (TE 2.17) on a CUDA GPU, in FP8 under the recipe's TE recipe or in
BF16: the recipe GPU tier's candidate and default.

The FP8 recipe is built as megatron-core 0.16's fp8_utils.get_fp8_recipe builds it: Format.E4M3 or
Format.HYBRID from --fp8-format; DelayedScaling(margin, fp8_format, amax_compute_algo,
amax_history_len) for `delayed` (Megatron's TEDelayedScaling also passes override_linear_precision
for --no-fp8-wgrad, a field TE's DelayedScaling no longer has since TE 2.1; not modelled),
Float8CurrentScaling for `tensorwise`, Float8BlockScaling for `blockwise`, MXFP8BlockScaling for
`mxfp8`, each with that format. A recipe TE cannot run on this GPU (MXFP8 needs compute capability
10.0; block scaling CUDA 12.9) is refused with TE's own reason (ImplementationUnavailable: the case skips).

One module per run, built fresh (so both candidate runs start from the same state): bias-free,
BF16 parameters, the weight copied in; with gradient accumulation fusion (`wgrad_dtype` FP32) the
weight carries a zeroed FP32 `main_grad` that TE's wgrad GEMM accumulates into, as Megatron's DDP
gives it. Delayed scaling first runs the earlier iterations (forward and backward under the same
autocast) so that its amax history holds their amaxes, as in training; the judged iteration then
quantises with the scales they left.
"""

from dataclasses import dataclass
from typing import Any

import torch

from correctness.errors import ImplementationUnavailable
from correctness.fp8.inputs import LinearInputs, LinearTensors
from correctness.fp8.scaling import Fp8Config
from correctness.lever import ImplementationOutput


def _transformer_engine() -> tuple[Any, str]:
    """TE's PyTorch package and TE's version."""
    try:
        import transformer_engine
        import transformer_engine.pytorch as te
    except ImportError as missing:
        raise ImplementationUnavailable(f"Transformer Engine is not installed: {missing}") from None
    return te, transformer_engine.__version__


def te_recipe(config: Fp8Config) -> Any:
    from transformer_engine.common import recipe

    fp8_format = recipe.Format.E4M3 if config.format == "e4m3" else recipe.Format.HYBRID
    if config.recipe == "delayed":
        return recipe.DelayedScaling(margin=config.margin, fp8_format=fp8_format,
                                     amax_compute_algo=config.amax_compute_algo,
                                     amax_history_len=config.amax_history_len)
    if config.recipe == "tensorwise":
        return recipe.Float8CurrentScaling(fp8_format=fp8_format)
    if config.recipe == "blockwise":
        return recipe.Float8BlockScaling(fp8_format=fp8_format)
    return recipe.MXFP8BlockScaling(fp8_format=fp8_format)


def _support(te: Any, config: Fp8Config) -> tuple[bool, str]:
    if config.recipe == "mxfp8":
        return te.is_mxfp8_available(return_reason=True)
    if config.recipe == "blockwise":
        return te.is_fp8_block_scaling_available(return_reason=True)
    return te.is_fp8_available(return_reason=True)


@dataclass(frozen=True)
class TeLinear:
    name: str
    fp8: bool

    def run(self, inputs: LinearInputs) -> ImplementationOutput:
        te, version = _transformer_engine()
        config = inputs.config
        recipe = None
        if self.fp8:
            supported, reason = _support(te, config)
            if not supported:
                raise ImplementationUnavailable(f"TE {version} refuses {config.id} on this GPU: {reason}")
            recipe = te_recipe(config)
        fused = inputs.wgrad_dtype == torch.float32
        out_features, in_features = inputs.weight.shape
        linear = te.Linear(in_features, out_features, bias=False, params_dtype=torch.bfloat16,
                           device=inputs.x.device, fuse_wgrad_accumulation=fused)
        iterations = (*inputs.earlier, None) if self.fp8 and config.recipe == "delayed" else (None,)
        for earlier in iterations:
            tensors = earlier or LinearTensors(x=inputs.x, weight=inputs.weight, grad_output=inputs.grad_output)
            outputs, wgrad = self._iteration(te, linear, recipe, tensors, fused, inputs.x.device)
        details = {"transformer_engine": version, "recipe": repr(recipe) if recipe else "bf16",
                   "warm_up_iterations": len(iterations) - 1, "gradient_accumulation_fusion": fused,
                   "device": torch.cuda.get_device_name(inputs.x.device)}
        what = config.id if self.fp8 else "bf16"
        return ImplementationOutput(tensors={**outputs, "wgrad": wgrad},
                          backend=f"{self.name} ({what})", details=details)

    @staticmethod
    def _iteration(te: Any, linear: Any, recipe: Any, tensors: LinearTensors, fused: bool,
                   device: torch.device) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        with torch.no_grad():
            linear.weight.copy_(tensors.weight.to(device))
        linear.weight.grad = None
        if fused:
            linear.weight.main_grad = torch.zeros(linear.weight.shape, dtype=torch.float32, device=device)
        x = tensors.x.to(device).detach().requires_grad_()
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            y = linear(x)
        y.backward(tensors.grad_output.to(device))
        wgrad = linear.weight.main_grad if fused else linear.weight.grad
        return {"y": y.detach(), "dgrad": x.grad}, wgrad.detach().clone()
