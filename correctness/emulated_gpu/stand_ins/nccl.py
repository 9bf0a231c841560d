"""NCCL through gloo: the process groups a tier asks NCCL for are gloo groups over the same ranks,
in the same process-group code. Collectives then run on the CPU tensors under the emulated GPU
tensors, with gloo's arithmetic, not NCCL's (its ring order and BF16 sums are its own)."""

import torch.distributed as dist

from correctness.emulated_gpu.kernels import stand_in

_init_process_group = dist.init_process_group
_new_group = dist.new_group


def _gloo(backend):
    """A backend argument with NCCL replaced by gloo ("nccl", "cuda:nccl", "cpu:gloo,cuda:nccl")."""
    if backend is None:
        return "gloo"
    text = str(backend)
    if ":" not in text:
        return "gloo" if text.lower() == "nccl" else text
    return "gloo"


@stand_in(name="torch.distributed.init_process_group", stands_for="torch.distributed's NCCL process group",
          computes="a gloo process group over the same ranks (gloo's reduction order and arithmetic)")
def init_process_group(backend=None, *args, **kwargs):
    kwargs.pop("device_id", None)  # binds NCCL to a device: nothing to bind on gloo
    return _init_process_group(_gloo(backend), *args, **kwargs)


@stand_in(name="torch.distributed.new_group", stands_for="a torch.distributed NCCL subgroup",
          computes="a gloo subgroup of the same ranks")
def new_group(ranks=None, timeout=None, backend=None, pg_options=None, *args, **kwargs):
    kwargs.pop("device_id", None)
    return _new_group(ranks, timeout, _gloo(backend) if backend is not None else None, None, *args, **kwargs)


@stand_in(name="torch.distributed.is_nccl_available", stands_for="torch.distributed.is_nccl_available",
          computes="true: NCCL groups are served by gloo")
def is_nccl_available():
    return True


@stand_in(name="torch.cuda.nccl.version", stands_for="torch.cuda.nccl.version (NCCL's version)",
          computes="(0, 0, 0, 'gloo-stand-in'): no NCCL runs; gloo serves the NCCL groups")
def version():
    return 0, 0, 0, "gloo-stand-in"
