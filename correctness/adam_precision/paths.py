"""The precision-aware Adam lever's paths: several AdamW steps on one unit (a block of rows of a
GPU-share parameter) with the optimizer state in the dtypes Megatron's precision-aware optimizer
hands to TE FusedAdam.

Both paths start as Megatron's distributed optimizer sets FusedAdam up for
`--use-precision-aware-optimizer` without CPU offload (megatron-core 0.16.1
megatron/core/optimizer/__init__.py 365-387): the BF16 parameter shard, FP32 `decoupled_grad`s,
`master_weights=True` with `master_weight_dtype` = `--main-params-dtype`, `exp_avg_dtype`,
`exp_avg_sq_dtype`, `store_param_remainders` (True by default), AdamW mode; the gradients are
clipped by the global norm as Megatron clips them (correctness.adam.arithmetic.clipped), at the
recipe's schedule.

- `TeFusedAdamState` (the recipe's GPU tier): TE FusedAdam itself, on CUDA.
- `EmulatedFusedAdam` (the CPU tier): a stand-in for TE's CUDA kernel, named as such in its backend.
  Each step loads the stored state into FP32 (correctness.adam_precision.state.load), runs the
  FP32 model of the kernel's arithmetic the offload lever shares (correctness.adam.arithmetic.
  fused_adam_arithmetic: hyperparameters rounded to FP32, bias corrections from the rounded betas),
  writes the BF16 parameter from the FP32 master the kernel computed (round to nearest even; the
  remainder kernel's rounding where masters are kept as remainders) and stores each state back
  rounded to its dtype (state.store). With every state FP32 it is the offload lever's eager FP32
  AdamW, bitwise (a unit test holds it so).

Outputs per parameter `name`, as the offload lever names them: `name:master` (FP32: the master the
next step would read, unscaled), `name:update` (that master minus the BF16 weights it started
from), `name:bf16` (the BF16 parameter), `name:exp_avg` and `name:exp_avg_sq` (FP32, unscaled).

Negative controls (switches of both paths): `bias_correction=False`; `zero_moments=True`, both
moments re-initialised to zero before every step (the state lost between steps instead of kept
rounded; the step counter, and so the bias correction, goes on); `scaled=False`,
the FP16 and FP8 moments stored without their per-tensor scale.

Wrong implementations in the candidate's own format (`mistake`, the CPU stand-in only; declared in
correctness.adam_precision.wrong): every lowered state truncated toward zero instead of rounded to
nearest even (TRUNCATED); the moments rounded twice per step, through FP8 E4M3 (TE's per-tensor
scale) before their own format (THROUGH_FP8); the third step lost, its gradient never applied while
the step count goes on (STEP_LOST).
"""

from dataclasses import dataclass

import torch

from correctness.adam.arithmetic import QUANTITIES, clipped, fused_adam_arithmetic
from correctness.adam.inputs import OptimizerUnit
from correctness.adam_precision.state import (
    STATE_FORMATS, StateFormat, Stored, join_remainder, load, split_remainder, state_format, store, zeros,
)
from correctness.errors import ImplementationUnavailable
from correctness.lever import ImplementationOutput

MOMENTS = ("exp_avg", "exp_avg_sq")
TRUNCATED = "lowered states truncated toward zero instead of rounded to nearest even"
THROUGH_FP8 = "moments rounded twice per step, through FP8 E4M3 before their own format"
STEP_LOST = "the third step lost (its gradient never applied, the step count going on)"
MISTAKES = (TRUNCATED, THROUGH_FP8, STEP_LOST)
LOST_STEP = 2  # 0-based: the third of the five, the first at the peak learning rate


