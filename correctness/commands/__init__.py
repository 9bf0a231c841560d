"""The command line's subcommands, one module each: `add_arguments(parser)` and `run(args) -> int`.

Each is a thin face over the library: it parses, calls, and prints a table (or JSON with --json).
Exit status: 0 success (or a passing verdict), 1 a failing verdict, 2 bad input or usage.
"""
