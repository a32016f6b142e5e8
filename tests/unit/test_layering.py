"""Layering: the runner and the planner it reads sit below the engine, so no module of theirs may
import noesis.engine (the planner is checked too: the runner imports it)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import noesis.planner
import noesis.runner

FORBIDDEN = "noesis.engine"


def imported_modules(tree: ast.Module, package: str) -> list[tuple[int, str]]:
    """Every module an import statement names, anywhere in the tree (lazy imports included).

    Relative imports are resolved against `package`; `from noesis import engine` counts as
    importing noesis.engine.
    """
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = resolve(node.module or "", node.level, package)
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def resolve(module: str, level: int, package: str) -> str:
    if level == 0:
        return module
    parent = package.rsplit(".", level - 1)[0] if level > 1 else package
    return f"{parent}.{module}" if module else parent


def forbidden_imports(source: str, package: str) -> list[str]:
    tree = ast.parse(source)
    return [
        f"line {line}: {name}"
        for line, name in imported_modules(tree, package)
        if name == FORBIDDEN or name.startswith(FORBIDDEN + ".")
    ]


@pytest.mark.parametrize("package", [noesis.runner, noesis.planner], ids=lambda p: p.__name__)
def test_modules_below_the_engine_do_not_import_it(package):
    root = Path(package.__file__).parent
    paths = sorted(root.rglob("*.py"))
    assert paths, f"no modules found under {root}"
    offenders = {
        str(path.relative_to(root)): hits
        for path in paths
        if (hits := forbidden_imports(path.read_text(), package.__name__))
    }
    assert not offenders, f"{package.__name__} modules import {FORBIDDEN}: {offenders}"


def test_checker_sees_lazy_relative_and_from_imports():
    """The check itself must catch every spelling, or the test above could never fail."""
    spellings = [
        "import noesis.engine.engine",
        "def f():\n    from noesis.engine.scheduler import StepPlan\n",
        "from noesis import engine",
        "from ..engine import request",
        "from .. import engine",
    ]
    for source in spellings:
        assert forbidden_imports(source, "noesis.runner"), source
    assert not forbidden_imports("from noesis.planner.scheduler import StepPlan", "noesis.runner")
    assert not forbidden_imports("from noesis import engines_extra", "noesis.runner")