@dataclass(frozen=True)
class StateDtypes:
    """The dtypes of a FusedAdam's state, by Megatron's flag values, and whether FP32 masters of
    BF16 parameters are kept as remainders (Megatron's `store_param_remainders`)."""

    master: str = "fp32"
    exp_avg: str = "fp32"
    exp_avg_sq: str = "fp32"
    remainders: bool = False

    def __post_init__(self):
        state_format(self.master, ("fp32", "fp16"))
        state_format(self.exp_avg)
        state_format(self.exp_avg_sq)
        if self.remainders and self.master != "fp32":
            raise ValueError(f"master remainders need FP32 masters, not {self.master} (TE ignores them otherwise)")

    def format(self, state: str) -> StateFormat:
        names = {"master_param": self.master, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
        return STATE_FORMATS[names[state]]

    @property
    def all_fp32(self) -> bool:
        return (self.master, self.exp_avg, self.exp_avg_sq) == ("fp32",) * 3

    @property
    def scaled_moments(self) -> tuple[str, ...]:
        """The moments stored with a per-tensor scale (FP16, FP8)."""
        return tuple(name for name in MOMENTS if self.format(name).scale_range is not None)

    @property
    def label(self) -> str:
        master = "p-fp32-remainders" if self.remainders else f"p-{self.master}"
        return f"{master}-m-{self.exp_avg}-v-{self.exp_avg_sq}"

    def flags(self) -> str:
        """The training arguments that ask Megatron for this state."""
        return (f"--use-precision-aware-optimizer --main-params-dtype {self.master} --exp-avg-dtype {self.exp_avg}"
                f" --exp-avg-sq-dtype {self.exp_avg_sq}")


def named_outputs(unit: OptimizerUnit, master, bf16, exp_avg, exp_avg_sq) -> dict[str, torch.Tensor]:
    """The unit's outputs by tensor name; the update in the master's dtype (FP64 for the floor)."""
    values = {
        "master": master,
        "update": master - unit.weights.float(),
        "bf16": bf16,
        "exp_avg": exp_avg,
        "exp_avg_sq": exp_avg_sq,
    }
    return {f"{unit.param.name}:{quantity}": values[quantity] for quantity in QUANTITIES}


def _variant(bias_correction: bool, zero_moments: bool, scaled: bool, mistake: str | None = None) -> str:
    wrong = [text for text, on in (("no bias correction", not bias_correction),
                                   ("moments zeroed before each step", zero_moments),
                                   ("moments stored unscaled", not scaled), (mistake, mistake is not None)) if on]
    return "" if not wrong else f", {', '.join(wrong)}"


@dataclass(frozen=True)
class EmulatedFusedAdam:
    """TE FusedAdam's step with its state in `dtypes`, emulated on the CPU: FP32 arithmetic per
    element (the offload lever's model of the kernel), each state stored rounded to its dtype after
    every step, FP16 and FP8 with TE's per-tensor scale (module docstring). It stands in for the
    CUDA kernel; the recipe's GPU tier runs TE FusedAdam itself. `mistake` (one of MISTAKES) makes
    it a wrong implementation in the same format."""

    dtypes: StateDtypes
    bias_correction: bool = True
    zero_moments: bool = False
    scaled: bool = True
    mistake: str | None = None
    family = "emulated-fused-adam"

    def __post_init__(self):
        if self.mistake is not None and self.mistake not in MISTAKES:
            raise ValueError(f"unknown mistake {self.mistake!r}; known: {list(MISTAKES)}")

    @property
    def name(self) -> str:
        return f"{self.family}-{self.dtypes.label}"

    def _moment_stored(self, name: str, values: torch.Tensor) -> Stored:
        if self.mistake == THROUGH_FP8:
            values = load(store(STATE_FORMATS["fp8"], values))
        return store(self.dtypes.format(name), values, scaled=self.scaled, toward_zero=self.mistake == TRUNCATED)

    def run(self, unit: OptimizerUnit) -> ImplementationOutput:
        master_format = self.dtypes.format("master_param")
        truncated = self.mistake == TRUNCATED
        master = store(master_format, unit.weights.float(), toward_zero=truncated)
        p = unit.weights.float()
        moments = {name: zeros(self.dtypes.format(name), unit.weights.shape) for name in MOMENTS}
        for step, iteration in enumerate(unit.iterations()):
            if self.mistake == STEP_LOST and step == LOST_STEP:
                continue
            if self.zero_moments:
                moments = {name: zeros(self.dtypes.format(name), unit.weights.shape) for name in MOMENTS}
            hyper = unit.config.hyperparameters(iteration, unit.weight_decay_multiplier)
            p, m, v = fused_adam_arithmetic(
                load(master), clipped(unit, step), load(moments["exp_avg"]), load(moments["exp_avg_sq"]),
                hyper=hyper, step=step + 1, bias_correction=self.bias_correction,
            )
            # An FP32 master kept as remainders reads back exactly (join_remainder(split_remainder(p))
            # is p: a unit test holds it), so it is stored as FP32 here.
            master = store(master_format, p, toward_zero=truncated)
            moments = {name: self._moment_stored(name, values) for name, values in zip(MOMENTS, (m, v))}
        # The BF16 parameter the last step wrote, from the FP32 master it computed.
        bf16 = split_remainder(p)[0] if self.dtypes.remainders else p.to(torch.bfloat16)
        return ImplementationOutput(
            tensors=named_outputs(unit, load(master), bf16, load(moments["exp_avg"]), load(moments["exp_avg_sq"])),
            backend=f"emulated TE FusedAdam (cpu stand-in for the CUDA kernel: fp32 math, {self.dtypes.label}"
            + _variant(self.bias_correction, self.zero_moments, self.scaled, self.mistake) + ")",
        )


def _fused_adam_classes():
    try:
        import transformer_engine
        from transformer_engine.pytorch.optimizers import FusedAdam
        from transformer_engine.pytorch.tensor.float8_tensor import Float8Tensor
    except Exception as error:  # TE raises RuntimeError, OSError... where unusable
        raise ImplementationUnavailable(
            f"Transformer Engine is not usable here: {type(error).__name__}: {error}") from None
    if not torch.cuda.is_available():
        raise ImplementationUnavailable("TE FusedAdam needs a CUDA device; none is available")

    class UnscaledMomentsFusedAdam(FusedAdam):
        """FusedAdam storing its FP16 and FP8 moments without their per-tensor scale (a control)."""

        def _apply_scale(self, state_name, unscaled_state, scaled_state, scale):
            if state_name == "master_param" or scaled_state.dtype == torch.bfloat16:
                return super()._apply_scale(state_name, unscaled_state, scaled_state, scale)
            scale.fill_(1.0)
            if isinstance(scaled_state, Float8Tensor):
                scaled_state._quantizer.scale.fill_(1.0)
            scaled_state.copy_(unscaled_state)

    return FusedAdam, UnscaledMomentsFusedAdam, transformer_engine.__version__


@dataclass(frozen=True)
class TeFusedAdamState:
    """TE FusedAdam on the GPU with its state in `dtypes`, set up as Megatron's precision-aware
    distributed optimizer sets it up (module docstring). TE is imported only when this runs;
    without TE or a GPU the path is unavailable."""

    dtypes: StateDtypes
    bias_correction: bool = True
    zero_moments: bool = False
    scaled: bool = True
    family = "te-fused-adam"

    @property
    def name(self) -> str:
        return f"{self.family}-{self.dtypes.label}"

    def run(self, unit: OptimizerUnit) -> ImplementationOutput:
        fused_adam, unscaled_fused_adam, version = _fused_adam_classes()
        param = torch.nn.Parameter(unit.weights.to("cuda").clone())  # the BF16 parameter shard
        hyper = unit.config.hyperparameters(unit.first_iteration, unit.weight_decay_multiplier)
        optimizer = (fused_adam if self.scaled else unscaled_fused_adam)(
            [param], lr=hyper.lr, betas=(hyper.beta1, hyper.beta2), eps=hyper.eps, weight_decay=hyper.weight_decay,
            bias_correction=self.bias_correction, adam_w_mode=True, master_weights=True,
            master_weight_dtype=self.dtypes.format("master_param").te_dtype,
            exp_avg_dtype=self.dtypes.format("exp_avg").te_dtype,
            exp_avg_sq_dtype=self.dtypes.format("exp_avg_sq").te_dtype,
            use_decoupled_grad=True, store_param_remainders=self.dtypes.remainders,
        )
        for step, iteration in enumerate(unit.iterations()):
            optimizer.param_groups[0]["lr"] = unit.config.lr(iteration)
            param.decoupled_grad = clipped(unit, step).to("cuda")
            if self.zero_moments and step > 0:
                for name in MOMENTS:
                    optimizer._initialize_state(param, name, zero_buffer=True)  # zeros, scale 1: a fresh state
            optimizer.step()
        torch.cuda.synchronize()
        state = optimizer.state[param]
        bf16 = param.detach().cpu()
        if self.dtypes.remainders:
            master = join_remainder(bf16, state["master_param"].detach().cpu())
        else:
            master = optimizer.get_unscaled_state(param, "master_param").float().cpu()
        moments = [optimizer.get_unscaled_state(param, name).float().cpu() for name in MOMENTS]
        return ImplementationOutput(
            tensors=named_outputs(unit, master, bf16, *moments),
            backend=f"TE FusedAdam (cuda, {self.dtypes.label}"
            + _variant(self.bias_correction, self.zero_moments, self.scaled) + ")",
            details={"transformer_engine": version},
        )
