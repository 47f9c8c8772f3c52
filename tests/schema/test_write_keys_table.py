"""Revision h9's ``write_keys`` table: created by the upgrade on both backends, removed by the
downgrade, and recreated at open when a database at head lost it (keyed writes and session
deletes need it)."""

from __future__ import annotations

import logging

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL
from sqlalchemy.pool import NullPool

from hermes_store import SessionDB
from hermes_store.schema import migrate
from tests.support.backends import url_string


def table_names(url: URL) -> set[str]:
    engine = sa.create_engine(url_string(url), poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return set(sa.inspect(conn).get_table_names())
    finally:
        engine.dispose()


def drop_write_keys(url: URL) -> None:
    engine = sa.create_engine(url_string(url), poolclass=NullPool)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql("DROP TABLE write_keys")
    finally:
        engine.dispose()


def test_upgrade_and_downgrade(empty_url: URL) -> None:
    migrate.upgrade(empty_url, "h8_pg_bigint_counters")
    assert "write_keys" not in table_names(empty_url)
    migrate.upgrade(empty_url)
    assert "write_keys" in table_names(empty_url)
    migrate.downgrade(empty_url, "h8_pg_bigint_counters")
    assert "write_keys" not in table_names(empty_url)


def test_a_lost_table_is_recreated_at_open(db_url: URL, caplog: pytest.LogCaptureFixture) -> None:
    drop_write_keys(db_url)
    with caplog.at_level(logging.WARNING), SessionDB(url_string(db_url)) as db:
        db.create_session("s", "cli")
        first = db.append_message("s", "user", "x", idempotency_key="k")
        assert db.append_message("s", "user", "x", idempotency_key="k") == first
        assert db.delete_session("s")
    assert "created the missing write_keys table" in caplog.text
