"""Reading and editing a training recipe (the OpenRecipes YAML format) and its training arguments.

`load_recipe` reads a recipe as plain data (PyYAML, which every training image has). Editing goes
through ruamel.yaml's round-trip mode (`load_document`, `write_recipe`): writing back a recipe that
was not changed gives the same bytes (comments, key order, quoting, block scalars, a UTF-8 byte
order mark), and a changed one differs only where it was changed; writes are atomic and go through
a symlink to its target. `validate_recipe` checks a recipe against
correctness/schema/recipe.schema.json. ruamel.yaml and jsonschema are imported only when used.

`load_yaml` is the one reader of a user's YAML (recipes, references): a file of at most 1 MiB
(`read_yaml_input`), then refused in one line where a key repeats in a mapping (PyYAML
would keep the last silently), where aliases would expand to more than EXPANSION_PER_BYTE nodes per
byte of the file (a 342-byte "billion laughs" file expands to 10^9 values in any consumer that
walks it, such as the schema check), where an alias refers to itself, or where values nest deeper
than MAX_DEPTH (PyYAML's composer and every consumer recurse once per level).
"""

import hashlib
import io
import json
import re
import shlex
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml

from correctness.errors import CorrectnessError, RecipeError
from correctness.files import YAML_LIMIT, folder_parts, read_input, replace_file, write_target
from correctness.results import RecipeRef
from correctness.model_config import name_key
from correctness.model_limits import checked_size


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


UTF8_BOM = b"\xef\xbb\xbf"


def _decoded(raw: bytes, label: str) -> str:
    """UTF-8 text without its byte order mark (write_recipe puts a file's mark back)."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise RecipeError(f"{label}: not UTF-8 text") from None


DUPLICATE_KEY = re.compile(r'found duplicate key "(.*)" with value', re.DOTALL)


def load_document(path: str | Path) -> Any:
    """The recipe as an editable round-trip document (ruamel.yaml), for write_recipe. Call
    load_recipe first where the file is untrusted: it bounds aliases, which this does not."""
    from ruamel.yaml.constructor import DuplicateKeyError
    from ruamel.yaml.error import YAMLError

    path = Path(path)
    label = f"recipe {path}"
    text = _decoded(read_yaml_input(path, label), label)
    try:
        return _round_trip().load(text)
    except RecursionError:
        raise RecipeError(f"{label}: nested too deeply to read (more than {MAX_DEPTH} levels)") from None
    except DuplicateKeyError as error:
        key = DUPLICATE_KEY.search(str(error.problem))
        raise RecipeError(f"{label}: duplicate key {key.group(1) if key else ''!r} at line "
                          f"{error.problem_mark.line + 1}") from None
    except YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        raise RecipeError(f"{label}: malformed YAML{f' at line {mark.line + 1}' if mark else ''}") from None


def recipe_text(data: Any) -> str:
    """The YAML text of a document from load_document (unchanged document: the same bytes)."""
    out = io.StringIO()
    _round_trip().dump(data, out)
    return out.getvalue()


def _starts_with_bom(path: Path) -> bool:
    try:
        with open(write_target(path), "rb") as existing:
            return existing.read(len(UTF8_BOM)) == UTF8_BOM
    except OSError:
        return False


def write_recipe(path: str | Path, data: Any) -> None:
    """Replace the recipe file atomically (correctness.files.replace_file: through a symlink, keeping
    its mode, one line on failure), keeping its UTF-8 byte order mark where it had one."""
    path = Path(path)
    text = recipe_text(data).encode("utf-8")
    replace_file(path, (UTF8_BOM if _starts_with_bom(path) else b"") + text, f"recipe {path}", RecipeError)


def validate_recipe(data: Any, name: str) -> None:
    """Raise RecipeError naming the first field of recipe data that does not fit the recipe schema.
    Dates become ISO strings first; aliases are expanded there, which load_yaml has bounded."""
    from correctness.schema import first_problem

    try:
        document = json.loads(json.dumps(data, default=str))
        problem = first_problem("recipe.schema.json", document)
    except (RecursionError, ValueError) as error:  # ValueError: a circular reference
        raise RecipeError(f"recipe {name}: cannot be checked against its schema ({type(error).__name__})") from None
    if problem is not None:
        where, message = problem
        raise RecipeError(f"recipe {name}: {where}: {message}")


# load_yaml's limits (see the module's docstring).
EXPANSION_PER_BYTE = 10  # nodes per byte of the file, aliases expanded; YAML without aliases has about one
EXPANSION_FLOOR = 10_000  # nodes: what any small file may expand to
MAX_DEPTH = 64  # levels of nesting; the recipes use five


class Refused(yaml.YAMLError):
    """A well-formed file load_yaml will not read; its message says why."""


class _Loader(yaml.SafeLoader):
    """SafeLoader that refuses a repeated key, and checks aliases and depth before constructing."""

    expansion_limit = EXPANSION_FLOOR

    def construct_mapping(self, node, deep=False):
        first: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base` merges, and keys after it may override what it brings
            key, line = self.construct_object(key_node, deep=deep), key_node.start_mark.line + 1
            try:
                if key in first:
                    raise Refused(f"duplicate key {key!r} at line {line} (first at line {first[key]})")
                first[key] = line
            except TypeError:
                continue  # an unhashable key: PyYAML refuses it itself
        return super().construct_mapping(node, deep=deep)

    def get_single_data(self):
        node = self.get_single_node()
        if node is None:
            return None
        check_expansion(node_expansion(node, self.expansion_limit), self.expansion_limit)
        return self.construct_document(node)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


@dataclass(frozen=True)
class Expansion:
    nodes: int  # with every alias expanded, capped at the limit plus one
    depth: int
    recursive: bool  # an alias inside the value it names: infinite


def node_expansion(root: yaml.Node, limit: int) -> Expansion:
    """Size and depth of a composed document with its aliases expanded, without expanding them: each
    distinct node is visited once (an alias is the same node object as its anchor), so the work is
    bounded by the file. Iterative, so that depth cannot exhaust Python's stack."""
    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            on_path.discard(key)
            children = _children(node)
            size[key] = min(limit + 1, 1 + sum(size[id(child)] for child in children))
            depth[key] = 1 + max((depth[id(child)] for child in children), default=0)
            continue
        if key in size:
            continue
        if key in on_path:
            return Expansion(nodes=limit + 1, depth=0, recursive=True)
        on_path.add(key)
        stack.append((node, True))
        for child in _children(node):
            if id(child) in on_path:
                return Expansion(nodes=limit + 1, depth=0, recursive=True)
            if id(child) not in size:
                stack.append((child, False))
    return Expansion(nodes=size[id(root)], depth=depth[id(root)], recursive=False)


