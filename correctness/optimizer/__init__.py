"""The optimizer-offload lever's parameters: Megatron's TP slices, their values, and the CPU/GPU split."""
