"""megatron-core's vocabulary that lever kinds share: the parameter layout Megatron gives a model at
a TP rank (`layout.py`) and the process-group stand-in its modules read a size from
(`process_groups.py`). It imports no lever kind. (The HybridDeviceOptimizer's CPU shims stay with
the optimizer kind, `optimizer/megatron_on_cpu.py`: they model TE FusedAdam's arithmetic, which
that kind owns.)"""
