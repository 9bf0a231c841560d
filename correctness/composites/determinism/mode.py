"""What Megatron-LM's `--deterministic-mode` switches, as a path wrapper.

Megatron-LM (megatron/training/arguments.py at the recipes' commit; megatron-core 0.16.1):
`torch.use_deterministic_algorithms(True)` for the whole run, Transformer Engine's attention
refused unless NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 (extensions/transformer_engine.py, 1254-1260;
TE then selects only backends with a deterministic backward), NCCL_ALGO required to be one of
Tree, Ring, CollnetDirect, CollnetChain or ^NVLS, and flash-attn and the fused cross entropy
refused. In megatron-core itself `deterministic_mode` picks an indexing embedding lookup over
F.embedding (tensor_parallel/layers.py), and torch's deterministic switch picks index_add over
scatter_add in the MoE unpermute and index_put in the router's map (moe/moe_utils.py).

`InMode(base, deterministic=True)` runs a path with those switches a process can set around one
call: torch's deterministic algorithms (cuDNN's deterministic flag and no autotuning with it),
NVTE_ALLOW_NONDETERMINISTIC_ALGO=0, and on CUDA a cuBLAS workspace config (torch refuses cuBLAS
in deterministic mode without one); `deterministic=False` runs it with all of them off, as a
recipe without the flag does. Everything is restored after the call. A kernel that torch says
has no deterministic implementation refuses the case (a skip: Megatron would stop there too).
"""

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from correctness.environment import environment_set
from correctness.errors import ImplementationUnavailable
from correctness.lever import Implementation, ImplementationOutput

NVTE_SWITCH = "NVTE_ALLOW_NONDETERMINISTIC_ALGO"
CUBLAS_WORKSPACE = "CUBLAS_WORKSPACE_CONFIG"
CUBLAS_WORKSPACE_VALUE = ":4096:8"  # one of the two values torch's reproducibility notes name
NO_DETERMINISTIC_KERNEL = "does not have a deterministic implementation"
# cuBLAS reads CUBLAS_WORKSPACE_CONFIG when it makes its handle, the process's first cuBLAS call: set
# here, it may come too late (torch's check reads the variable at each call and is then satisfied).
LATE_WORKSPACE = ("by this process around the call, where cuBLAS may have read the environment before it:"
                  " export CUBLAS_WORKSPACE_CONFIG before Python starts (scripts/gpu-check does)")


@contextlib.contextmanager
def determinism(deterministic: bool, device: torch.device) -> Iterator[dict[str, Any]]:
    """The switches of --deterministic-mode on (or all off) around a block; yields what was set."""
    env = {NVTE_SWITCH: "0" if deterministic else "1"}
    if deterministic and device.type == "cuda" and CUBLAS_WORKSPACE not in os.environ:
        env[CUBLAS_WORKSPACE] = CUBLAS_WORKSPACE_VALUE
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    with environment_set(env):
        torch.use_deterministic_algorithms(deterministic)
        torch.backends.cudnn.deterministic = deterministic
        if deterministic:
            torch.backends.cudnn.benchmark = False
        try:
            yield {"torch_deterministic_algorithms": deterministic, "cudnn_deterministic": deterministic,
                   **{name: os.environ.get(name) for name in (NVTE_SWITCH, CUBLAS_WORKSPACE)},
                   **({"cublas_workspace_config_set": LATE_WORKSPACE} if CUBLAS_WORKSPACE in env else {})}
        finally:
            torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
            torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[2], saved[3]


@dataclass(frozen=True)
class InMode:
    """`base` run with --deterministic-mode's switches on (`deterministic`) or off."""

    base: Implementation
    deterministic: bool
    device: str = "cpu"  # the tier's: the cuBLAS workspace setting is for CUDA only

    @property
    def name(self) -> str:
        return f"{self.base.name} ({'deterministic mode' if self.deterministic else 'nondeterminism allowed'})"

    def run(self, inputs: Any) -> ImplementationOutput:
        with determinism(self.deterministic, torch.device(self.device)) as settings:
            try:
                output = self.base.run(inputs)
            except RuntimeError as error:
                if self.deterministic and NO_DETERMINISTIC_KERNEL in str(error):
                    raise ImplementationUnavailable(f"{self.base.name}: under deterministic mode torch refuses it:"
                                          f" {str(error).splitlines()[0]}") from error
                raise
        return ImplementationOutput(tensors=output.tensors, backend=output.backend,
                          details={**output.details, "deterministic_mode": settings})
