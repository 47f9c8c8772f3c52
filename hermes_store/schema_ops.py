"""Operations the Alembic revisions share: full-text objects per backend, column steps, the marker.

Each revision stays a readable list of steps; what differs between SQLite and PostgreSQL, and
what must survive SQLite's table rebuilds (the FTS triggers, the partial title index), lives here.
"""

from __future__ import annotations

import logging
from typing import Any

import sqlalchemy as sa
from alembic import op

from hermes_store import ddl

log = logging.getLogger(__name__)


def _is_sqlite() -> bool:
    return op.get_bind().dialect.name == "sqlite"


def set_schema_version(version: int) -> None:
    """Keep the seed's one-row marker in step with the Alembic revision."""
    op.execute(sa.text("DELETE FROM schema_version"))
    op.execute(sa.text("INSERT INTO schema_version (version) VALUES (:v)").bindparams(v=version))


def create_full_text() -> None:
    """The FTS5 table and triggers on SQLite; the tsvector and trigram GIN indexes on PostgreSQL."""
    bind = op.get_bind()
    if bind.dialect.name == "sqlite":
        missing = not sa.inspect(bind).has_table(ddl.FTS_TABLE)
        op.execute(sa.text(ddl.SQLITE_FTS_TABLE))
        for trigger in ddl.SQLITE_FTS_TRIGGERS:
            op.execute(sa.text(trigger))
        if missing:  # index whatever the table already holds (adopted files, rebuilt tables)
            op.execute(sa.text(ddl.SQLITE_FTS_REBUILD))
        return
    op.execute(sa.text(ddl.PG_FTS_COLUMN_CREATE))
    op.execute(sa.text(ddl.PG_FTS_CREATE))
    create_trigram_index()


def create_trigram_index() -> bool:
    """Substring (CJK) search index; optional, since pg_trgm may not be installable."""
    bind = op.get_bind()
    try:
        with bind.begin_nested():
            bind.execute(sa.text("CREATE EXTENSION IF NOT EXISTS pg_trgm"))
            bind.execute(sa.text(ddl.PG_TRGM_CREATE))
    except sa.exc.DBAPIError as error:
        log.warning(
            "pg_trgm unavailable (%s); substring search will scan without an index",
            str(error.orig).strip(),
        )
        return False
    return True


#: The first SQLite release with FTS5's trigram tokenizer.
TRIGRAM_SQLITE = (3, 34, 0)


def trigram_supported(sqlite_version: str) -> bool:
    """Whether a SQLite of this version (``sqlite_version()``) has the trigram tokenizer."""
    parts = tuple(int(p) for p in sqlite_version.split(".")[:3] if p.isdigit())
    return parts >= TRIGRAM_SQLITE


def create_cjk_index(bind: sa.Connection) -> bool:
    """The CJK trigram index, its triggers and its rows (SQLite only). False, creating nothing,
    when this SQLite has no trigram tokenizer: a trigger naming a trigram table would make every
    insert fail there with "no such tokenizer"."""
    if bind.dialect.name != "sqlite":
        return False
    version = str(bind.exec_driver_sql("SELECT sqlite_version()").scalar())
    if not trigram_supported(version):
        log.warning(
            "SQLite %s has no trigram tokenizer (needs 3.34+): CJK search will scan", version
        )
        return False
    missing = not sa.inspect(bind).has_table(ddl.CJK_TABLE)
    bind.exec_driver_sql(ddl.SQLITE_CJK_TABLE)
    for trigger in ddl.SQLITE_CJK_TRIGGERS:
        bind.exec_driver_sql(trigger)
    if missing:
        for statement in ddl.SQLITE_CJK_REBUILD:
            bind.exec_driver_sql(statement)
    return True


def drop_cjk_index(bind: sa.Connection) -> None:
    if bind.dialect.name == "sqlite":
        for statement in ddl.SQLITE_CJK_DROP:
            bind.exec_driver_sql(statement)


def drop_full_text() -> None:
    if _is_sqlite():
        for statement in ddl.SQLITE_FTS_DROP:
            op.execute(sa.text(statement))
    else:
        op.execute(sa.text(f"DROP INDEX IF EXISTS {ddl.PG_TRGM_INDEX}"))
        op.execute(sa.text(f"DROP INDEX IF EXISTS {ddl.PG_FTS_INDEX}"))
        op.execute(sa.text(f"ALTER TABLE messages DROP COLUMN IF EXISTS {ddl.PG_TSV_COLUMN}"))


