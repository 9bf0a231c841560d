"""Adam machinery that lever kinds share (the optimizer-offload and precision-aware-Adam levers):
the recipe's optimizer settings (`config.py`), the streamed units and seeded gradients
(`inputs.py`), the synthetic weights (`synthetic_values.py`), Megatron's CPU/GPU split
(`split.py`), a recipe's offload setting (`offload_setting.py`), Megatron's clip and TE FusedAdam's
FP32 arithmetic (`arithmetic.py`), the FP64 reference path (`reference.py`) and the per-share
summary (`share_summary.py`). It holds no lever (no lever.py) and imports no lever kind."""
