"""The bias-swiglu-fusion lever: Megatron's fused SwiGLU against the unfused one and FP64
(`paths.py`: what runs; `lever.py`: where the flag applies, shapes, inputs, the lever and its tiers)."""
