"""The FP64 AdamW reference (references.adamw) on one optimizer unit, as the Adam levers run it."""

from dataclasses import dataclass

from correctness.adam.arithmetic import outputs
from correctness.adam.inputs import OptimizerUnit
from correctness.lever import ImplementationOutput
from references.adamw import adamw_run, clip_coefficient


@dataclass(frozen=True)
class Fp64AdamW:
    """The FP64 reference (references.adamw) on one unit; `fp32_hyperparameters` first rounds lr,
    betas, eps and weight decay to FP32, as TE FusedAdam's kernel arguments do."""

    fp32_hyperparameters: bool = False

    @property
    def name(self) -> str:
        return "fp64-adamw" + (" (fp32 hyperparameters)" if self.fp32_hyperparameters else "")

    def run(self, unit: OptimizerUnit) -> ImplementationOutput:
        hypers = [unit.config.hyperparameters(i, unit.weight_decay_multiplier) for i in unit.iterations()]
        if self.fp32_hyperparameters:
            hypers = [hyper.rounded_to_fp32() for hyper in hypers]
        result = adamw_run(
            unit.weights,
            unit.grads,
            hypers=hypers,
            clip_coefficients=[clip_coefficient(norm, unit.config.clip_grad) for norm in unit.grad_norms],
        )
        master0 = unit.weights.double()
        return ImplementationOutput(
            tensors=outputs(unit, master0, result["master"], result["exp_avg"], result["exp_avg_sq"]),
            backend=self.name,
        )
