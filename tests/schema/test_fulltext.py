"""The full-text strategy of each backend: one place that drops, creates, rebuilds, checks and
repairs the index, on real databases."""

from __future__ import annotations

import pytest

from hermes_store import SessionDB
from hermes_store.schema import fulltext, migrate


def test_for_dialect_names_the_backends() -> None:
    assert fulltext.for_dialect("sqlite") is fulltext.SQLITE
    assert fulltext.for_dialect("postgresql") is fulltext.POSTGRESQL
    with pytest.raises(ValueError, match="mysql"):
        fulltext.for_dialect("mysql")


def test_drop_check_rebuild_round_trip(store: SessionDB) -> None:
    store.create_session("s", "cli")
    store.append_message("s", "user", "the okapi hides in the forest")
    strategy = fulltext.for_dialect(store.engine.dialect.name)
    with store.uow.connect() as conn:
        strategy.drop(conn)
    with store.uow.connect() as conn:
        state = migrate.read_state(conn)
        damage = strategy.damage(
            state.tables, state.triggers, state.indexes, state.columns["messages"]
        )
        assert damage  # named for the repair's log
        assert not strategy.check(conn)
        conn.rollback()
    store.append_message("s", "user", "an okapi written while the index was gone")
    with store.uow.connect() as conn:
        done = strategy.repair(
            conn, state.tables, state.triggers, state.indexes, state.columns["messages"]
        )
        assert done
    with store.uow.connect() as conn:
        strategy.rebuild(conn)  # also the CJK index on SQLite, where it is due
    assert store.check_search_index()
    assert len(store.search_messages("okapi")) == 2
    with store.uow.connect() as conn:
        strategy.optimize(conn)
        state = migrate.read_state(conn)
        again = strategy.damage(
            state.tables, state.triggers, state.indexes, state.columns["messages"]
        )
    assert again == []
    assert store.check_search_index()
