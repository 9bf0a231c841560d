"""megatron-core's vocabulary that lever kinds share: the parameter layout Megatron gives a model at
a TP rank (`layout.py`) and the process-group stand-in its modules read a size from
(`process_groups.py`). It imports no lever kind. (The HybridDeviceOptimizer's CPU shims stay with
the optimizer kind, `optimizer/megatron_on_cpu.py`: only that kind runs Megatron's optimizer; the
TE FusedAdam arithmetic they run is the Adam levers' shared `correctness/adam/arithmetic.py`.)"""
