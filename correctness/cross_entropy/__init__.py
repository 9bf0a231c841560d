"""The cross-entropy-fusion lever: Megatron's fused vocab-parallel cross entropy (and TE's) against
the unfused one, on gloo ranks of a tensor-parallel group (`ranks.py`: what runs in each rank;
`paths.py`: the paths, their session of ranks and the FP64 reference; `lever.py`: shapes, inputs,
the lever and its tiers)."""
