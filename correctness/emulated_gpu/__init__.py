"""An emulated CUDA GPU on the CPU (`--emulate-gpu H100|H200`), so that every GPU tier runs end to
end before it meets a GPU.

- gpus: the GPUs it can stand for, as torch.cuda reports them, and the option's value;
- runtime: torch.cuda's answers, streams, events, memory and RNG on the emulated GPUs;
- placement, tensor_attributes: which tensors the code placed on the GPU, a real device's rules
  for mixing them, and the moves;
- kernels: the stand-ins' registry; nccl, sdpa, te_kernels, megatron_kernels: the stand-ins;
- session: entering and leaving it all, and what a record says of it.

Emulated runs prove code paths, never numbers: a record made here is never evidence.
"""
