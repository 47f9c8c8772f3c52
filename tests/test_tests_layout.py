"""The tests are laid out like the code: helpers shared by several test modules live in
tests/support (fixtures in a conftest.py), so no test module imports another one."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

pytestmark = pytest.mark.unit


def _imported_modules(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_no_test_module_imports_another() -> None:
    reaches = [
        f"{path.relative_to(TESTS.parent)} imports {module}"
        for path in sorted(TESTS.rglob("*.py"))
        for module in sorted(_imported_modules(path))
        if module.startswith("tests.") and module.rpartition(".")[2].startswith("test_")
    ]
    assert reaches == []


def test_no_module_imports_a_conftest() -> None:
    """A conftest.py holds fixtures and hooks (pytest loads it); what tests share besides is
    in tests/support, so importing a conftest never runs its hooks a second time."""
    reaches = [
        f"{path.relative_to(TESTS.parent)} imports {module}"
        for path in sorted(TESTS.rglob("*.py"))
        for module in sorted(_imported_modules(path))
        if module.startswith("tests.") and "conftest" in module.split(".")
    ]
    assert reaches == []
