"""A table or column taken from under an open store (a downgrade run meanwhile, the database
dropped and created again, a table dropped by hand) is a package error naming what is gone,
not SQLAlchemy's ``OperationalError: no such table`` or ``ProgrammingError: UndefinedTable``;
nothing is written."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from sqlalchemy.engine import URL

from hermes_store import SessionDB, UnrecognizedSchemaError
from hermes_store.schema import migrate
from tests.support.backends import reset_pg, run_sql, url_string

#: How the schema is taken away, and a call that then needs what went.
_TAKEN: dict[str, tuple[Callable[[URL], None], Callable[[SessionDB], object]]] = {
    "write_keys dropped": (
        lambda url: run_sql(url, "DROP TABLE write_keys"),
        lambda db: db.append_message("s", "user", "keyed", idempotency_key="k-1"),
    ),
    "downgraded": (
        lambda url: migrate.downgrade(url, "v5_billing_columns"),
        lambda db: db.append_message("s", "assistant", "x", reasoning="why"),
    ),
    "downgraded, read": (
        lambda url: migrate.downgrade(url, "v5_billing_columns"),
        lambda db: db.get_messages("s"),
    ),
}


@pytest.mark.parametrize("case", sorted(_TAKEN))
def test_a_schema_taken_from_under_an_open_store_is_named(db_url: URL, case: str) -> None:
    take, call = _TAKEN[case]
    with SessionDB(url_string(db_url)) as db:
        db.create_session("s", "cli")
        take(db_url)
        with pytest.raises(UnrecognizedSchemaError, match="lacks a table or column"):
            call(db)


def test_a_postgresql_database_created_again_empty_is_named(pg_url: URL) -> None:
    """The fleet's database dropped and created again: every call failed with a raw
    ``UndefinedTable`` until the gateways restarted."""
    with SessionDB(url_string(pg_url)) as db:
        db.create_session("s", "cli")
        reset_pg(pg_url)
        for call in (
            lambda: db.append_message("s", "user", "after"),
            lambda: db.update_token_counts("s", input_tokens=1),
            lambda: db.get_session("s"),
        ):
            with pytest.raises(UnrecognizedSchemaError, match="lacks a table or column"):
                call()