def check_expansion(expansion: Expansion, limit: int) -> None:
    if expansion.recursive:
        raise Refused("an alias refers to a value that contains it (it would expand forever)")
    if expansion.nodes > limit:
        raise Refused(f"its aliases expand to more than {limit:,} values ({EXPANSION_PER_BYTE} per byte of the"
                      f" file, at least {EXPANSION_FLOOR:,}); write the repeated values out or use fewer aliases")
    if expansion.depth > MAX_DEPTH:
        raise Refused(f"nested {expansion.depth} levels deep, more than the {MAX_DEPTH} this suite reads")


def read_yaml_input(path: Path, label: str) -> bytes:
    """A YAML file's bytes: a regular file of at most YAML_LIMIT (see correctness.files)."""
    return read_input(path, label, RecipeError, limit=YAML_LIMIT, kind="a YAML file")


def load_yaml(raw: bytes, label: str, error: type[CorrectnessError] = RecipeError) -> Any:
    """A user's YAML file as plain data, or `error` in one line naming `label` (see the module's
    docstring for what is refused and why). Nothing is constructed before the checks pass."""
    loader = _Loader(raw)
    loader.expansion_limit = max(EXPANSION_FLOOR, EXPANSION_PER_BYTE * len(raw))
    try:
        return loader.get_single_data()
    except Refused as refusal:
        raise error(f"{label}: {refusal}") from None
    except RecursionError:
        raise error(f"{label}: nested too deeply to read (more than {MAX_DEPTH} levels)") from None
    except yaml.reader.ReaderError:
        raise error(f"{label}: not UTF-8 text, or holds a control character YAML does not allow") from None
    except yaml.YAMLError as failure:
        mark = getattr(failure, "problem_mark", None)
        raise error(f"{label}: malformed YAML{f' at line {mark.line + 1}' if mark else ''}") from None
    finally:
        loader.dispose()


ID_FIELDS = ("model", "gpu.type")  # the fields a recipe's id is built from, with its file name


def _id_name(data: dict[str, Any], field: str, path: Path) -> str:
    try:
        value = dotted_field(data, field, f"recipe {path}")
    except RecipeError as missing:
        raise RecipeError(f"{missing}, which its id (<model>/<gpu>/<file name>) is built from") from None
    if not isinstance(value, str):
        raise RecipeError(f"recipe {path}: field {field} must be a name, got {value!r}")
    return value


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
