"""What the store sends to the database, and how the database plans it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import event

from hermes_store import SessionDB
from hermes_store.engine.factory import autocommit_engine


@contextmanager
def captured_selects(store: SessionDB) -> Iterator[list[tuple[str, Any]]]:
    """Every SELECT the store sends while the block runs (statement, parameters)."""
    seen: list[tuple[str, Any]] = []

    def capture(conn: Any, cursor: Any, statement: str, params: Any, *args: Any) -> None:
        if statement.lstrip().upper().startswith(("SELECT", "WITH")):
            seen.append((statement, params))

    # PostgreSQL runs reads outside a unit on the engine's autocommit twin; the async store
    # names its own engines.
    engines = getattr(store, "statement_engines", None) or (
        [store.engine] if store.is_sqlite else [store.engine, autocommit_engine(store.engine)]
    )
    for engine in engines:
        event.listen(engine, "before_cursor_execute", capture)
    try:
        yield seen
    finally:
        for engine in engines:
            event.remove(engine, "before_cursor_execute", capture)


def explain(store: SessionDB, statement: str, params: Any) -> str:
    """The plan as text; on PostgreSQL with seq scans off, so tiny tables show usable indexes."""
    with store.engine.begin() as conn:
        if store.is_sqlite:
            rows = conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", params)
            return "\n".join(str(row[-1]) for row in rows)
        conn.exec_driver_sql("SET LOCAL enable_seqscan = off")
        return "\n".join(row[0] for row in conn.exec_driver_sql(f"EXPLAIN {statement}", params))
