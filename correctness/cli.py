"""`correctness`: the command line. Subcommands live in correctness/commands/.

Exit status: 0 success or a passing verdict; 1 a failing or incomplete verdict; 2 bad input (a
malformed recipe, a missing file, mismatched curves), with a one-line message on stderr.
"""

import argparse
import importlib
import json
import sys
from collections.abc import Sequence
from typing import Any

from correctness.errors import CorrectnessError

COMMANDS = {
    "attach": "attach lever records to a recipe's correctness.component_tests",
    "classify": "class each training argument a tuned recipe changes against its reference",
    "converge": "check a candidate loss curve against a reference curve",
    "check": "one verdict for a recipe: configuration, component tests, convergence",
    "run": "run a recipe's component tests (pytest underneath) and write their records",
    "capture-attention": "capture a trained model's attention inputs for the attention lever's checkpoint cases",
}
EXIT_OK, EXIT_FAIL, EXIT_BAD_INPUT = 0, 1, 2


def emit(args: argparse.Namespace, lines: Sequence[str], data: Any) -> None:
    """Print the human form, or with --json the machine-readable one."""
    if getattr(args, "json", False):
        print(json.dumps(data, indent=1, allow_nan=False, default=str))
    else:
        print("\n".join(lines))


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="correctness",
        description="Numerical-correctness evidence for tuned training recipes.",
        epilog="Exit status: 0 success or pass; 1 fail or incomplete; 2 bad input.",
    )
    subcommands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, summary in COMMANDS.items():
        module = importlib.import_module(f"correctness.commands.{name.replace('-', '_')}")
        sub = subcommands.add_parser(
            name, help=summary, description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        sub.add_argument("--json", action="store_true", help="print machine-readable JSON instead of a table")
        module.add_arguments(sub)
        sub.set_defaults(run=module.run, parser=sub)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough = argv[argv.index("--") + 1 :] if "--" in argv else []  # for `run`: arguments for pytest
    args = parser().parse_args(argv[: len(argv) - len(passthrough) - (1 if "--" in argv else 0)])
    if passthrough and args.command != "run":
        args.parser.error("only `correctness run` takes arguments after --")
    args.passthrough = passthrough
    try:
        return args.run(args)
    except CorrectnessError as error:
        print(f"correctness {args.command}: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
