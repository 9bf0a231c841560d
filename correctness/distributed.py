"""Run a function on several ranks of a torch.distributed process group, on the CPU (gloo).

`run_ranks(function, world_size, *args)` starts `world_size` processes; each joins one gloo group
and returns `function(rank, world_size, *args)`, and the caller gets the ranks' results in rank
order. This is how a CPU tier runs upstream code whose numerics include collectives (Megatron's
vocab-parallel cross entropy at TP 2, a data-parallel all-reduce over 8 ranks) without a GPU.

- The ranks are forked from a forkserver that has imported torch and the megatron-core modules the
  suite's ranks use, once (the first call starts it; later calls reuse it): starting 8 ranks costs
  under 2 s instead of 8 s of torch imports on 2 cores (about 45 s with megatron-core's). Like spawned
  processes they share nothing with the caller but their arguments, and each rank runs with the
  caller's environment as it is at the call (os.environ is passed along, since the server's own
  was fixed when it started). What a library reads from the environment when it is imported
  (TORCH_COMPILE_DISABLE: torch._dynamo's config) is read by the server, from the environment of
  the caller's first run. Ranks that use CUDA (`cuda=True`) are spawned instead: a process forked
  from one that may have touched CUDA (megatron-core's import, with Transformer Engine installed)
  cannot use it. A caller under an emulated GPU (CORRECTNESS_EMULATE_GPU) gets a server that entered
  that emulation before its imports (correctness.emulated_gpu.rank_server), so its ranks start inside
  it and megatron-core sees Transformer Engine as on a GPU machine; its `cuda=True` ranks fork from
  that server too (the emulated GPU is the CPU), where a real GPU's would be spawned. A server of
  another emulation, or of none, is stopped first.
- For ranks that call compiled code (`compiles=True`), the server starts torch.compile once before it
  forks (correctness.compiler_warmup, about 4 s): each rank's first compiled call then takes under a
  second instead of about 8 s.
- The group meets through a file in a fresh temporary folder (`file://` init), not a TCP port, so
  pytest-xdist workers and concurrent runs never collide.
- A rank that raises ends the run: every rank is stopped, and DistributedError names the rank and
  its exception in one line. A run that outlives `timeout` seconds (a rank stuck in a collective its
  peers never reach) is stopped the same way, and so is a run the caller leaves by an exception
  (KeyboardInterrupt included): its ranks are stopped and its folder removed before it goes on.
- Ranks end with their caller, however it ends (SIGKILL included). Their parent is the rank server,
  not the caller, and the server lives while a rank holds its pipe, so a rank stuck in a collective
  of a caller killed outright would keep itself, the server and multiprocessing's resource tracker
  alive for good: each rank watches a pipe whose other end only the caller holds, and leaves when
  it closes. Once the ranks are gone the server and the tracker see their own pipes close and leave.
- Stopping: `catch_stop_signals()` turns SIGINT and SIGTERM into `Stopped` (a KeyboardInterrupt)
  in the main thread, so that a signal unwinds the caller in order (pytest ends its session and
  writes its records, run_ranks stops its ranks and removes its folder, atexit removes
  multiprocessing's pymp-* folder) where SIGTERM's default action would leave all of that behind;
  `stop_rank_server()` ends the server (the pytest plugin calls both, at configure and unconfigure).
- Each rank runs torch on `threads` CPU threads (default 1): N ranks on a 2-core machine would
  otherwise start N x cores threads.
- `function` must be importable by name (a module-level function): the ranks import it.
  Results travel back pickled by value; return CPU tensors, numbers or plain data.
"""

import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import queue
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from correctness.emulated_gpu.gpus import VARIABLE as EMULATION_VARIABLE
from correctness.emulated_gpu.kernels import add_calls
from correctness.errors import CorrectnessError

DEFAULT_TIMEOUT = 300.0  # seconds for the whole run, start-up included
# Imported once by the forkserver, before it forks ranks; a module that is not installed is left out.
PRELOADED = [
    "torch", "torch.distributed",
    "megatron.core.distributed.param_and_grad_buffer",  # the gradient reduction's ranks
    "megatron.core.parallel_state", "megatron.core.tensor_parallel",  # the cross entropy's
    "megatron.core.fusions.fused_cross_entropy",
]
COMPILER_WARMUP = "correctness.compiler_warmup"  # preloaded last for ranks that compile (run_ranks' `compiles`)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
CALLER_GONE = 1  # the exit code of a rank whose caller ended before it


class DistributedError(CorrectnessError):
    """A rank raised, died or did not finish in time."""


