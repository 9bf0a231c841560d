"""Ranks under the emulated GPU (correctness.distributed.run_ranks): the stand-ins they call are
counted where their caller counts its own, so that a tier run in ranks (cross entropy, gradient
reduction) records what stood in."""

from correctness.distributed import run_ranks
from correctness.emulated_gpu.gpus import parse_emulated
from correctness.emulated_gpu.kernels import snapshot, stand_ins_called
from correctness.emulated_gpu.session import emulated_gpu


def rank_and_nccl(rank, world_size):
    import torch.distributed as dist

    dist.new_group(list(range(world_size)), backend="nccl")  # the NCCL subgroup's stand-in
    return rank


def test_the_stand_ins_a_rank_calls_are_counted_by_its_caller():
    with emulated_gpu(parse_emulated("H100x1")):
        before = snapshot()
        assert run_ranks(rank_and_nccl, 1, timeout=120) == [0]
        called = stand_ins_called(since=before)
    assert called["torch.distributed.new_group"]["calls"] == 1
    assert called["torch.distributed.init_process_group"]["calls"] == 1  # the rank's own group, through gloo
