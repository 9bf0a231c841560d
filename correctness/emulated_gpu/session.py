"""Entering and leaving the emulated GPU: `emulated_gpu(Emulated)` puts every shim in place for
its block and takes all of it away after.

Inside: torch.cuda answers as the named GPU (correctness.emulated_gpu.runtime); tensors know
their place (placement, tensor_attributes); BF16 GEMMs are computed as cuBLAS computes them
(correctness.cpu_gemm, inside the placement mode); the GPU kernels the tiers call have their stand-ins (kernels); NCCL process
groups run on gloo; and, where TE 2.17's Python is installed for the CPU (correctness.te_on_cpu),
`transformer_engine` imports, as on a training image, with its compiled extension's stand-in
answering for the emulated GPU. TORCH_COMPILE_DISABLE=1: torch.compile (megatron-core's jit_fuser)
would need a C++ compiler and, under a dispatch mode, traces nothing; its functions run eagerly.
CORRECTNESS_EMULATE_GPU names the emulation to the processes a tier starts (ranks), which enter it
themselves (`enter_from_environment`).
"""

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils.flop_counter  # noqa: F401 - imported before torch.version.cuda is answered: it would warn of triton

from correctness.emulated_gpu import kernels, runtime, triton_interpreter
from correctness.emulated_gpu.gpus import VARIABLE, Emulated, parse_emulated
from correctness.emulated_gpu.placement import AmbientMode, PlacementMode
from correctness.emulated_gpu.tensor_attributes import TENSOR_ATTRIBUTES, TORCH_ATTRIBUTES
from correctness.environment import attributes_replaced, environment_set

CUDA_VERSION = "13.0"  # what torch.version.cuda answers: the lent GPU machines' CUDA
ENVIRONMENT = {"TORCH_COMPILE_DISABLE": "1"}


class _Active:
    emulation: Emulated | None = None


ACTIVE = _Active()


def active() -> Emulated | None:
    """The emulation in force in this process, None where none is."""
    return ACTIVE.emulation


@contextlib.contextmanager
def emulated_gpu(emulation: Emulated) -> Iterator[Emulated]:
    if ACTIVE.emulation is not None:
        raise RuntimeError(f"a GPU is emulated here already ({ACTIVE.emulation.spec})")
    runtime.start(emulation)
    ACTIVE.emulation = emulation
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(environment_set({**ENVIRONMENT, VARIABLE: emulation.spec}))
            stack.enter_context(triton_interpreter.in_force())  # before TE's import: its kernels interpreted
            stack.enter_context(attributes_replaced(torch.cuda, {
                **runtime.cuda_attributes(emulation), "default_generators": runtime.STATE.generators}))
            stack.enter_context(attributes_replaced(torch.cuda.nvtx, runtime.NVTX_ATTRIBUTES))
            stack.enter_context(attributes_replaced(torch.backends.cudnn, runtime.CUDNN_ATTRIBUTES))
            stack.enter_context(attributes_replaced(torch.version, {"cuda": CUDA_VERSION}))
            stack.enter_context(attributes_replaced(torch.Tensor, TENSOR_ATTRIBUTES))
            stack.enter_context(attributes_replaced(torch, {**TORCH_ATTRIBUTES,
                                                            "Generator": runtime.EmulatedGenerator}))
            stack.enter_context(PlacementMode(emulation.model.gpu))
            stack.enter_context(AmbientMode())
            stack.enter_context(kernels.installed(emulation))
            yield emulation
    finally:
        # Placements are kept: a tensor placed on the GPU in one block (a cache in TE's or
        # Megatron's modules, which outlive it) is still there in the next, as in a process with a GPU.
        ACTIVE.emulation = None
        runtime.stop()


def enter_from_environment(stack: contextlib.ExitStack) -> Emulated | None:
    """In a process a tier started (a rank): enter the emulation its parent was under, where
    CORRECTNESS_EMULATE_GPU names one."""
    spec = os.environ.get(VARIABLE)
    if not spec or ACTIVE.emulation is not None:
        return None
    return stack.enter_context(emulated_gpu(parse_emulated(spec)))


NOTE = "an emulated GPU on the CPU: proves code paths, never a GPU's numbers; not evidence"


def provenance(stand_ins: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """What a record made under the emulation says of it (None where no GPU is emulated): the GPU
    named, the CUDA version torch was made to report, and what stood in for each kernel its cases
    called (`stand_ins`, from kernels.stand_ins_called; None: every stand-in this process called)."""
    if ACTIVE.emulation is None:
        return None
    return {**ACTIVE.emulation.record(), "cuda_reported": CUDA_VERSION,
            "stand_ins": kernels.stand_ins_called() if stand_ins is None else stand_ins, "note": NOTE}
