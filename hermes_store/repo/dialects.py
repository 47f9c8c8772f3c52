"""Each backend's :class:`~hermes_store.repo.statements.Statements`, looked up once per store."""

from __future__ import annotations

from sqlalchemy.engine import Dialect

from hermes_store.repo.sqlite import SqliteStatements
from hermes_store.repo.statements import Statements


def for_dialect(dialect: Dialect) -> Statements:
    """SQLite's statements for a SQLite engine; every other engine is a server, which the
    store speaks to in PostgreSQL's statements."""
    if dialect.name == "sqlite":
        return SqliteStatements()
    # PostgreSQL's dialect module loads only for a server (it costs a SQLite open ~30 ms).
    from hermes_store.repo.postgresql import PostgresqlStatements

    return PostgresqlStatements(dialect)
