"""The shared vocabulary sits below the lever kinds: `correctness/shapes.py`, `correctness/megatron/`
and the record (`results.py`) import no lever kind, and the record imports no declaration
(`lever.py` imports `results.py`, never the other way: no circle)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "correctness"
KINDS = sorted(path.parent.name for path in PACKAGE.glob("*/lever.py"))
SHARED = [PACKAGE / "shapes.py", PACKAGE / "results.py", *sorted((PACKAGE / "megatron").glob("*.py"))]


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at its top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def kinds_imported(path: Path) -> set[str]:
    return {kind for kind in KINDS for module in imported_modules(path)
            if module == f"correctness.{kind}" or module.startswith(f"correctness.{kind}.")}


def test_the_lever_kinds_are_found():
    assert {"attention", "optimizer", "fp8", "rope"} <= set(KINDS)


@pytest.mark.parametrize("path", SHARED, ids=lambda path: str(path.relative_to(ROOT)))
def test_shared_vocabulary_imports_no_lever_kind(path):
    assert not kinds_imported(path), f"{path.relative_to(ROOT)} imports {sorted(kinds_imported(path))}"


def test_the_record_imports_no_declaration():
    assert not {module for module in imported_modules(PACKAGE / "results.py")
                if module == "correctness.lever" or module.startswith("correctness.lever.")}


def test_the_check_sees_a_kind_imported(tmp_path):
    """The check has power: a module importing a kind's module is caught."""
    module = tmp_path / "module.py"
    module.write_text("def f():\n    from correctness.optimizer.paths import fused_adam_arithmetic\n")
    assert kinds_imported(module) == {"optimizer"}
