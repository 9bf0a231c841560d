"""Imported last by the rank server (correctness.distributed's forkserver), before it forks any rank:
torch.compile's one-time start done once there, in place of once in every rank.

A rank's first compiled call (Megatron's fused cross entropy is `torch.compile`d) spends about 7 s
starting the compiler (inductor's imports, its C++ toolchain and CPU checks) and under a second on
the graph itself. Here a throwaway function is compiled, forward and backward, and then dynamo's
caches are reset, so that every rank forked from the server starts warm but with no compiled graph,
as a fresh process does: the graphs a rank compiles, and their kernels, are its own. Inductor
compiles in the calling thread (`compile_threads = 1`, inherited by the ranks): a pool of compile
workers started in the server would be shared by every rank forked after it."""

import torch
import torch._inductor.config


def _warm_up() -> None:
    torch._inductor.config.compile_threads = 1

    @torch.compile
    def throwaway(x: torch.Tensor) -> torch.Tensor:
        return (x * 2).sum()

    throwaway(torch.ones(8, requires_grad=True)).backward()
    torch._dynamo.reset()


_warm_up()
