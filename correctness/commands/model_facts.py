"""Write a model's facts from its Hugging Face config.json.

    correctness model-facts CONFIG [--output FACTS.yaml] [--json]

CONFIG is a config.json or a folder holding one; the model's name is that folder's name, which a
recipe's `model:` must match. The facts come from the config's own fields and from its
architecture family's entry in correctness/families.yaml (correctness/model_config.py); they are
what fixtures/models/<name>.yaml holds for the seed models. Without --output they are printed;
with it they are written atomically (an existing file is replaced only once the facts were made;
never the config itself, a read-only file, a device or a folder: correctness.files.output_target).
Printed, they are the YAML the file would hold, every line whole, however long.
`--model-config` (pytest and `correctness run`) takes the config itself or the file written here.

Exit status: 0 written; 2 a config the facts cannot be made from (a missing or contradictory
field, an unknown architecture or layer type, a size over correctness.model_limits' limit: one line
naming it), nothing written.
"""

from pathlib import Path

from correctness.commands import EXIT_OK, emit


def add_arguments(parser) -> None:
    parser.add_argument("config", metavar="CONFIG", help="a Hugging Face config.json, or a folder holding one")
    parser.add_argument("--output", "-o", metavar="FACTS.yaml", help="write the facts here (default: print them)")


def run(args) -> int:
    from correctness.errors import RecipeError
    from correctness.files import write_output
    from correctness.model_config import config_file, facts_from_config, facts_text
    from correctness.models import check_facts

    facts = facts_from_config(args.config)
    check_facts(facts, f"model facts of {args.config}")
    text = facts_text(facts)
    if args.output:
        path = Path(args.output)
        write_output(path, text.encode("utf-8"), f"model facts {path}", [config_file(args.config)], RecipeError)
        emit(args, [f"model facts for {facts['name']} ({facts['family']}) written to {path}"],
             {"model": facts["name"], "family": facts["family"], "output": str(path), "facts": facts})
    else:
        emit(args, text.rstrip("\n").splitlines(), facts, wrap=False)  # YAML, whole: wrapped it would not parse
    return EXIT_OK
