"""correctness.distributed: ranks of a gloo group in forked-server processes, stopped on failure and in time."""

import multiprocessing
import time

import pytest
import torch
import torch.distributed as dist

import torch._inductor.config

from correctness import distributed
from correctness.distributed import DistributedError, rank_server_pid, run_ranks, stop_rank_server


def all_reduce_rank(rank, world_size, base):
    value = torch.tensor([float(base + rank)])
    dist.all_reduce(value)
    return value.item(), dist.get_world_size(), torch.get_num_threads()


def environment_variable(rank, world_size, name):
    import os

    return os.environ.get(name)


def large_tensor(rank, world_size, elements):
    return torch.full((elements,), float(rank))


def raise_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("rank one refuses")
    dist.barrier()  # rank 0 waits here for a peer that never comes: it must be stopped, not hang
    return rank


def hang(rank, world_size):
    time.sleep(60)


def die_on_rank_zero(rank, world_size):
    if rank == 0:
        import os

        os._exit(7)
    dist.barrier()


def test_ranks_join_one_group_and_return_in_rank_order():
    results = run_ranks(all_reduce_rank, 3, 10)
    assert results == [(33.0, 3, 1)] * 3  # 10 + 11 + 12, one thread each


def test_ranks_see_the_callers_environment_at_the_call(monkeypatch):
    run_ranks(all_reduce_rank, 1, 0)  # the forkserver is running before the variable is set
    monkeypatch.setenv("CORRECTNESS_RANK_PROBE", "set after the server started")
    assert run_ranks(environment_variable, 2, "CORRECTNESS_RANK_PROBE") == ["set after the server started"] * 2
    monkeypatch.delenv("CORRECTNESS_RANK_PROBE")
    assert run_ranks(environment_variable, 1, "CORRECTNESS_RANK_PROBE") == [None]


def test_a_rank_that_raises_stops_every_rank_in_one_line():
    started = time.monotonic()
    with pytest.raises(DistributedError, match=r"raise_on_rank_one on 2 gloo ranks: rank 1 raised ValueError: rank one refuses"):
        run_ranks(raise_on_rank_one, 2, timeout=60)
    assert time.monotonic() - started < 30
    assert multiprocessing.active_children() == []  # every rank stopped


def test_a_run_past_its_timeout_is_stopped():
    started = time.monotonic()
    with pytest.raises(DistributedError, match=r"hang on 2 gloo ranks: ranks \[0, 1\] did not finish within 3 s"):
        run_ranks(hang, 2, timeout=3)
    assert time.monotonic() - started < 20
    assert multiprocessing.active_children() == []


def test_a_rank_that_dies_is_named():
    with pytest.raises(DistributedError, match="rank 0 died .exit code 7."):
        run_ranks(die_on_rank_zero, 2, timeout=60)


def test_large_tensors_come_back_whole():
    """By value: a shared-memory handle would die with the rank that made it."""
    for _ in range(3):
        first, second = run_ranks(large_tensor, 2, 1 << 20)
        assert first.shape == (1 << 20,) and bool((first == 0).all()) and bool((second == 1).all())


def compiler_state(rank, world_size):
    import sys

    import torch._inductor.config

    return "correctness.compiler_warmup" in sys.modules, torch._inductor.config.compile_threads


def test_ranks_that_compile_get_a_server_that_started_the_compiler(monkeypatch):
    """A server without the compiler's start is replaced for ranks that compile (`compiles=True`);
    that server then serves every rank, and its ranks compile in their own thread (no pool of
    compile workers shared between ranks forked from one server)."""
    monkeypatch.setattr(distributed, "PRELOADED", ["torch", "torch.distributed"])  # a quick start
    stop_rank_server()
    try:
        assert run_ranks(compiler_state, 1) == [(False, torch._inductor.config.compile_threads)]
        cold = rank_server_pid()
        assert run_ranks(compiler_state, 2, compiles=True) == [(True, 1), (True, 1)]
        assert rank_server_pid() != cold
        warm = rank_server_pid()
        assert run_ranks(compiler_state, 1) == [(True, 1)] and rank_server_pid() == warm
    finally:
        stop_rank_server()  # the next test's runs start one with every module preloaded