def _rank_main(function: Callable[..., Any], rank: int, world_size: int, store: str, threads: int,
               results: Any, lifeline: Any, environment: dict[str, str], args: tuple[Any, ...]) -> None:
    _end_with_caller(lifeline)
    os.environ.clear()
    os.environ.update(environment)
    import torch
    import torch.distributed as dist

    from correctness.emulated_gpu.kernels import snapshot as kernel_calls
    from correctness.emulated_gpu.session import enter_from_environment

    torch.set_num_threads(threads)
    try:
        with contextlib.ExitStack() as emulation:
            enter_from_environment(emulation)  # the caller's emulated GPU, where it ran under one
            dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
            try:
                # Pickled by value here: the queue's own pickler would send tensors as shared-memory
                # handles, which die with this process before the caller has read them.
                # With the emulated GPU's stand-in calls made here, which the caller counts as its own.
                results.put((rank, True, pickle.dumps((function(rank, world_size, *args), kernel_calls()))))
            except BaseException as error:  # reported before the group goes down and breaks the peers'
                results.put((rank, False, _one_line(error)))
            finally:
                dist.destroy_process_group()
    except BaseException as error:
        results.put((rank, False, _one_line(error)))


def _end_with_caller(lifeline: Any) -> None:
    """Leave this process once `lifeline`'s other end, which only the caller holds, closes: when the
    caller ends, or stops the run."""
    def watch() -> None:
        try:
            lifeline.recv_bytes()  # the caller never writes: this returns at the end of the pipe
        except (EOFError, OSError):
            pass
        os._exit(CALLER_GONE)

    threading.Thread(target=watch, name="correctness-lifeline", daemon=True).start()


def _one_line(error: BaseException) -> str:
    last = traceback.extract_tb(error.__traceback__)[-1:] if error.__traceback__ else []
    where = f" ({last[0].filename.rsplit('/', 1)[-1]}:{last[0].lineno})" if last else ""
    return " ".join(f"{type(error).__name__}: {error}{where}".split())


_served: list[Any] = [None, False]  # the running rank server's emulated GPU (None: none), and whether it started the compiler


def _rank_server(emulation: str | None, compiles: bool) -> Any:
    """The forkserver context for ranks under `emulation` (a CORRECTNESS_EMULATE_GPU spec, or None):
    a server started under another emulation, or under none, is stopped first, so that a rank is
    only ever forked from a server in its caller's emulation (correctness.emulated_gpu.rank_server
    enters it in the server before megatron-core is imported). Ranks that `compiles` get a server
    that started torch.compile (COMPILER_WARMUP, about 4 s once); a server without it is replaced,
    and one with it serves every rank."""
    if rank_server_pid() is not None and (_served[0] != emulation or (compiles and not _served[1])):
        stop_rank_server()
    if rank_server_pid() is None:
        _served[:] = [emulation, compiles]
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload((["correctness.emulated_gpu.rank_server"] if emulation else []) + PRELOADED
                                   + ([COMPILER_WARMUP] if _served[1] else []))
    return context


