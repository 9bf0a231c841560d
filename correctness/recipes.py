"""Reading a training recipe (the OpenRecipes YAML format) and its training arguments."""

import hashlib
import re
import shlex
from dataclasses import dataclass
from functools import cached_property
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
            raise RecipeError(f"recipe {self.id}: field run must be a script, got {type(run).__name__}")
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
