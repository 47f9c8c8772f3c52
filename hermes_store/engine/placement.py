"""Where the store's tables live: a schema of an application's own PostgreSQL database, and the
name of the Alembic version table, so ``sessions``, ``messages`` and ``alembic_version`` need
not collide with the application's.

An Engine made for a placement carries it in its execution options: Core and ORM statements
get ``schema_translate_map={None: schema}``, and every transaction begins with ``SET LOCAL
search_path`` to the schema alone, so raw SQL (search, the full-text DDL, the migrations'
literal DDL) lands there too; ``SET LOCAL`` ends with the transaction, so PgBouncer in
transaction mode hands no setting on to another client. Open-time code (adoption, migrations)
reads the placement of the call in progress (:func:`using`). SQLite has no schemas: a schema
is refused there; the version table's name works on both.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from sqlalchemy import event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection, Engine

from hermes_store.errors import InvalidInputError

SCHEMA_ENV = "HERMES_STORE_SCHEMA"
VERSION_TABLE_ENV = "HERMES_STORE_VERSION_TABLE"
DEFAULT_VERSION_TABLE = "alembic_version"
#: Execution option carrying the placement on an Engine or Connection.
OPTION = "hermes_placement"
#: Plain identifiers only: they are interpolated into SQL, and PostgreSQL folds case.
_IDENTIFIER = re.compile(r"[a-z_][a-z0-9_]{0,62}")


@dataclass(frozen=True)
class Placement:
    """``schema``: None is the connection's default (``public``); ``version_table``: the
    Alembic version table's name."""

    schema: str | None = None
    version_table: str = DEFAULT_VERSION_TABLE

    def __post_init__(self) -> None:
        if self.schema is not None:
            _check("schema", self.schema)
        _check("version_table", self.version_table)

    @property
    def is_default(self) -> bool:
        return self.schema is None and self.version_table == DEFAULT_VERSION_TABLE

    def table(self, name: str) -> str:
        """``name`` qualified with the schema, for raw SQL."""
        _check("table", name)
        return name if self.schema is None else f'"{self.schema}"."{name}"'

    def execution_options(self) -> dict[str, Any]:
        """Options for an Engine of this placement (nothing for the default one)."""
        if self.is_default:
            return {}
        options: dict[str, Any] = {OPTION: self}
        if self.schema is not None:
            options["schema_translate_map"] = {None: self.schema}
        return options

    def check_dialect(self, dialect: str) -> None:
        if self.schema is not None and dialect != "postgresql":
            raise InvalidInputError(
                f"schema={self.schema!r} needs PostgreSQL: a {dialect} database has no schemas "
                "(the version table's name works on every backend)"
            )

    @classmethod
    def from_environment(cls) -> Placement:
        """``HERMES_STORE_SCHEMA`` and ``HERMES_STORE_VERSION_TABLE`` (empty: the default)."""
        return cls(
            os.environ.get(SCHEMA_ENV) or None,
            os.environ.get(VERSION_TABLE_ENV) or DEFAULT_VERSION_TABLE,
        )

    @classmethod
    def resolve(cls, schema: str | None = None, version_table: str | None = None) -> Placement:
        """Explicit values, else those of the call in progress (:func:`using`), else the
        environment's."""
        env = current()
        return cls(
            env.schema if schema is None else schema,
            env.version_table if version_table is None else version_table,
        )


def _check(what: str, name: str) -> None:
    if not isinstance(name, str) or not _IDENTIFIER.fullmatch(name):
        raise InvalidInputError(
            f"{what} must be a lower-case SQL identifier (letters, digits, _; at most 63), "
            f"not {name!r}"
        )


_current: ContextVar[Placement | None] = ContextVar("hermes_placement", default=None)


def current() -> Placement:
    """The placement of the call in progress (see :func:`using`), else the environment's."""
    found = _current.get()
    return found if found is not None else Placement.from_environment()


@contextmanager
def using(placement: Placement | None) -> Iterator[Placement]:
    """Make ``placement`` (None: the current one) the placement of the calls inside."""
    chosen = placement if placement is not None else current()
    token = _current.set(chosen)
    try:
        yield chosen
    finally:
        _current.reset(token)


def of(conn: Connection | Engine) -> Placement:
    """The placement a connection or engine was made for, else the current one."""
    found = conn.get_execution_options().get(OPTION)
    return found if isinstance(found, Placement) else current()


def install(engine: Engine, placement: Placement) -> None:
    """Begin every transaction of a PostgreSQL engine with the placement's search_path."""
    if placement.schema is None or engine.dialect.name != "postgresql":
        return
    statement = f'SET LOCAL search_path TO "{placement.schema}"'

    dialect = engine.dialect
    driver_error = dialect.loaded_dbapi.Error

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        # On the driver: the transaction begins with this statement (psycopg's implicit BEGIN).
        # SQLAlchemy runs this hook outside its own error handling, so a connection the server
        # dropped (a restart, a failover) is handled here as SQLAlchemy would: invalidated,
        # and raised as its DBAPIError, which the Unit of Work retries or maps like any other.
        dbapi_connection = conn.connection.dbapi_connection
        cursor = dbapi_connection.cursor()  # type: ignore[union-attr]
        try:
            cursor.execute(statement)
        except driver_error as error:
            gone = dialect.is_disconnect(error, dbapi_connection, cursor)
            if gone:
                conn.invalidate(error)
            raise sa_exc.DBAPIError.instance(
                statement, None, error, driver_error, connection_invalidated=gone, dialect=dialect
            ) from error
        finally:
            with suppress(driver_error):  # a cursor of a dead connection may refuse to close
                cursor.close()


def placed(engine: Engine, placement: Placement) -> Engine:
    """A caller's Engine as the store must use it: for a placement other than the default, a
    copy of it (sharing its pool) carrying the placement's options and search_path hook, so
    the store's statements land in its schema while the caller's own use of the Engine (its
    tables in ``public``, say) stays as it was."""
    if placement.is_default:
        return engine
    copy = engine.execution_options(**placement.execution_options())
    install(copy, placement)
    return copy


def create_schema(conn: Connection, placement: Placement) -> None:
    """Create the placement's schema if it does not exist (before a migration reads it)."""
    if placement.schema is not None and conn.dialect.name == "postgresql":
        conn.exec_driver_sql(f'CREATE SCHEMA IF NOT EXISTS "{placement.schema}"')
