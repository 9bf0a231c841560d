"""One verdict for a recipe: configuration, component tests, convergence.

    correctness check RECIPE.yaml [--reference REFERENCE.yaml] [--model-config CONFIG] [--json]

Validates the recipe against the schema, classes its changed training arguments against its
reference (as `correctness classify`; without a reference, its numerics arguments against
Megatron's defaults, as `correctness run` judges them, and the configuration stays incomplete),
lists the component test each numerics change needs and whether a result run on the recipe's GPU
is attached and passing (a CPU tier's result is shown beside it as CPU evidence, never counted for
the recipe's GPU; a format-limited result counts only with a passing convergence block), and reads
the convergence block. Exit status: 0 everything passes; 1 something fails or is missing; 2 bad input, a recipe
whose model has no model facts included (no verdict without them: see correctness.check.check_recipe).
"""

from correctness.commands import EXIT_FAIL, EXIT_OK, emit, table_width


def add_arguments(parser) -> None:
    parser.add_argument("recipe", metavar="RECIPE.yaml")
    parser.add_argument("--reference", metavar="REFERENCE.yaml",
                        help="the reference's run script (default: fixtures/references/<recipe id>.yaml)")
    parser.add_argument("--model-config", metavar="CONFIG",
                        help="the model's Hugging Face config.json or facts file, for a model the suite has no facts of")


def run(args) -> int:
    from correctness.check import PASS, check_recipe
    from correctness.report import format_table

    result = check_recipe(args.recipe, args.reference, args.model_config)
    claimed = f" (the recipe says {result.claimed})" if result.claimed and result.claimed != result.verdict else ""
    lines = [f"check {result.recipe}: {result.verdict.upper()}{claimed}"]
    rows = [[finding.part, finding.status, finding.detail] for finding in result.findings]
    lines += ["  " + line for line in format_table(["part", "status", "detail"], rows, table_width(args))]
    emit(args, lines, result.to_dict())
    return EXIT_OK if result.verdict == PASS else EXIT_FAIL
