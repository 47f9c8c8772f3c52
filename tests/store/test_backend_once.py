"""The backend is chosen once, when a store opens: no method, unit or searcher asks for the
dialect again, and the search query parser is plain text.

Read from the source with ``ast``: every function of the store, its repositories and its
searchers that touches ``.dialect`` or ``is_sqlite`` is listed in :data:`ASKS_THE_DIALECT`
with the reason, and an entry that no longer matches fails too, so the list stays exact.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from hermes_store import SessionDB
from hermes_store.repo import dialects
from hermes_store.repo.postgresql import PostgresqlStatements
from hermes_store.repo.sqlite import SqliteStatements
from hermes_store.search import pipeline

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parents[2] / "hermes_store"
#: The modules whose behaviour may differ per backend.
SCANNED = [
    PACKAGE / "store.py",
    *sorted((PACKAGE / "repo").glob("*.py")),
    *sorted((PACKAGE / "search").glob("*.py")),
]
BACKENDS = ("sqlite", "postgresql")
#: (file under hermes_store/, function) -> why it may look at the dialect.
ASKS_THE_DIALECT = {
    ("store.py", "SessionDB.__init__"): "the one choice: the backend's statements and searcher",
    ("store.py", "SessionDB._make_uow"): "opening: a server's pool is emptied after the check",
    ("repo/dialects.py", "for_dialect"): "the lookup itself",
    ("repo/sqlite.py", "_compiled"): "compiles the hot writes for SQLite (a constant dialect)",
    ("repo/postgresql.py", "PostgresqlStatements.__init__"): "whether exports stream: once",
    ("repo/pgstream.py", "supported"): "asked once per store, and by the import's batches",
    ("repo/pgstream.py", "_export_statements"): "compiles its statements for the connection",
    ("repo/pgstream.py", "iter_export"): "the driver's error class, to wrap its errors",
    ("search/pipeline.py", "for_dialect"): "the lookup itself",
    ("repo/pgstream.py", "copy_rows"): "quotes identifiers the dialect's way; the driver's errors",
}


def _uses(path: Path) -> Iterator[tuple[str, str]]:
    """(file, function) for every question about the backend in ``path``; a function nested
    in another (a unit) counts as the outermost one, a method as ``Class.method``."""
    relative = path.relative_to(PACKAGE).as_posix()

    def visit(node: ast.AST, scope: tuple[str, ...]) -> Iterator[tuple[str, str]]:
        for child in ast.iter_child_nodes(node):
            inner = scope
            if isinstance(child, ast.ClassDef) and not scope:
                inner = (child.name,)
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                top = not scope or (len(scope) == 1 and scope[0][:1].isupper())
                inner = (*scope, child.name) if top else scope
            elif _asks(child):
                yield relative, ".".join(scope) or "<module>"
            yield from visit(child, inner)

    yield from visit(ast.parse(path.read_text(encoding="utf-8")), ())


def _asks(node: ast.AST) -> bool:
    """``x.dialect``, ``dialect``, ``is_sqlite``, or a comparison with a backend's name."""
    if isinstance(node, ast.Attribute):
        return node.attr in ("dialect", "is_sqlite")
    if isinstance(node, ast.Name):
        return node.id in ("dialect", "is_sqlite")
    if isinstance(node, ast.Compare):
        sides = [node.left, *node.comparators]
        return any(isinstance(side, ast.Constant) and side.value in BACKENDS for side in sides)
    return False


def test_only_the_listed_functions_ask_for_the_dialect() -> None:
    found = {use for path in SCANNED for use in _uses(path)}
    assert sorted(found - set(ASKS_THE_DIALECT)) == []
    assert sorted(set(ASKS_THE_DIALECT) - found) == []


def test_the_query_parser_needs_no_sqlalchemy() -> None:
    check = (
        "import sys; import hermes_store.search.query as q; "
        "assert q.parse('a OR b') is not None; "
        "raise SystemExit('sqlalchemy' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr


def test_each_backend_has_its_statements_and_searcher(tmp_path: Path) -> None:
    sqlite_dialect = sa.create_engine("sqlite://").dialect
    pg_dialect = sa.create_engine("postgresql+psycopg://u@h/db").dialect
    assert isinstance(dialects.for_dialect(sqlite_dialect), SqliteStatements)
    chosen = dialects.for_dialect(pg_dialect)
    assert isinstance(chosen, PostgresqlStatements)
    assert chosen.streams_export and not chosen.holds_nul
    assert pipeline.for_dialect("sqlite") is pipeline.SQLITE
    assert pipeline.for_dialect("postgresql") is pipeline.POSTGRESQL
    with SessionDB(tmp_path / "state.db") as db:
        assert db.is_sqlite
        db.create_session("s", "cli")
        assert db.append_message("s", "user", "nul \x00 kept on SQLite") == 1
