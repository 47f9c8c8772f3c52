"""A pool whose connections all stay busy gives a package error, not SQLAlchemy's raw
``TimeoutError`` (a gateway catching ``HermesStoreError`` must see it)."""

from __future__ import annotations

import pytest
from sqlalchemy.engine import URL

from hermes_store import DatabaseUnavailableError, HermesStoreError, SessionDB
from hermes_store.engine.factory import create_engine
from tests.support.backends import url_string


def test_an_exhausted_pool_is_a_package_error(pg_url: URL) -> None:
    engine = create_engine(url_string(pg_url), pool_size=1, max_overflow=0, pool_timeout=0.2)
    db = SessionDB(engine)
    try:
        db.create_session("busy", "cli")
        with engine.connect():  # the pool's only connection, held
            with (
                pytest.raises(DatabaseUnavailableError, match="came free in time") as caught,
                db.transaction(),
            ):
                db.append_message("busy", "user", "never sent")
            assert isinstance(caught.value, HermesStoreError)
        assert db.message_count("busy") == 0  # nothing was written
    finally:
        db.close()
        engine.dispose()
