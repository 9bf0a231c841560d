"""The optimizer-offload lever: its paths (torch AdamW, eager, TE FusedAdam, Megatron's own
HybridDeviceOptimizer), checkpoint values, and its tiers. The Adam machinery it shares with the
precision-aware-Adam lever (settings, inputs, synthetic values, the split) is in correctness/adam/."""
