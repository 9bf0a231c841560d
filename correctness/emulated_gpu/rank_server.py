"""Imported first by the rank server (correctness.distributed's forkserver) of a caller under an
emulated GPU: it enters the emulation CORRECTNESS_EMULATE_GPU names, for the server's whole life,
before the server imports megatron-core (which then sees Transformer Engine, as on a GPU machine).
Every rank forked from that server starts inside it, as its parent's ranks would after entering it
themselves, and saves the 3-4 s a spawned rank spends importing torch, TE and megatron-core."""

import contextlib

from correctness.emulated_gpu.session import enter_from_environment

_EMULATION = contextlib.ExitStack()  # held open until the server ends
enter_from_environment(_EMULATION)
