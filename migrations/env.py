"""Alembic environment for hermes_store.

The database is ``-x url=...`` (what the operator typed for this command), else
``HERMES_STORE_URL``, else ``$HERMES_HOME/state.db``; a caller may hand over an open connection
in ``config.attributes["connection"]``. Every mutating command first adopts a ``state.db``
written by the original store. Offline (``--sql``), the SQL for an empty database (or from a
stated revision, ``upgrade v3_session_title:head --sql``) is printed and nothing is inspected:
optional objects (PostgreSQL's pg_trgm index) are emitted as if the server allowed them.
"""

from __future__ import annotations

from logging.config import fileConfig
from typing import Any

from alembic import context
from alembic.operations.ops import AlterColumnOp
from alembic.util import CommandError
from sqlalchemy.engine import Connection

from hermes_store.engine import placement
from hermes_store.engine.factory import sqlite_file, to_url, url_from_environment
from hermes_store.errors import HermesStoreError
from hermes_store.schema import ddl, migrate
from hermes_store.tables import metadata

config = context.config
target_metadata = metadata
if (
    config.config_file_name is not None
    and "connection" not in config.attributes
    and config.file_config.has_section("loggers")  # a minimal hand-written ini has none
):
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def _url() -> str:
    """``-x url=...``, else the URL a library call handed over, else the environment's."""
    x_url = context.get_x_argument(as_dictionary=True).get("url")
    given = config.attributes.get("url")
    url = to_url(x_url) if x_url else given if given is not None else url_from_environment()
    return url.render_as_string(hide_password=False)


def _placement() -> placement.Placement:
    """``-x schema=... -x version_table=...``, else the caller's, else the environment's."""
    x = context.get_x_argument(as_dictionary=True)
    given = config.attributes.get("placement")
    base = given if isinstance(given, placement.Placement) else placement.current()
    return placement.Placement(
        x.get("schema") or base.schema, x.get("version_table") or base.version_table
    )


def include_name(name: str | None, type_: str, parent_names: Any) -> bool:
    """Autogenerate ignores what the migrations own outside the models: the FTS table and its
    shadow tables, Alembic's own table, PostgreSQL's stored tsvector and its GIN indexes."""
    if type_ == "table" and name is not None:
        return name not in ddl.UNMODELLED_TABLES and not ddl.is_fts_shadow_table(name)
    if type_ == "index":
        return name not in ddl.UNMODELLED_INDEXES
    if type_ == "column":
        return name not in ddl.UNMODELLED_COLUMNS
    return True


def drop_primary_key_nullability(ctx: Any, revision: Any, directives: list[Any]) -> None:
    """Primary-key nullability is not drift: PostgreSQL makes every key NOT NULL while the
    original store's SQLite DDL (``id TEXT PRIMARY KEY``, an INTEGER rowid alias) leaves the flag
    off."""
    if not directives:
        return
    for upgrade_ops in directives[0].upgrade_ops_list:
        for table_ops in list(upgrade_ops.ops):
            inner = getattr(table_ops, "ops", None)
            if inner is None:
                continue
            inner[:] = [
                op
                for op in inner
                if not (
                    isinstance(op, AlterColumnOp)
                    and op.column_name == "id"
                    and op.modify_nullable is not None
                    and op.modify_type is None
                    and op.modify_server_default is False
                )
            ]
            if not inner:
                upgrade_ops.ops.remove(table_ops)


def _mutating() -> bool:
    try:
        context.get_revision_argument()
    except KeyError:  # current, check, history: no destination, nothing to adopt
        return False
    return True


def _configure(connection: Connection) -> None:
    where = placement.of(connection)
    context.configure(
        connection=connection,
        version_table=where.version_table,
        version_table_schema=where.schema,
        target_metadata=target_metadata,
        include_name=include_name,
        render_as_batch=True,
        compare_type=True,
        compare_server_default=True,
        process_revision_directives=drop_primary_key_nullability,
        # ``check`` and ``current`` only read: Alembic would otherwise create its empty
        # version table in a file the original store wrote (adoption is for the upgrades).
        dont_mutate=not _mutating(),
    )


def run_migrations_offline() -> None:
    where = _placement()
    context.configure(
        url=_url(),
        version_table=where.version_table,
        version_table_schema=where.schema,
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=True,
        transaction_per_migration=False,
    )
    with context.begin_transaction():
        if where.schema is not None:  # as online: the literal DDL lands in the schema
            context.execute(f'CREATE SCHEMA IF NOT EXISTS "{where.schema}"')
            context.execute(f'SET LOCAL search_path TO "{where.schema}"')
        context.run_migrations()


def _run(connection: Connection) -> None:
    if _mutating():
        migrate.adopt(connection)
    _configure(connection)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    with placement.using(_placement()):
        _run_own_connection()


def _downgrading() -> bool:
    """A downgrade: from the command line (Alembic's parsed command), or down to base."""
    command = getattr(config.cmd_opts, "cmd", None)
    if command and getattr(command[0], "__name__", "") == "downgrade":
        return True
    return _mutating() and context.get_revision_argument() == "base"


def _run_own_connection() -> None:
    path = sqlite_file(to_url(_url()))
    if path is not None and not path.exists() and _downgrading():
        raise CommandError(f"there is no database at {path}: nothing to downgrade")
    if _mutating():
        with migrate.migration_connection(_url()) as conn:
            _run(conn)
        return
    engine = migrate.read_engine(_url())
    try:
        with engine.connect() as conn:
            _configure(conn)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


try:
    if context.is_offline_mode():
        run_migrations_offline()
    else:
        run_migrations_online()
except HermesStoreError as error:
    if config.cmd_opts is None:  # a library call: the package's own error, as raised
        raise
    # Alembic's command line reports a CommandError as one ``FAILED: ...`` line.
    raise CommandError(str(error)) from error
