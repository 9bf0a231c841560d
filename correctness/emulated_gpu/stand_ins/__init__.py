"""The stand-ins for the GPU kernels the tiers call, one module per kernel family; each declares
its stand-ins with correctness.emulated_gpu.kernels.stand_in. Every module here is imported when a
GPU is emulated (correctness.emulated_gpu.kernels.registered)."""
