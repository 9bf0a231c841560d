"""references/ is plain FP64 code: every module imports only torch and the standard library, never
the code it checks (correctness/) or anything else."""

import ast
import sys
from pathlib import Path

import pytest

REFERENCES = sorted((Path(__file__).resolve().parent.parent / "references").glob("*.py"))
ALLOWED = {"torch"} | set(sys.stdlib_module_names)


def imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}: relative import from {node.module!r}"
            modules.add(node.module.split(".")[0])
    return modules


@pytest.mark.parametrize("path", REFERENCES, ids=lambda path: path.name)
def test_reference_imports_only_torch_and_the_standard_library(path):
    assert imported_modules(path) <= ALLOWED, imported_modules(path) - ALLOWED


def test_there_are_references_to_check():
    assert {path.name for path in REFERENCES} >= {"attention.py", "adamw.py"}
