"""`correctness`: the command line. Subcommands live in correctness/commands/.

Exit status: 0 success or a passing verdict; 1 a failing or incomplete verdict; 2 bad input (a
malformed recipe, a missing file, mismatched curves, a wrong option), with exactly one line on
stderr and no traceback. A reader that goes away (`correctness ... --json | head`) is not an error:
what was left to print is dropped, and the command ends with the status of what it did; where the
pipe broke before the command was done, it ends with 141, as a process killed by SIGPIPE reports.
"""

import argparse
import importlib
import sys
from collections.abc import Collection, Sequence

from correctness.commands import EXIT_BAD_INPUT, EXIT_BROKEN_PIPE, EXIT_OK, drop_stdout
from correctness.errors import CorrectnessError

# Each command's module is imported only when it is named: `correctness --help` imports no command's
# libraries (torch among them), and `correctness check ...` only check's.
COMMANDS = {
    "attach": ("correctness.commands.attach", "attach lever records to a recipe's correctness.component_tests"),
    "classify": ("correctness.commands.classify",
                 "class each training argument a tuned recipe changes against its reference"),
    "converge": ("correctness.commands.converge", "check a candidate loss curve against a reference curve"),
    "check": ("correctness.commands.check", "one verdict for a recipe: configuration, component tests, convergence"),
    "run": ("correctness.commands.run", "run a recipe's component tests (pytest underneath) and write their records"),
    "report": ("correctness.commands.report", "write a recipe's records as one self-contained HTML page of figures"),
    "levers": ("correctness.commands.levers",
               "list the suite's levers, their tiers and the numerics arguments each covers"),
    "model-facts": ("correctness.commands.model_facts", "write a model's facts from its Hugging Face config.json"),
    "capture-attention": ("correctness.commands.capture_attention",
                          "capture a trained model's attention inputs for the attention lever's checkpoint cases"),
}


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error: the usage block it prints by default is a second line and
    more; `--help` shows it."""

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: {message} (see {self.prog} --help)\n")


def parser(loaded: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The command line's parser, with the arguments of the commands `loaded` (every command's where
    None); the others are listed by name and summary only, their modules not imported."""
    top = _Parser(
        prog="correctness",
        description="Numerical-correctness evidence for tuned training recipes.",
        epilog="Exit status: 0 success or pass; 1 fail or incomplete; 2 bad input.",
    )
    subcommands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, summary) in COMMANDS.items():
        if loaded is not None and name not in loaded:
            subcommands.add_parser(name, help=summary)
            continue
        module = importlib.import_module(module_name)
        sub = subcommands.add_parser(
            name, help=summary, description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        sub.add_argument("--json", action="store_true", help="print machine-readable JSON instead of a table")
        sub.add_argument("--wide", action="store_true",
                         help="print every table cell whole, however wide (by default tables fit in 120 columns"
                         " and other lines wrap at 160)")
        module.add_arguments(sub)
        sub.set_defaults(run=module.run, parser=sub)
    return top


def _one_line(error: BaseException | str) -> str:
    """An error's text on one line, a character that would not show as itself (a bidirectional
    override in a path, an escape sequence) written as its escape."""
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    return "".join(character if character.isprintable() else ascii(character)[1:-1] for character in text)


def _main(argv: list[str]) -> int:
    passthrough = argv[argv.index("--") + 1 :] if "--" in argv else []  # for `run`: arguments for pytest
    # The top level takes no option but --help: a command is named first, or not at all.
    named = [argv[0]] if argv and argv[0] in COMMANDS else []
    args = parser(named).parse_args(argv[: len(argv) - len(passthrough) - (1 if "--" in argv else 0)])
    if passthrough and args.command != "run":
        args.parser.error("only `correctness run` takes arguments after --")
    args.passthrough = passthrough
    try:
        return args.run(args)
    except CorrectnessError as error:
        print(f"correctness {args.command}: {_one_line(error)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:
        raise
    except OSError as error:
        # A file the library did not word an error for (a folder that cannot be written, a full
        # disk): still the user's file, named in one line.
        where = f"{error.filename}: " if error.filename else ""
        print(f"correctness {args.command}: {_one_line(where + (error.strerror or str(error)))}", file=sys.stderr)
        return EXIT_BAD_INPUT


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; return its exit status (argparse's exits, --help and usage errors, included)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if sys.stdout is None:  # started with its standard output closed (`>&-`): Python makes it None
        if sys.stderr is not None:
            print("correctness: standard output is closed: nothing it prints could be read", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        status = _main(argv)
    except SystemExit as leaving:  # argparse: --help (0) or a usage error (2, one line)
        if isinstance(leaving.code, str):
            print(leaving.code, file=sys.stderr)
        status = EXIT_BAD_INPUT if isinstance(leaving.code, str) else leaving.code or EXIT_OK
    except BrokenPipeError:
        drop_stdout()
        return EXIT_BROKEN_PIPE
    try:
        sys.stdout.flush()
    except BrokenPipeError:  # what was printed last, still in the buffer
        drop_stdout()
    return status


if __name__ == "__main__":
    sys.exit(main())
