"""The command line's subcommands, one module each: `add_arguments(parser)` and `run(args) -> int`.

Each is a thin face over the library: it parses, calls, and prints a table (or JSON with --json).
Exit status: 0 success (or a passing verdict), 1 a failing verdict, 2 bad input or usage.

The pieces every command shares (exit statuses, `emit`, argument types) live here; the command
line (correctness.cli) imports the command it runs, and the commands import nothing from it. A
command's module imports at its top only what its arguments need: `correctness --help` and `check
--help` answer without torch; the libraries come in as the command runs.
"""

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

EXIT_OK, EXIT_FAIL, EXIT_BAD_INPUT = 0, 1, 2
EXIT_BROKEN_PIPE = 128 + 13  # 128 + SIGPIPE: the shell's status for a process SIGPIPE ended


def drop_stdout() -> None:
    """Send what stdout still holds, and anything printed later, to /dev/null: its reader is gone.
    (Python ignores SIGPIPE, so a write to a closed pipe raises BrokenPipeError instead; leaving the
    buffer on the broken pipe would raise again when the interpreter flushes it at exit.)"""
    try:
        descriptor = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # a stand-in without a file (a test's capture)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, descriptor)
    finally:
        os.close(devnull)


def table_width(args: argparse.Namespace, indent: int = 2) -> int | None:
    """The width a command's table is cut to (None with --wide: every cell whole)."""
    from correctness.report import TABLE_WIDTH  # imported as it prints: building the parser imports no torch

    return None if getattr(args, "wide", False) else TABLE_WIDTH - indent


def emit(args: argparse.Namespace, lines: Sequence[str], data: Any, wrap: bool = True) -> None:
    """Print the human form, its lines wrapped at LINE_WIDTH (not with --wide, nor where `wrap` is
    false: lines of paths, data such as YAML: prose is wrapped, never data), or with --json the
    machine-readable one. A reader that has gone away (`| head`) is no error: the command's work is
    done, and its exit status stands."""
    from correctness.report import fit_lines

    if getattr(args, "json", False):
        text = json.dumps(data, indent=1, allow_nan=False, default=str)
    else:
        text = "\n".join(lines if getattr(args, "wide", False) or not wrap else fit_lines(lines))
    try:
        print(text, flush=True)
    except BrokenPipeError:
        drop_stdout()


def non_negative_int(text: str) -> int:
    """An argparse type: a count, 0 or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value
