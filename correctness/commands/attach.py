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

from pathlib import Path

from correctness.attach import attach, recipe_records
from correctness.commands import EXIT_OK, emit
from correctness.commands.run import default_results
from correctness.report import LINE_WIDTH, format_table


def add_arguments(parser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE",
                        help="lever records (JSON), then the recipe (YAML); the recipe alone takes its own records")
    parser.add_argument("--results-dir", help="where the recipe's own records are looked for (default: as `correctness run`)")
    parser.add_argument("--dry-run", action="store_true", help="check and word the entries, write nothing")


def run(args) -> int:
    *records, recipe = args.files
    if not records:
        records = recipe_records(recipe, Path(args.results_dir) if args.results_dir else default_results())
    done = attach(recipe, records, dry_run=args.dry_run)
    rows = [[item.action + (" (dry run)" if args.dry_run else ""), item.test, item.gpu, item.result] for item in done]
    emit(args, format_table(["action", "test", "gpu", "result"], rows, LINE_WIDTH), {
        "recipe": recipe, "dry_run": args.dry_run,
        "entries": [{"action": i.action, "test": i.test, "gpu": i.gpu, "result": i.result} for i in done],
    })
    return EXIT_OK
