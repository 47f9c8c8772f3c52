"""No SQL text is assembled from a caller's values anywhere in ``hermes_store``.

A value quoted into SQL on the client is only as safe as the quoting, and the quoting depends
on the connection's client encoding and on server settings the store does not control (the
PostgreSQL group commit ran chat content as SQL that way). Every value goes to the server as
a bound parameter. This test reads the package's source with ``ast`` and fails on:

- ``.mogrify(``, ``literal_binds``, psycopg's ``ClientCursor`` / ``sql.Literal``: client-side
  quoting, whatever the argument;
- SQL built with an f-string, ``%``, ``.format()``, ``+`` or ``.join()`` (directly, or through
  a local variable of the same function) and passed to ``execute``, ``exec_driver_sql``,
  ``text``, ``literal_column``, ``copy`` and the like.

The uses that interpolate only identifiers or constants written by the package itself are
listed in :data:`ALLOWED`, each with the reason it cannot carry a caller's value. An entry
that no longer matches anything fails too, so the list stays exact.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "hermes_store"
#: The Alembic revisions (``hermes_store.migrations`` once installed).
MIGRATIONS = ROOT / "migrations"

#: Calls whose first argument (or ``sql``/``statement``/``query`` keyword) is SQL text.
SQL_SINKS = frozenset(
    {
        "execute",
        "executemany",
        "executescript",
        "exec_driver_sql",
        "exec_",
        "send_query",
        "text",
        "literal_column",
        "DDL",
        "copy",
        "driver_execute",
        "SQL",
    }
)
#: Names that quote values on the client, wherever they appear.
CLIENT_QUOTING = frozenset(
    {"mogrify", "literal_binds", "literal_execute", "ClientCursor", "AsyncClientCursor"}
)

#: Audited uses of formatted SQL: (file under hermes_store/, enclosing function) -> why no
#: caller's value can reach the text.
ALLOWED: dict[tuple[str, str], str] = {
    # The full-text tables' names: ddl.FTS_TABLE / ddl.CJK_TABLE, or names read back from
    # sqlite_master for exactly those tables' shadow tables.
    ("schema/fulltext.py", "structure_block"): "the FTS table name (a ddl constant) + '_data'",
    ("schema/fulltext.py", "_pages_absent"): "the FTS table name (a ddl constant) + '_data'",
    ("schema/fulltext.py", "_opens"): "the FTS table name (a ddl constant)",
    ("schema/fulltext.py", "reset_shadow_tables"): "shadow table names of the ddl's FTS tables",
    # SQLite PRAGMAs take no bound parameters; the values are numbers of the package's own.
    ("engine/factory.py", "setup_connection"): "PRAGMA values: int() of the store's own settings",
    ("engine/factory.py", "prepare_driver"): "PRAGMA busy_timeout: int() of the store's settings",
    ("ops/maintenance.py", "secure_deletes"): "PRAGMA value from a fixed table of the module",
    ("ops/maintenance.py", "fts5_settings"): "an FTS table name from FTS_TABLES (ddl constants)",
    (
        "ops/maintenance.py",
        "_set_fts5",
    ): "an FTS table name from FTS_TABLES (ddl constants); the values are bound",
    # Identifiers and constants the package defines: never a caller's value.
    ("schema/fulltext.py", "SqliteFullText.optimize"): "the FTS table's name: a ddl constant",
    ("schema/fulltext.py", "SqliteFullText.leaf_pages"): "the FTS table's name: a ddl constant",
    ("schema/fulltext.py", "PostgresFullText.drop"): "index and column names: ddl constants",
    ("schema/fulltext.py", "PostgresFullText.rebuild"): "to_regclass() text of ddl constants",
    ("schema/fulltext.py", "cjk_index_expected"): "the version table: a validated identifier",
    ("schema/fulltext.py", "long_text_expected"): "the version table: a validated identifier",
    ("schema/fulltext.py", "_check_cjk_index"): "table names: ddl constants; the pattern is bound",
    ("search/fts5.py", "<module>"): "FTS5 snippet() of the FTS table's name: a ddl constant",
    ("search/tsvector.py", "<module>"): "the tsvector column: table and ddl column constants",
    ("schema/fulltext.py", "<module>"): "a bulk load's checks: docsize tables and the CJK "
    "condition over ddl constants; the ids are bound",
    (
        "schema/migrate.py",
        "read_state",
    ): "the version table, qualified by Placement.table (validated)",
    ("engine/placement.py", "create_schema"): "the schema: a validated lower-case identifier",
    ("transfer.py", "_advance_message_sequence"): "a sequence name the server returned, quoted",
    ("schema/steps.py", "_SqliteTableState.restore"): "names of the file's own indexes/triggers",
    ("repo/pgstream.py", "copy_rows"): "COPY target: table and columns quoted by the dialect; the "
    "rows go as COPY data, not SQL",
    # Migrations: DDL on the package's own tables, triggers and validated schema. Offline mode
    # (alembic --sql) renders a script for a DBA to read: no caller's value is in it.
    ("migrations/env.py", "run_migrations_offline"): "alembic --sql renders the DDL script",
    ("migrations/versions/h8_pg_bigint_counters.py", "_retype"): "the package's own columns",
    ("migrations/versions/v1_base.py", "downgrade"): "the package's own trigger names",
    ("migrations/versions/h7_cjk_index.py", "downgrade"): "the package's own trigger names",
}


@dataclass(frozen=True)
class Finding:
    path: str
    function: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"hermes_store/{self.path}:{self.line} in {self.function}: {self.what}"


def _call_name(node: ast.Call) -> str | None:
    if isinstance(node.func, ast.Attribute):
        return node.func.attr
    if isinstance(node.func, ast.Name):
        return node.func.id
    return None


def _sql_argument(node: ast.Call) -> ast.expr | None:
    if node.args:
        return node.args[0]
    for keyword in node.keywords:
        if keyword.arg in ("sql", "statement", "query", "text"):
            return keyword.value
    return None


class _Scanner(ast.NodeVisitor):
    def __init__(self, path: str) -> None:
        self.path = path
        self.scope: list[str] = []
        self.assigned: list[dict[str, list[ast.expr]]] = [{}]
        self.findings: list[Finding] = []

    @property
    def function(self) -> str:
        return ".".join(self.scope) or "<module>"

    def _report(self, node: ast.AST, what: str) -> None:
        self.findings.append(Finding(self.path, self.function, getattr(node, "lineno", 0), what))

    def _enter(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        self.scope.append(node.name)
        if not isinstance(node, ast.ClassDef):
            self.assigned.append(_assignments(node))
        self.generic_visit(node)
        if not isinstance(node, ast.ClassDef):
            self.assigned.pop()
        self.scope.pop()

    visit_FunctionDef = _enter
    visit_AsyncFunctionDef = _enter
    visit_ClassDef = _enter

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr in CLIENT_QUOTING:
            self._report(node, f"client-side quoting ({node.attr})")
        if node.attr == "Literal" and isinstance(node.value, ast.Name) and node.value.id == "sql":
            self._report(node, "client-side quoting (psycopg sql.Literal)")
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if node.id in CLIENT_QUOTING:
            self._report(node, f"client-side quoting ({node.id})")

    def visit_alias(self, node: ast.alias) -> None:
        if node.name in CLIENT_QUOTING:
            self._report(node, f"client-side quoting (imports {node.name})")

    def visit_keyword(self, node: ast.keyword) -> None:
        if node.arg in CLIENT_QUOTING:
            self._report(node.value, f"client-side quoting ({node.arg}=)")
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if node.value in CLIENT_QUOTING:  # compile_kwargs={"literal_binds": True}
            self._report(node, f"client-side quoting ({node.value!r})")

    def visit_Call(self, node: ast.Call) -> None:
        name = _call_name(node)
        argument = _sql_argument(node) if name in SQL_SINKS else None
        if argument is not None and self._dynamic(argument, set()):
            self._report(node, f"SQL text built from values passed to {name}()")
        self.generic_visit(node)

    def _dynamic(self, node: ast.expr, seen: set[str]) -> bool:
        """True for a string built at run time: formatted, concatenated or joined."""
        if isinstance(node, ast.JoinedStr):
            return any(isinstance(part, ast.FormattedValue) for part in node.values)
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mod, ast.Add)):
            return not (_constant_str(node.left) and _constant_str(node.right))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            return node.func.attr in ("format", "join", "replace")
        if isinstance(node, ast.Name) and node.id not in seen:
            seen.add(node.id)
            return any(self._dynamic(value, seen) for value in self.assigned[-1].get(node.id, []))
        return False


def _constant_str(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def _assignments(function: ast.FunctionDef | ast.AsyncFunctionDef) -> dict[str, list[ast.expr]]:
    """The values each local name of ``function`` is assigned (its own body, not nested
    functions')."""
    found: dict[str, list[ast.expr]] = {}
    stack: list[ast.AST] = list(function.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    found.setdefault(target.id, []).append(node.value)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and node.value is not None:
            if isinstance(node.target, ast.Name):
                value = node.value
                if isinstance(node, ast.AugAssign):  # s += x is dynamic unless x is constant
                    value = ast.BinOp(left=node.target, op=node.op, right=node.value)
                found.setdefault(node.target.id, []).append(value)
        elif isinstance(node, ast.NamedExpr) and isinstance(node.target, ast.Name):
            found.setdefault(node.target.id, []).append(node.value)
        stack.extend(ast.iter_child_nodes(node))
    return found


def scan_source(source: str, path: str) -> list[Finding]:
    scanner = _Scanner(path)
    scanner.visit(ast.parse(source, filename=path))
    return scanner.findings


@functools.cache
def scan_package() -> list[Finding]:
    findings: list[Finding] = []
    for file in sorted([*PACKAGE.rglob("*.py"), *MIGRATIONS.rglob("*.py")]):
        path = file.relative_to(PACKAGE if file.is_relative_to(PACKAGE) else ROOT).as_posix()
        findings.extend(scan_source(file.read_text(encoding="utf-8"), path))
    return findings


def _unexplained(findings: list[Finding]) -> Iterator[Finding]:
    for finding in findings:
        if (finding.path, finding.function) not in ALLOWED:
            yield finding


def test_no_sql_text_is_built_from_values() -> None:
    unexplained = [str(finding) for finding in _unexplained(scan_package())]
    assert unexplained == [], (
        "SQL built on the client: bind the values as parameters (or, for an identifier only, "
        "add the function to ALLOWED with the reason)"
    )


def test_every_allowed_use_still_exists() -> None:
    used = {(finding.path, finding.function) for finding in scan_package()}
    assert sorted(set(ALLOWED) - used) == []


@pytest.mark.parametrize(
    "source",
    [
        "def f(cur, v):\n    cur.mogrify('SELECT %s', (v,))\n",
        "from psycopg import ClientCursor\n",
        "def f(stmt, d):\n    stmt.compile(dialect=d, compile_kwargs={'literal_binds': True})\n",
        "def f(conn, v):\n    conn.exec_driver_sql(f\"SELECT '{v}'\")\n",
        "def f(conn, v):\n    conn.execute(sa.text(\"SELECT '%s'\" % v))\n",
        "def f(conn, v):\n    conn.execute(text(\"SELECT '{}'\".format(v)))\n",
        'def f(conn, v):\n    sql = "SELECT \'" + v + "\'"\n    conn.exec_driver_sql(sql)\n',
        "def f(cur, vs):\n    cur.execute(';'.join(vs))\n",
        "def f(conn, v):\n    q = 'SELECT '\n    q += v\n    conn.execute(sa.text(q))\n",
        "def f(v):\n    return sa.literal_column(f\"'{v}'\")\n",
    ],
)
def test_the_rule_catches_each_kind(source: str) -> None:
    """The scanner itself: each way of quoting or formatting a value into SQL is reported."""
    assert scan_source(source, "example.py") != []


@pytest.mark.parametrize(
    "source",
    [
        "def f(conn, v):\n    conn.execute(sa.text('SELECT :v'), {'v': v})\n",
        "def f(cur, v):\n    cur.execute('SELECT %s', (v,))\n",
        "def f(cur, v):\n    cur.execute('SELECT %(v)s', {'v': v})\n",
    ],
)
def test_bound_parameters_pass(source: str) -> None:
    assert scan_source(source, "example.py") == []
