"""A user's YAML files: the one hardened reader, and round-trip editing.

`load_yaml` is the one reader of a user's YAML (recipes, references, model facts): a file of at most
1 MiB (`read_yaml_input`), then refused in one line where a key repeats in a mapping (PyYAML
would keep the last silently), where aliases would expand to more than EXPANSION_PER_BYTE nodes per
byte of the file (a 342-byte "billion laughs" file expands to 10^9 values in any consumer that
walks it, such as the schema check), where an alias refers to itself, or where values nest deeper
than MAX_DEPTH (PyYAML's composer and every consumer recurse once per level).

Editing goes through ruamel.yaml's round-trip mode (`load_document`, `write_recipe`): writing back a
recipe that was not changed gives the same bytes (comments, key order, quoting, block scalars, a
UTF-8 byte order mark), and a changed one differs only where it was changed; writes are atomic and
go through a symlink to its target. ruamel.yaml is imported only when used.
"""

import copy
import functools
import io
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from correctness.errors import CorrectnessError, RecipeError
from correctness.files import YAML_LIMIT, read_input, replace_file, write_target


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
    docstring for what is refused and why). Nothing is constructed before the checks pass. A file's
    bytes are parsed once per process (a collection builds each lever from the same model facts,
    about 200 reads): each caller gets its own copy of the data."""
    try:
        return copy.deepcopy(_parsed(raw))
    except Refused as refusal:
        raise error(f"{label}: {refusal}") from None
    except RecursionError:
        raise error(f"{label}: nested too deeply to read (more than {MAX_DEPTH} levels)") from None
    except yaml.reader.ReaderError:
        raise error(f"{label}: not UTF-8 text, or holds a control character YAML does not allow") from None
    except yaml.YAMLError as failure:
        mark = getattr(failure, "problem_mark", None)
        raise error(f"{label}: malformed YAML{f' at line {mark.line + 1}' if mark else ''}") from None


@functools.lru_cache(maxsize=64)
def _parsed(raw: bytes) -> Any:
    """The data of a YAML file's bytes (cached: never handed out, only copies of it); raises what
    the loader raises (a failure is not cached)."""
    loader = _Loader(raw)
    loader.expansion_limit = max(EXPANSION_FLOOR, EXPANSION_PER_BYTE * len(raw))
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


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
