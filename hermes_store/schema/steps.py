"""Mechanics the Alembic revisions share; never schema facts.

Each revision spells out its own columns, indexes and raw DDL, so editing this package can never
rewrite history (``tests/test_revisions_frozen.py`` pins the SQL every revision emits). What lives
here is *how* to apply a step on each backend, online or offline (``alembic upgrade --sql``):
skip columns an older build of the original store already added, rebuild SQLite tables without
losing triggers, indexes or the AUTOINCREMENT high-water mark, and keep ``schema_version`` in step.
"""

from __future__ import annotations

import logging
from typing import Any

import sqlalchemy as sa
from alembic import context, op
from alembic.util import CommandError

# The revisions ask this module whether the server has trigrams (a fact kept in ddl).
from hermes_store.schema.ddl import trigram_supported as trigram_supported

log = logging.getLogger(__name__)

#: Rows a revision's backfill handles per statement (long messages of up to 16 MiB each):
#: bounded memory and a progress line per batch on a large table.
BACKFILL_BATCH = 50


def dialect_name() -> str:
    """The backend being migrated (works offline, where there is no connection)."""
    return str(op.get_context().dialect.name)


def offline() -> bool:
    """True under ``alembic ... --sql``: emit SQL, inspect nothing."""
    return bool(context.is_offline_mode())


def set_schema_version(version: int) -> None:
    """Keep the original store's one-row marker in step with the Alembic revision."""
    op.execute(sa.text("DELETE FROM schema_version"))
    op.execute(sa.text("INSERT INTO schema_version (version) VALUES (:v)").bindparams(v=version))


def add_columns(table: str, *columns: sa.Column[Any]) -> None:
    """Add ``columns``, skipping any an older build of the original store already added
    (online only: offline SQL starts from the previous revision's exact shape)."""
    existing: set[str] = set()
    if not offline():
        existing = {c["name"] for c in sa.inspect(op.get_bind()).get_columns(table)}
    for column in columns:
        if column.name not in existing:
            op.add_column(table, column)


def drop_columns(table: str, *names: str, autoincrement: bool = False) -> None:
    """Remove columns: ``ALTER TABLE ... DROP COLUMN`` on PostgreSQL, a table rebuild on SQLite
    that puts back what the rebuild loses (see :class:`_SqliteTableState`)."""
    if dialect_name() != "sqlite":
        for name in names:
            op.drop_column(table, name)
        return
    if offline():
        raise CommandError(
            "an offline (--sql) downgrade cannot rebuild a SQLite table: it needs the live "
            "schema; run the downgrade against the database instead"
        )
    bind = op.get_bind()
    saved = _SqliteTableState.capture(bind, table, list(names))
    table_kwargs = {"sqlite_autoincrement": True} if autoincrement else {}
    with op.batch_alter_table(table, table_kwargs=table_kwargs) as batch:
        for name in names:
            batch.drop_column(name)
    saved.restore(bind)


def create_optional(description: str, *statements: str) -> bool:
    """Statements a server may refuse (``CREATE EXTENSION pg_trgm`` needs privileges): online
    they run in a savepoint and a refusal is logged, not fatal; offline they are emitted."""
    if offline():
        for statement in statements:
            op.execute(sa.text(statement))
        return True
    bind = op.get_bind()
    try:
        with bind.begin_nested():
            for statement in statements:
                bind.execute(sa.text(statement))
    except sa.exc.DBAPIError as error:
        log.warning("%s unavailable (%s); continuing without it", description, error.orig)
        return False
    return True


class _SqliteTableState:
    """What SQLite's table rebuild (copy, drop, rename) loses, captured beforehand.

    The rebuild drops the table's triggers, recreates its indexes from reflection (which
    loses ``DESC`` and may lose a partial index's predicate) and resets the AUTOINCREMENT
    high-water mark to the largest id left (so ids of deleted rows would be handed out
    again). ``restore`` puts back the triggers and indexes from their stored SQL, verbatim,
    and the sequence value.
    """

    def __init__(self, table: str, objects: list[tuple[str, str, str]], seq: int | None) -> None:
        self.table, self.objects, self.seq = table, objects, seq

    @classmethod
    def capture(cls, bind: sa.Connection, table: str, dropped: list[str]) -> _SqliteTableState:
        rows = bind.execute(
            sa.text(
                "SELECT type, name, sql FROM sqlite_master "
                "WHERE type IN ('index', 'trigger') AND tbl_name = :t AND sql IS NOT NULL"
            ),
            {"t": table},
        ).all()
        objects: list[tuple[str, str, str]] = []
        for kind, name, sql in rows:
            if kind == "index":
                info = bind.execute(sa.text("SELECT name FROM pragma_index_info(:i)"), {"i": name})
                if {column for (column,) in info} & set(dropped):
                    continue  # an index on a dropped column goes with it
            objects.append((kind, name, sql))
        seq = None
        if sa.inspect(bind).has_table("sqlite_sequence"):
            seq = bind.execute(
                sa.text("SELECT seq FROM sqlite_sequence WHERE name = :t"), {"t": table}
            ).scalar()
        return cls(table, objects, seq)

    def restore(self, bind: sa.Connection) -> None:
        for kind, name, sql in self.objects:  # the stored SQL verbatim (no bind parsing)
            bind.exec_driver_sql(f'DROP {kind.upper()} IF EXISTS "{name}"')
            bind.exec_driver_sql(sql)
        if self.seq is not None:
            params = {"t": self.table, "s": self.seq}
            updated = bind.execute(
                sa.text("UPDATE sqlite_sequence SET seq = MAX(seq, :s) WHERE name = :t"), params
            ).rowcount
            if not updated:
                bind.execute(
                    sa.text("INSERT INTO sqlite_sequence (name, seq) VALUES (:t, :s)"), params
                )
