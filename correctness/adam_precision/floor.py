"""The precision-aware Adam lever's format floor: the FP64 AdamW reference (references/adamw.py)
with the case's state stored in the case's dtypes between steps, exactly as the candidate stores it
(correctness.adam_precision.state.store), and otherwise exact. Each case's floor is made from its
own dtypes, which the floor reads from the case's units (`ByCase` in the lever).

What is rounded, and only that:
- the master weights, into `--main-params-dtype`, once before the first step (FusedAdam's copy of
  the BF16 parameter) and after every step: FP16 with TE's per-tensor scale; FP32 (kept as
  remainders or not: both read back the same FP32 master) rounded to FP32;
- each moment, into its `--exp-avg-dtype` / `--exp-avg-sq-dtype`, after every step: BF16 and FP32
  as they are, FP16 and FP8 E4M3 with TE's per-tensor scale (absmax / 32752 or absmax / 448,
  computed in FP32 from the FP64 absmax rounded to FP32; E4M3 saturating at +-448).
Each rounding is one round to nearest even of the FP64 value; each step reads back the stored
values (times their FP32 scale, in FP64). The hyperparameters are rounded to FP32, as TE FusedAdam's
kernel takes them (C floats), in the FP32 default as in the candidate: the lever's secondary
reference does the same, and without it the betas' rounding (an exp_avg_sq slope of -8.5e-7) would be
flagged as the candidate's own bias wherever the floor's error is FP32's (FP32 moments), as the
harness's systematic check against the floor takes no secondary reference. The gradients, their
clipping and the step are the reference's, in FP64. The outputs are handed over in the candidate's dtypes: the
master, the update and the moments in FP32, the BF16 parameter rounded from the last step's master
before it is stored (as TE's kernel writes the parameter from the master it computed).
"""

from dataclasses import dataclass

import torch

from correctness.adam.inputs import OptimizerUnit
from correctness.adam_precision.paths import StateDtypes, named_outputs
from correctness.adam_precision.state import load, store
from correctness.lever import ImplementationOutput
from references.adamw import adamw_run, clip_coefficient
from references.rounding import round_to_nearest

FORMAT = "lowered-precision Adam state"
ROUNDINGS = (
    "the master weights stored in --main-params-dtype before the first step and after every step (FP16 with TE"
    " FusedAdam's per-tensor scale, absmax to 32752; FP32, kept as remainders or not, as FP32)",
    "each Adam moment stored in its --exp-avg-dtype / --exp-avg-sq-dtype after every step (BF16 and FP32 as they are;"
    " FP16 and FP8 E4M3 with TE's per-tensor scale, absmax to 32752 or 448, E4M3 saturating)",
    "each a single round to nearest even of the FP64 value, read back times its FP32 scale by the next step;"
    " everything else in FP64",
    "lr, betas, eps and weight decay rounded to FP32, as TE FusedAdam's kernel takes them (the FP32 default too)",
    "the outputs in the candidate's dtypes: FP32 master, update and moments, and the BF16 parameter from the last"
    " step's master before it is stored",
)
STATE_NAMES = {"master": "master_param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}  # adamw_run's -> TE's


@dataclass(frozen=True)
class Fp64StoredAdamW:
    """The FP64 AdamW reference with every state stored in `dtypes` between steps (module docstring)."""

    dtypes: StateDtypes

    @property
    def name(self) -> str:
        return f"fp64-adamw-state-stored-{self.dtypes.label}"

    def run(self, unit: OptimizerUnit) -> ImplementationOutput:
        before_storage: dict[str, torch.Tensor] = {}  # each state's last value as computed, before stored

        def stored(name: str, values: torch.Tensor) -> torch.Tensor:
            before_storage[name] = values
            return load(store(self.dtypes.format(STATE_NAMES[name]), values), torch.float64)

        result = adamw_run(
            unit.weights, unit.grads,
            hypers=[unit.config.hyperparameters(i, unit.weight_decay_multiplier).rounded_to_fp32()
                    for i in unit.iterations()],
            clip_coefficients=[clip_coefficient(norm, unit.config.clip_grad) for norm in unit.grad_norms],
            stored=stored,
        )
        # the BF16 parameter as TE writes it, from the master it computed
        bf16 = round_to_nearest(before_storage["master"], torch.bfloat16)
        tensors = named_outputs(unit, result["master"], bf16, result["exp_avg"], result["exp_avg_sq"])
        return ImplementationOutput(
            tensors={name: t if t.dtype == torch.bfloat16 else t.float() for name, t in tensors.items()},
            backend=f"fp64 AdamW, state stored as {self.dtypes.label} (format floor)",
        )
