"""The rope-fusion lever: Megatron's unfused RoPE (`--no-rope-fusion`) against TE's fused RoPE
kernel and an FP64 RoPE (`shapes.py`: the recipe's RoPE shapes; `paths.py`: inputs, Megatron's
function, the fused kernel's arithmetic, the references; `lever.py`: controls, invariants, tiers)."""
