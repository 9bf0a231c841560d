"""Reading a training recipe (the OpenRecipes YAML format) and its training arguments.

`load_recipe` reads a recipe as plain data (through correctness.yaml_documents.load_yaml, the one
hardened reader of a user's YAML); `validate_recipe` checks it against
correctness/schema/recipe.schema.json (jsonschema, imported only when used). Editing a recipe
(round-trip reading and atomic writing) is correctness.yaml_documents' job.
"""

import hashlib
import json
import re
import shlex
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any


from correctness.errors import RecipeError
from correctness.files import folder_parts, visible_name
from correctness.results import RecipeRef
from correctness.model_config import name_key
from correctness.model_limits import checked_size
from correctness.yaml_documents import load_yaml, read_yaml_input


def dotted_field(data: Any, dotted: str, owner: str) -> Any:
    """data["a"]["b"] for "a.b"; a missing key is a RecipeError naming `owner` and the field."""
    value = data
    for key in dotted.split("."):
        if not isinstance(value, dict) or key not in value:
            raise RecipeError(f"{owner}: missing field {dotted}")
        value = value[key]
    return value


COMMAND_ENDS = ("|", ";", "&&", "||", "&")
ARRAY_EXPANSION = re.compile(r"\$\{\w+\[[@*]\]\}")


def _train_command(run: str) -> list[str]:
    """The words after train.py in the `run:` script's train.py command, up to the command's end
    (training_arguments says how the command is found); [] where the script has none."""
    for line in run.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True) if "train.py" in line else []
        start = next((i + 1 for i, word in enumerate(words) if word.endswith("train.py")), None)
        if start is not None:
            break
    else:
        return []
    command = words[start:]
    end = next((i for i, word in enumerate(command) if word in COMMAND_ENDS), len(command))
    return command[:end]


def hidden_arguments(run: str) -> tuple[str, ...]:
    """The array expansions (`${MODEL_ARGS[@]}`) in the `run:` script's train.py command: arguments
    the recipe passes without showing them."""
    return tuple(word for word in _train_command(run) if ARRAY_EXPANSION.fullmatch(word))


def training_arguments(run: str) -> dict[str, list[list[str]]]:
    """Parse the `run:` script's train.py command: flag -> one list of values per occurrence.

    Continuation lines are joined, words split as a shell would; a flag takes every following word
    up to the next flag. An array expansion (`"${MODEL_ARGS[@]}"`) ends the flag before it: it
    stands for arguments of its own, which a recipe does not show. The command ends at the end of its line or at a standalone `|`, `;`, `&&`, `||` or `&`.
    """
    arguments: dict[str, list[list[str]]] = {}
    current: list[str] | None = None
    for word in _train_command(run):
        if word.startswith("--"):
            current = []
            arguments.setdefault(word, []).append(current)
        elif ARRAY_EXPANSION.fullmatch(word):
            current = None
        elif current is not None:
            current.append(word)
    return arguments


def script_arguments(run: Any, name: str) -> dict[str, list[list[str]]]:
    """training_arguments of a recipe's `run` field; RecipeError naming recipe `name` where it is no
    script or cannot be split into words."""
    if not isinstance(run, str):
        kind = "list" if isinstance(run, list) else "mapping" if isinstance(run, dict) else type(run).__name__
        raise RecipeError(f"recipe {name}: field run must be a script, got {kind}")
    try:
        return training_arguments(run)
    except ValueError as error:  # shlex: an unbalanced quote
        raise RecipeError(f"recipe {name}: field run cannot be split into words ({error})") from None


@dataclass(frozen=True)
class Recipe:
    """A recipe file, read; the fields the suite uses are properties that fail with the field's name."""

    id: str
    path: Path
    data: dict[str, Any]
    sha256: str

    def field(self, dotted: str) -> Any:
        return dotted_field(self.data, dotted, f"recipe {self.id}")

    def positive_int(self, dotted: str) -> int:
        value = self.field(dotted)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise RecipeError(f"recipe {self.id}: field {dotted} must be a positive integer, got {value!r}")
        return value

    @property
    def model(self) -> str:
        return str(self.field("model"))

    @property
    def gpu(self) -> str:
        return str(self.field("gpu.type"))

    @property
    def tp(self) -> int:
        return self.positive_int("layout.tp")

    @property
    def row_tokens(self) -> int:
        return checked_size(self.field("workload.row_tokens"), "context tokens", f"recipe {self.id}", "workload.row_tokens")

    @property
    def rows_per_microbatch(self) -> int:
        return self.positive_int("layout.rows_per_microbatch")

    @property
    def precision(self) -> str:
        return str(self.field("workload.precision"))

    @cached_property
    def arguments(self) -> dict[str, list[list[str]]]:
        return script_arguments(self.field("run"), self.id)

    def argument(self, flag: str) -> list[str] | None:
        """The values of a training flag's last occurrence ([] for a switch), or None if absent."""
        occurrences = self.arguments.get(flag)
        return occurrences[-1] if occurrences else None

    @property
    def hidden_arguments(self) -> tuple[str, ...]:
        """The array expansions ("${MODEL_ARGS[@]}") whose arguments the train.py command passes unseen."""
        self.arguments  # the script's field errors, in one line
        return hidden_arguments(self.field("run"))

    @cached_property
    def model_argument_checks(self) -> dict[int, tuple[Any, Any]]:
        """correctness.model_arguments.check_model_arguments's results, by the facts' identity."""
        return {}

    @property
    def ref(self) -> RecipeRef:
        return RecipeRef(id=self.id, model=self.model, gpu=self.gpu, sha256=self.sha256, path=str(self.path.resolve()))

    def ref_for(self, model: Any) -> RecipeRef:
        """The recipe's reference with the model facts (correctness.models.ModelFacts) its shapes come
        from, and the run script's model arguments compared with them (RecipeError where one differs)."""
        from correctness.model_arguments import check_model_arguments

        check = check_model_arguments(self, model)
        return replace(self.ref, model_facts=model.source, model_facts_sha256=model.sha256,
                       model_arguments_checked=check.checked, model_arguments_unchecked=check.unchecked)