def create_title_index() -> None:
    op.create_index(
        "idx_sessions_title_unique",
        "sessions",
        ["title"],
        unique=True,
        sqlite_where=sa.text("title IS NOT NULL"),
        postgresql_where=sa.text("title IS NOT NULL"),
        if_not_exists=True,
    )


def _column(sql_type: str, name: str, default: str | None) -> sa.Column[Any]:
    types: dict[str, sa.types.TypeEngine[Any]] = {
        "TEXT": sa.Text(),
        "INTEGER": sa.Integer(),
        "REAL": sa.REAL().with_variant(sa.dialects.postgresql.DOUBLE_PRECISION(), "postgresql"),
    }
    server_default = sa.text(default) if default is not None else None
    return sa.Column(name, types[sql_type], server_default=server_default)


def add_version_columns(version: int) -> None:
    """Add the columns ``version`` introduced, skipping any an older build already added."""
    bind = op.get_bind()
    for table, name, sql_type, default in ddl.VERSION_COLUMNS[version]:
        existing = {c["name"] for c in sa.inspect(bind).get_columns(table)}
        if name not in existing:
            op.add_column(table, _column(sql_type, name, default))


def drop_version_columns(version: int) -> None:
    """Remove the columns ``version`` introduced (a table rebuild on SQLite)."""
    bind = op.get_bind()
    by_table: dict[str, list[str]] = {}
    for table, name, _type, _default in ddl.VERSION_COLUMNS[version]:
        by_table.setdefault(table, []).append(name)
    for table, names in by_table.items():
        saved = _SqliteTableState.capture(bind, table, names) if _is_sqlite() else None
        table_kwargs = {"sqlite_autoincrement": True} if table == "messages" else {}
        with op.batch_alter_table(table, table_kwargs=table_kwargs) as batch:
            for name in names:
                batch.drop_column(name)
        if saved is not None:
            saved.restore(bind)


class _SqliteTableState:
    """What SQLite's table rebuild (copy, drop, rename) loses, captured beforehand.

    The rebuild drops the table's triggers, recreates its indexes from reflection (which
    loses ``DESC`` and may lose a partial index's predicate) and resets the AUTOINCREMENT
    high-water mark to the largest id left (so ids of deleted rows would be handed out
    again). ``restore`` puts back the FTS triggers, the indexes from their original SQL and
    the sequence value.
    """

    def __init__(self, table: str, indexes: list[tuple[str, str]], seq: int | None) -> None:
        self.table, self.indexes, self.seq = table, indexes, seq

    @classmethod
    def capture(cls, bind: sa.Connection, table: str, dropped: list[str]) -> _SqliteTableState:
        rows = bind.execute(
            sa.text(
                "SELECT name, sql FROM sqlite_master "
                "WHERE type = 'index' AND tbl_name = :t AND sql IS NOT NULL"
            ),
            {"t": table},
        ).all()
        indexes: list[tuple[str, str]] = []
        for name, sql in rows:
            info = bind.execute(sa.text("SELECT name FROM pragma_index_info(:i)"), {"i": name})
            if not {column for (column,) in info} & set(dropped):
                indexes.append((name, sql))
        seq = None
        if sa.inspect(bind).has_table("sqlite_sequence"):
            seq = bind.execute(
                sa.text("SELECT seq FROM sqlite_sequence WHERE name = :t"), {"t": table}
            ).scalar()
        return cls(table, indexes, seq)

    def restore(self, bind: sa.Connection) -> None:
        if self.table == "messages" and sa.inspect(bind).has_table(ddl.FTS_TABLE):
            for trigger in ddl.SQLITE_FTS_TRIGGERS:
                op.execute(sa.text(trigger))
        if self.table == "messages" and sa.inspect(bind).has_table(ddl.CJK_TABLE):
            for trigger in ddl.SQLITE_CJK_TRIGGERS:
                bind.exec_driver_sql(trigger)
        for name, sql in self.indexes:  # the stored SQL verbatim (no bind-parameter parsing)
            bind.exec_driver_sql(f'DROP INDEX IF EXISTS "{name}"')
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