def run_ranks(function: Callable[..., Any], world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT,
              threads: int = 1, cuda: bool = False, compiles: bool = False) -> list[Any]:
    """function(rank, world_size, *args) on each of `world_size` gloo ranks; their results in rank
    order. `compiles`: the function calls torch.compile'd code (Megatron's fused cross entropy)."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world size must be a positive integer, got {world_size!r}")
    emulation = os.environ.get(EMULATION_VARIABLE) or None
    if cuda and emulation is None:
        context = multiprocessing.get_context("spawn")
    else:  # an emulated GPU is the CPU: its ranks fork from a server inside the emulation
        context = _rank_server(emulation, compiles)
    results = context.Queue()
    lifeline, held_end = context.Pipe(duplex=False)  # the ranks read; the caller holds the other end
    environment = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="correctness-gloo-") as folder:
        store = os.path.join(folder, "store")
        processes = [
            context.Process(target=_rank_main,
                            args=(function, rank, world_size, store, threads, results, lifeline, environment, args),
                            daemon=True, name=f"correctness-rank-{rank}")
            for rank in range(world_size)
        ]
        try:
            for process in processes:
                process.start()
            values = _collect(processes, results, world_size, timeout, getattr(function, "__name__", "function"))
        except BaseException:
            _stop(processes, wait=0)
            raise
        else:
            _stop(processes, wait=5)
        finally:
            results.close()
            lifeline.close()
            held_end.close()  # a rank still there (it cannot be: stopped above) would leave now
        return values


def _collect(processes, results, world_size: int, timeout: float, name: str) -> list[Any]:
    deadline = time.monotonic() + timeout
    values: dict[int, Any] = {}
    while len(values) < world_size:
        left = deadline - time.monotonic()
        if left <= 0:
            missing = sorted(set(range(world_size)) - set(values))
            raise DistributedError(f"{name} on {world_size} gloo ranks: ranks {missing} did not finish within {timeout:g} s")
        try:
            rank, ok, value = results.get(timeout=min(left, 1.0))
        except queue.Empty:
            dead = _dead(processes, values)
            if dead:
                raise DistributedError(f"{name} on {world_size} gloo ranks: {dead}")
            continue
        if not ok:
            # A rank that fails takes its peers' connections down with it: wait a moment for the
            # cause (a rank that died, or raised first) and name it before the broken connections.
            errors = [(rank, value)] + _more_errors(results, 5.0 if TRANSPORT_ERROR in value else 0.5)
            errors.sort(key=lambda error: TRANSPORT_ERROR in error[1])
            dead = _dead(processes, values, reported={rank for rank, _ in errors})
            first_rank, first = errors[0]
            cause = f"{dead}; then " if dead else ""
            raise DistributedError(f"{name} on {world_size} gloo ranks: {cause}rank {first_rank} raised {first}")
        values[rank], calls = pickle.loads(value)
        add_calls(calls)
    return [values[rank] for rank in range(world_size)]


TRANSPORT_ERROR = "gloo/transport"  # in the message of a rank whose peer went away


def _more_errors(results, seconds: float) -> list[tuple[int, str]]:
    """Errors other ranks report within `seconds`, up to the first that is not a broken connection
    (on a loaded machine the cause can arrive after its peers' broken connections)."""
    errors, deadline = [], time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        try:
            rank, ok, value = results.get(timeout=left)
        except queue.Empty:
            break
        if not ok:
            errors.append((rank, value))
            if TRANSPORT_ERROR not in value:
                break
    return errors


def _dead(processes, values: dict[int, Any], reported: set[int] = frozenset()) -> str | None:
    """"rank R died (exit code C)" for the first rank that ended without a result, or None."""
    for rank, process in enumerate(processes):
        if rank not in values and rank not in reported and not process.is_alive() and process.exitcode not in (0, None):
            return f"rank {rank} died (exit code {process.exitcode})"
    return None


def _stop(processes, wait: float) -> None:
    """Join the ranks that started (waiting up to `wait` seconds for each to exit); stop any still
    running, by force if need be."""
    processes = [process for process in processes if process.pid is not None]
    for process in processes:
        process.join(timeout=wait)
    for process in processes:
        if process.is_alive():
            process.terminate()
            process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join()


class Stopped(KeyboardInterrupt):
    """SIGINT or SIGTERM, raised in the main thread while catch_stop_signals() is in force: an
    interruption like Ctrl-C's own KeyboardInterrupt, which pytest and run_ranks unwind in order."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def exit_status(self) -> int:
        """128 + the signal: the status a shell reports for a process the signal ended."""
        return 128 + self.signum


def stop_exit_status(interruption: BaseException) -> int | None:
    """The exit status of a run a signal stopped: Stopped's, or 130 for Ctrl-C's KeyboardInterrupt
    where no handler of ours was in force; None for another interruption (pytest's own, raised on
    collection errors, is a KeyboardInterrupt too)."""
    if isinstance(interruption, Stopped):
        return interruption.exit_status
    return 128 + signal.SIGINT if type(interruption) is KeyboardInterrupt else None


class InterruptionWatch:
    """pytest plugin (register an instance): the interruption that stopped a pytest run, where one
    did (pytest_keyboard_interrupt), and the exit status it calls for."""

    def __init__(self) -> None:
        self.interruption: BaseException | None = None

    def pytest_keyboard_interrupt(self, excinfo) -> None:
        self.interruption = excinfo.value

    @property
    def exit_status(self) -> int | None:
        """The exit status for the signal that stopped the run (130, 143); None where none did."""
        return stop_exit_status(self.interruption) if self.interruption is not None else None


def catch_stop_signals() -> Callable[[], None]:
    """From now on SIGINT and SIGTERM raise Stopped in the main thread; return what puts their
    handlers back. A signal someone else handles or ignores (SIGINT under nohup) is left as it
    is, and so is one already caught here (nested calls, as `correctness run` around pytest's
    session). Elsewhere than in the main thread, where Python takes no handler, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    replaced = {signum: signal.signal(signum, _raise_stopped) for signum in STOP_SIGNALS
                if signal.getsignal(signum) in (signal.SIG_DFL, signal.default_int_handler)}

    def restore() -> None:
        for signum, handler in replaced.items():
            signal.signal(signum, handler)

    return restore


def _raise_stopped(signum: int, frame: Any) -> None:
    raise Stopped(signum)


def rank_server_pid() -> int | None:
    """The pid of this process's rank server (multiprocessing's forkserver), None where none runs."""
    return multiprocessing.forkserver._forkserver._forkserver_pid


def stop_rank_server() -> None:
    """End this process's rank server, if it started one; the next run_ranks starts another.

    Killed, then reaped: asked to leave (its pipe closed, multiprocessing's own ForkServer._stop),
    it would go only once no rank of it is left and it has finished importing PRELOADED, which can
    take a minute; it holds nothing that needs a cleanup of its own. _stop then closes the pipe,
    reaps it and removes its socket."""
    server = multiprocessing.forkserver._forkserver
    pid = server._forkserver_pid
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:  # it ended by itself, not reaped yet: _stop reaps it
        pass
    server._stop()