def validate_recipe(data: Any, name: str) -> None:
    """Raise RecipeError naming the first field of recipe data that does not fit the recipe schema,
    or that its run script contradicts (correctness.recipe_arguments: `layout.tp: 2` with
    --tensor-model-parallel-size 4, a flag given twice with different values). Dates become ISO
    strings first; aliases are expanded there, which load_yaml has bounded."""
    from correctness.recipe_arguments import check_recipe_arguments
    from correctness.schema import first_problem

    try:
        document = json.loads(json.dumps(data, default=str))
        problem = first_problem("recipe.schema.json", document)
    except (RecursionError, ValueError) as error:  # ValueError: a circular reference
        raise RecipeError(f"recipe {name}: cannot be checked against its schema ({type(error).__name__})") from None
    if problem is not None:
        where, message = problem
        raise RecipeError(f"recipe {name}: {where}: {message}")
    check_recipe_arguments(document, script_arguments(document["run"], name), name)


ID_FIELDS = ("model", "gpu.type")  # the fields a recipe's id is built from, with its file name


def _id_name(data: dict[str, Any], field: str, path: Path) -> str:
    try:
        value = dotted_field(data, field, f"recipe {path}")
    except RecipeError as missing:
        raise RecipeError(f"{missing}, which its id (<model>/<gpu>/<file name>) is built from") from None
    if not isinstance(value, str):
        raise RecipeError(f"recipe {path}: field {field} must be a name, got {value!r}")
    return visible_name(value, f"recipe {path}: field {field}", RecipeError)


def recipe_id_of(path: Path, data: dict[str, Any]) -> str:
    """A recipe's id, `<model>/<gpu>/<name>` (<name>: the file's name without .yaml), which names its
    results folder (results/<id>/) and its fixtures (fixtures/claims/<id>.yaml,
    fixtures/references/<id>.yaml).

    A recipe in a `recipes/<model>/<gpu>/` folder whose names are its `model:` and `gpu.type`
    (compared by name_key: the fixtures' tree, an OpenRecipes checkout) takes those folders' names.
    Any other, a file in another model's or GPU's folder included, takes name_key of the two fields
    (`model: Qwen3_32B` on an H100 in my-recipe.yaml: qwen3-32b/h100/my-recipe), so that it never
    takes another model's results folder, claims or references. RecipeError in one line where a
    field is missing or a part cannot name a folder (`...yaml` gives `..`)."""
    fields = tuple(name_key(_id_name(data, field, path)) for field in ID_FIELDS)
    resolved = path.resolve()
    tree_folder, model_folder, gpu_folder = (("",) * 3 + resolved.parts[:-1])[-3:]
    in_tree = tree_folder == "recipes" and (name_key(model_folder), name_key(gpu_folder)) == fields
    parts = (model_folder, gpu_folder, resolved.stem) if in_tree else (*fields, path.stem)
    unsafe = [what for what, part in zip((*ID_FIELDS, "file name"), parts) if folder_parts(part, several=False) is None]
    if unsafe:
        raise RecipeError(f"recipe {path}: its {' and '.join(unsafe)} cannot name a results folder (its id would be"
                          f" {'/'.join(parts)!r})")
    return "/".join(parts)


def load_recipe(path: str | Path) -> Recipe:
    """Read a recipe file; its id is recipe_id_of's (`<model>/<gpu>/<name>`)."""
    path = Path(path)
    raw = read_yaml_input(path, f"recipe {path}")
    data = load_yaml(raw, f"recipe {path}")
    if not isinstance(data, dict):
        raise RecipeError(f"recipe {path}: expected a mapping at the top level")
    return Recipe(id=recipe_id_of(path, data), path=path, data=data, sha256=hashlib.sha256(raw).hexdigest())


def lever_recipe(recipe_id: str, stand_in: Recipe | None = None) -> Recipe:
    """The fixture recipe a component test names, or the user's recipe that runs in its place
    (`--recipe`, `correctness run RECIPE`)."""
    from correctness.fixtures import recipe_path

    return stand_in if stand_in is not None else load_recipe(recipe_path(recipe_id))
