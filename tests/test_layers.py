"""The package's structure: layers that import only downwards, no import cycle, no reach
into another module's private names.

The layer order is the import contract in ``pyproject.toml`` (``[tool.importlinter]``), checked
here so that CI fails on an arrow pointing up. Cycles and private names are measured on the
source itself, every import counted: at module level, inside functions, and the type-only ones
under ``if TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hermes_store"

pytestmark = pytest.mark.unit


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def is_module(name: str) -> bool:
    return name in MODULES


def imports_of(name: str) -> Iterator[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every import of package code."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("hermes_store"):
                    yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            if not source.startswith("hermes_store"):
                continue
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if is_module(submodule):
                    yield submodule, None, node.lineno
                else:
                    yield source, alias.name, node.lineno


def graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {name: set() for name in MODULES}
    for name in MODULES:
        for target, _, _ in imports_of(name):
            # Importing a.b.c runs a and a.b first: only the module itself is an edge, as a
            # package face that lazily names its submodules does not import them.
            if target in MODULES and target != name:
                edges[name].add(target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in edges[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_type_only_imports_included() -> None:
    assert cycles(graph()) == []


def private_names_defined() -> dict[str, str]:
    """``_name`` -> the module that defines it (module level or in a class body)."""
    owners: dict[str, str] = {}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        bodies = [tree.body] + [n.body for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
        for body in bodies:
            for node in body:
                targets: list[str] = []
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    targets = [node.name]
                elif isinstance(node, ast.Assign):
                    targets = [t.id for t in node.targets if isinstance(t, ast.Name)]
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    targets = [node.target.id]
                for target in targets:
                    if target.startswith("_") and not target.startswith("__"):
                        owners.setdefault(target, name)
    return owners


def test_no_module_uses_another_modules_private_names() -> None:
    owners = private_names_defined()
    reaches: list[str] = []
    for name, path in MODULES.items():
        mine = {n for n, owner in owners.items() if owner == name}
        for target, imported, line in imports_of(name):
            if imported and imported.startswith("_") and not imported.startswith("__"):
                reaches.append(f"{name}:{line} imports {target}.{imported}")
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            attr = node.attr
            if not attr.startswith("_") or attr.startswith("__") or attr in mine:
                continue
            owner = owners.get(attr)
            if owner is None:
                continue  # not one of ours: a library's (SQLAlchemy, namedtuple's _replace ...)
            receiver = node.value
            if isinstance(receiver, ast.Name) and receiver.id in {"self", "cls"}:
                continue
            reaches.append(f"{name}:{node.lineno} uses {owner}'s {attr}")
    assert reaches == []


def test_layer_contract_holds() -> None:
    """``lint-imports`` with the contract in pyproject.toml: no layer imports one above it.

    In its own interpreter: import-linter reconfigures logging in the process that runs it.
    """
    check = (
        "from importlinter.cli import lint_imports; "
        f"raise SystemExit(lint_imports(config_filename={str(ROOT / 'pyproject.toml')!r}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
