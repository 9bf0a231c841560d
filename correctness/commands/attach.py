"""Attach lever records to a recipe's correctness.component_tests.

    correctness attach [RESULT.json ...] RECIPE.yaml [--results-dir DIR] [--dry-run]

Without records, the recipe's own records are taken: every record in its folder of the results
folder (correctness.results.records_folder: its id and a short hash of its path), from any current
folder; a record of an interrupted run is left out.

Each record becomes an entry (test, shape, gpu, date, result, detail, note) worded from its
figures; an entry for the same test and GPU is replaced. The rest of the recipe keeps every byte.
A record that contradicts itself (a figure, flag or verdict its measurements do not give),
belongs to another model, ran with other values of the recipe arguments its lever reads, or comes
from another lever version is refused and the recipe left untouched. Exit status: 0 attached, 2 refused or bad input.
"""

from collections.abc import Sequence
from pathlib import Path

from correctness.attach import Attached, attach, recipe_records
from correctness.commands import EXIT_OK, emit, table_width
from correctness.commands.run import default_results
from correctness.report import clip_middle, format_table

HEADER = ("action", "test", "gpu", "result")
TEST_ROOM = 16  # the fewest characters of a test's name the table keeps, however wide the other cells


def add_arguments(parser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE",
                        help="lever records (JSON), then the recipe (YAML); the recipe alone takes its own records")
    parser.add_argument("--results-dir", help="where the recipe's own records are looked for (default: as `correctness run`)")
    parser.add_argument("--dry-run", action="store_true", help="check and word the entries, write nothing")


def entry_table(done: Sequence[Attached], dry_run: bool, width: int | None) -> list[str]:
    """The entries written, one row each, within `width` (None: every cell whole): a long test name
    is cut in the middle (its lever and its tier stay), so that its GPU and result still show."""
    rows = [[item.action + (" (dry run)" if dry_run else ""), item.test, item.gpu, item.result] for item in done]
    if width is not None and rows:
        others = sum(max(len(row[column]) for row in [list(HEADER), *rows]) + 2 for column in (0, 2, 3))
        room = max(width - others, TEST_ROOM)
        rows = [[action, clip_middle(test, room), gpu, result] for action, test, gpu, result in rows]
    return format_table(HEADER, rows, width)


def run(args) -> int:
    *records, recipe = args.files
    if not records:
        records = recipe_records(recipe, Path(args.results_dir) if args.results_dir else default_results())
    done = attach(recipe, records, dry_run=args.dry_run)
    emit(args, entry_table(done, args.dry_run, table_width(args, indent=0)), {
        "recipe": recipe, "dry_run": args.dry_run,
        "entries": [{"action": i.action, "test": i.test, "gpu": i.gpu, "result": i.result} for i in done],
    })
    return EXIT_OK
