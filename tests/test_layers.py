"""The shared vocabulary sits below the lever kinds: `correctness/shapes.py`, `correctness/heads.py`,
`correctness/megatron/`, `correctness/adam/` and the record (`results.py`) import no lever kind, the
lever kinds are peers (no kind imports another), and the record imports no declaration (`lever.py`
imports `results.py`, never the other way: no circle)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "correctness"
# A lever kind: a package of correctness/ with a lever module: `lever.py` where the kind has one lever,
# `<what>_lever.py` for each where it has several (attention, moe).
KINDS = sorted({path.parent.name for pattern in ("*/lever.py", "*/*_lever.py") for path in PACKAGE.glob(pattern)})
SHARED = [
    PACKAGE / "shapes.py", PACKAGE / "heads.py", PACKAGE / "results.py",
    *sorted((PACKAGE / "megatron").glob("*.py")), *sorted((PACKAGE / "adam").glob("*.py")),
    *(PACKAGE / f"{name}.py" for name in ("lever_spec", "catalogue", "recipe_sets", "lever", "tiers", "rule",
                                          "compare", "harness", "recheck", "recipe_binding", "record_store")),
]
# Recipe integration: a record becomes a recipe's entry, a recipe's arguments are classed and judged.
INTEGRATION = [
    *(PACKAGE / f"{name}.py" for name in ("attach", "entries", "classify", "check", "recipe_verdict", "evidence")),
    *sorted((PACKAGE / "wording").glob("*.py")), *sorted((PACKAGE / "convergence").glob("*.py")),
]
ABOVE_THE_KINDS = ("correctness.registry", "correctness.composites", "correctness.wrong_implementations")


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
    assert {"attention", "optimizer", "adam_precision", "fp8", "rope", "moe"} <= set(KINDS)
    assert not {"adam", "megatron"} & set(KINDS)  # shared packages, not kinds


@pytest.mark.parametrize("kind", KINDS)
def test_no_lever_kind_imports_another(kind):
    """The kinds are peers: what two of them need sits in a shared module, not in one of them."""
    crossed = {
        str(path.relative_to(ROOT)): sorted(kinds_imported(path) - {kind})
        for path in sorted((PACKAGE / kind).rglob("*.py"))
    }
    assert not {path: kinds for path, kinds in crossed.items() if kinds}


@pytest.mark.parametrize("path", SHARED + INTEGRATION, ids=lambda path: str(path.relative_to(ROOT)))
def test_shared_vocabulary_and_recipe_integration_import_no_lever_kind(path):
    assert not kinds_imported(path), f"{path.relative_to(ROOT)} imports {sorted(kinds_imported(path))}"
    above = sorted(module for module in imported_modules(path) if module.startswith(ABOVE_THE_KINDS))
    assert not above, f"{path.relative_to(ROOT)} imports {above}"


def test_the_record_imports_no_declaration():
    assert not {module for module in imported_modules(PACKAGE / "results.py")
                if module == "correctness.lever" or module.startswith("correctness.lever.")}


def test_the_check_sees_a_kind_imported(tmp_path):
    """The check has power: a module importing a kind's module is caught."""
    module = tmp_path / "module.py"
    module.write_text("def f():\n    from correctness.optimizer.paths import TorchAdamW\n")
    assert kinds_imported(module) == {"optimizer"}
