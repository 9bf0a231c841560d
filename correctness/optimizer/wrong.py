"""Wrong offload splits for the optimizer-offload lever, each the lever's honest split with one thing
done wrong, to show what its evidence catches (tests/test_evidence_power.py,
benchmarks/evidence_power.py, docs/evidence-power.md). The BF16 weights left stale is declared in
correctness/wrong_implementations.py.

- The GPU share's learning rate one scheduler step ahead: the device optimizer's param groups given
  the lr of the next iteration (the scheduler stepped before the GPU share's optimizer steps, as a
  hybrid optimizer that syncs its inner optimizers' groups at the wrong point would). The GPU share
  keeps its betas, eps, weight decay and step count (so its bias corrections); the CPU share is
  right. The first step's lr is 0 and warmup follows, so every step's lr differs from the next one's:
  it changes every case whose GPU share is not empty.
"""

from dataclasses import replace

from correctness.adam.inputs import OptimizerUnit
from correctness.lever import Case, Implementation, Mutated, WrongImplementation
from correctness.optimizer.lever import NAME
from correctness.optimizer.paths import OffloadSplit

LR_ONE_STEP_AHEAD = "the GPU share's learning rate one scheduler step ahead"


def _lr_one_step_ahead(unit: OptimizerUnit) -> OptimizerUnit:
    """The unit as an optimizer whose schedule runs one iteration early sees it: each step's lr is the
    next iteration's (the step count, and so the bias corrections, stay right)."""
    return replace(unit, first_iteration=unit.first_iteration + 1)


def _gpu_share_lr_ahead(honest: Implementation) -> Implementation:
    if not isinstance(honest, OffloadSplit):
        raise TypeError(f"{LR_ONE_STEP_AHEAD}: built on the offload split, got {honest.name}")
    late = Mutated(base=honest.device, mutation="lr one scheduler step ahead", mutate=_lr_one_step_ahead)
    return replace(honest, device=late)


def _has_gpu_share(case: Case) -> bool:
    return case.shape.gpu_parameters > 0


WRONG_IMPLEMENTATIONS = (
    WrongImplementation(name=LR_ONE_STEP_AHEAD, lever=NAME, build=_gpu_share_lr_ahead,
                        changes=_has_gpu_share, caught_on=_has_gpu_share),
)
