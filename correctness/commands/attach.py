"""Attach lever records to a recipe's correctness.component_tests.

    correctness attach RESULT.json [RESULT.json ...] RECIPE.yaml [--dry-run]

Each record becomes an entry (test, shape, gpu, date, result, detail, note) worded from its
figures; an entry for the same test and GPU is replaced. The rest of the recipe keeps every byte.
A record that contradicts itself, belongs to another model or comes from another lever version is
refused and the recipe left untouched. Exit status: 0 attached, 2 refused or bad input.
"""

from correctness.attach import attach
from correctness.commands import EXIT_OK, emit
from correctness.report import LINE_WIDTH, format_table


def add_arguments(parser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE", help="lever records (JSON), then the recipe (YAML)")
    parser.add_argument("--dry-run", action="store_true", help="check and word the entries, write nothing")


def run(args) -> int:
    if len(args.files) < 2:
        args.parser.error("give at least one record and the recipe")
    *records, recipe = args.files
    done = attach(recipe, records, dry_run=args.dry_run)
    rows = [[item.action + (" (dry run)" if args.dry_run else ""), item.test, item.gpu, item.result] for item in done]
    emit(args, format_table(["action", "test", "gpu", "result"], rows, LINE_WIDTH), {
        "recipe": recipe, "dry_run": args.dry_run,
        "entries": [{"action": i.action, "test": i.test, "gpu": i.gpu, "result": i.result} for i in done],
    })
    return EXIT_OK
