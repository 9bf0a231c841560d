"""Reading and editing a training recipe (the OpenRecipes YAML format) and its training arguments.

`load_recipe` reads a recipe as plain data (PyYAML, which every training image has). Editing goes
through ruamel.yaml's round-trip mode (`load_document`, `write_recipe`): writing back a recipe that
was not changed gives the same bytes (comments, key order, quoting, block scalars), and a changed
one differs only where it was changed; writes are atomic. `validate_recipe` checks a recipe against
correctness/schema/recipe.schema.json. ruamel.yaml and jsonschema are imported only when used.
"""

import hashlib
import io
import json
import os
import re
import shlex
from dataclasses import dataclass
from functools import cache, cached_property
from importlib import resources
from pathlib import Path as FilePath
from typing import Any

import yaml

from correctness.errors import RecipeError
from correctness.fixtures import RECIPES_DIR
from correctness.lever import RecipeRef


def _field(data: Any, dotted: str, source: str) -> Any:
    value = data
    for key in dotted.split("."):
        if not isinstance(value, dict) or key not in value:
            raise RecipeError(f"recipe {source}: missing field {dotted}")
        value = value[key]
    return value


COMMAND_ENDS = ("|", ";", "&&", "||", "&")
ARRAY_EXPANSION = re.compile(r"\$\{\w+\[[@*]\]\}")


def training_arguments(run: str) -> dict[str, list[list[str]]]:
    """Parse the `run:` script's train.py command: flag -> one list of values per occurrence.

    Continuation lines are joined, words split as a shell would; a flag takes every following word
    up to the next flag. An array expansion (`"${MODEL_ARGS[@]}"`) ends the flag before it: it
    stands for arguments of its own, which a recipe does not show. The command ends at the end of its line or at a standalone `|`, `;`, `&&`, `||` or `&`.
    """
    for line in run.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True) if "train.py" in line else []
        start = next((i + 1 for i, word in enumerate(words) if word.endswith("train.py")), None)
        if start is not None:
            break
    else:
        return {}
    arguments: dict[str, list[list[str]]] = {}
    current: list[str] | None = None
    for word in words[start:]:
        if word in COMMAND_ENDS:
            break
        if word.startswith("--"):
            current = []
            arguments.setdefault(word, []).append(current)
        elif ARRAY_EXPANSION.fullmatch(word):
            current = None
        elif current is not None:
            current.append(word)
    return arguments


@dataclass(frozen=True)
class Recipe:
    """A recipe file, read; the fields the suite uses are properties that fail with the field's name."""

    id: str
    path: FilePath
    data: dict[str, Any]
    sha256: str

    def field(self, dotted: str) -> Any:
        return _field(self.data, dotted, self.id)

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
        return self.positive_int("workload.row_tokens")

    @property
    def rows_per_microbatch(self) -> int:
        return self.positive_int("layout.rows_per_microbatch")

    @property
    def precision(self) -> str:
        return str(self.field("workload.precision"))

    @cached_property
    def arguments(self) -> dict[str, list[list[str]]]:
        run = self.field("run")
        if not isinstance(run, str):
            kind = "list" if isinstance(run, list) else "mapping" if isinstance(run, dict) else type(run).__name__
            raise RecipeError(f"recipe {self.id}: field run must be a script, got {kind}")
        try:
            return training_arguments(run)
        except ValueError as error:  # shlex: an unbalanced quote
            raise RecipeError(f"recipe {self.id}: field run cannot be split into words ({error})") from None

    def argument(self, flag: str) -> list[str] | None:
        """The values of a training flag's last occurrence ([] for a switch), or None if absent."""
        occurrences = self.arguments.get(flag)
        return occurrences[-1] if occurrences else None

    @property
    def ref(self) -> RecipeRef:
        return RecipeRef(id=self.id, model=self.model, gpu=self.gpu, sha256=self.sha256)


def _round_trip():
    from ruamel.yaml import YAML

    round_trip = YAML()
    round_trip.preserve_quotes = True
    round_trip.width = 4096  # never re-wrap a long line
    round_trip.indent(mapping=2, sequence=2, offset=0)  # the recipes' layout: "- " level with the key
    round_trip.representer.add_representer(
        type(None), lambda representer, _: representer.represent_scalar("tag:yaml.org,2002:null", "null")
    )
    return round_trip


def load_document(path: str | FilePath) -> Any:
    """The recipe as an editable round-trip document (ruamel.yaml), for write_recipe."""
    from ruamel.yaml.error import YAMLError

    path = FilePath(path)
    try:
        return _round_trip().load(path.read_text())
    except OSError as error:
        raise RecipeError(f"recipe {path}: cannot be read ({error.strerror})") from None
    except UnicodeDecodeError:
        raise RecipeError(f"recipe {path}: not UTF-8 text") from None
    except YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        raise RecipeError(f"recipe {path}: malformed YAML{f' at line {mark.line + 1}' if mark else ''}") from None


def recipe_text(data: Any) -> str:
    """The YAML text of a document from load_document (unchanged document: the same bytes)."""
    out = io.StringIO()
    _round_trip().dump(data, out)
    return out.getvalue()


def write_recipe(path: str | FilePath, data: Any) -> None:
    """Replace the recipe file atomically (a temporary file beside it, then a rename), keeping its mode."""
    path = FilePath(path)
    text = recipe_text(data)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(text)
        if path.exists():
            os.chmod(temporary, path.stat().st_mode & 0o7777)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


@cache
def recipe_schema() -> dict[str, Any]:
    return json.loads(resources.files("correctness.schema").joinpath("recipe.schema.json").read_text())


def validate_recipe(data: Any, name: str) -> None:
    """Raise RecipeError naming the first field of recipe data that does not fit the recipe schema."""
    import jsonschema

    document = json.loads(json.dumps(data, default=str))  # dates as ISO strings
    validator = jsonschema.Draft202012Validator(recipe_schema(), format_checker=jsonschema.FormatChecker())
    error = jsonschema.exceptions.best_match(validator.iter_errors(document))
    if error is not None:
        where = ".".join(str(part) for part in error.absolute_path) or "(top level)"
        raise RecipeError(f"recipe {name}: {where}: {error.message}")


def load_recipe(path: str | FilePath) -> Recipe:
    """Read a recipe file. Its id is its path below fixtures/recipes (without .yaml) when it lies
    there, else its file name without .yaml."""
    path = FilePath(path)
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise RecipeError(f"recipe {path}: cannot be read ({error.strerror})") from None
    try:
        data = yaml.safe_load(raw)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise RecipeError(f"recipe {path}: malformed YAML{where}") from None
    if not isinstance(data, dict):
        raise RecipeError(f"recipe {path}: expected a mapping at the top level")
    resolved = path.resolve()
    recipe_id = (
        str(resolved.relative_to(RECIPES_DIR).with_suffix(""))
        if resolved.is_relative_to(RECIPES_DIR)
        else path.stem
    )
    return Recipe(id=recipe_id, path=path, data=data, sha256=hashlib.sha256(raw).hexdigest())


def lever_recipe(recipe_id: str, stand_in: Recipe | None = None) -> Recipe:
    """The fixture recipe a lever module names, or a user's recipe standing in for it where both are
    for the same model and GPU (`correctness run RECIPE`: shapes then come from the user's file)."""
    from correctness.fixtures import recipe_path

    fixture = load_recipe(recipe_path(recipe_id))
    if stand_in is not None and (stand_in.model, stand_in.gpu) == (fixture.model, fixture.gpu):
        return stand_in
    return fixture
