"""The cross-entropy-fusion lever: Megatron's fused vocab-parallel cross entropy (and TE's) against
the unfused one, on gloo ranks of a tensor-parallel group (`ranks.py`: what runs in each rank;
`lever.py`: shapes, inputs, paths, the lever and its tiers)."""
