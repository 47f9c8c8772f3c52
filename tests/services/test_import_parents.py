"""Parent links on import: a child is linked to its parent once both exist (possibly in a
later batch), and never into a cycle.

What must hold, on SQLite and PostgreSQL: sessions that would be each other's ancestors (A's
parent B and B's parent A, or a longer ring) are refused with ``ParentCycleError`` naming
them and the line, whether the ring closes within one batch, across batches, or through a
chain already in the database; the batch that would close it is rolled back, the batches
before it stay. A legitimate deep chain, in either order, is linked whole.
"""

from __future__ import annotations

import sqlite3

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from hermes_store import SessionDB, transfer
from hermes_store.errors import InvalidInputError
from tests.support.import_records import import_lines, parents, session

BOTH = pytest.mark.parametrize("backend", ["sqlite", "postgresql"])


@BOTH
def test_mutual_parents_in_one_batch_are_refused(store: SessionDB) -> None:
    records = [session("solo"), session("a", "b"), session("b", "a")]
    with pytest.raises(transfer.ParentCycleError) as refused:
        import_lines(store, records)
    assert str(refused.value) == (
        "line 2: the parent links 'a' -> 'b' -> 'a' form a cycle (each session would be its "
        "own ancestor): refused; its batch (lines 1-3) was rolled back; nothing was imported"
    )
    assert isinstance(refused.value, InvalidInputError)
    assert parents(store) == {}  # the batch, "solo" included, rolled back


@BOTH
def test_a_ring_of_three_closed_in_a_later_batch_is_refused(store: SessionDB) -> None:
    """A's parent C, C's parent B, B's parent A, one session per batch: A is linked to C in
    the second batch (committed), the third would close the ring and is rolled back."""
    records = [session("a", "c"), session("x"), session("c", "b"), session("b", "a")]
    with pytest.raises(transfer.ParentCycleError) as refused:
        import_lines(store, records, batch_size=1)
    assert str(refused.value) == (
        "line 4: the parent links 'b' -> 'a' -> 'c' -> 'b' form a cycle (each session would be "
        "its own ancestor): refused; its batch (line 4) was rolled back; the 3 session(s) of "
        "the batches before it stay imported"
    )
    assert parents(store) == {"a": "c", "x": None, "c": None}


@BOTH
def test_a_ring_through_a_chain_already_in_the_database_is_refused(
    store: SessionDB, db_url: URL
) -> None:
    """The database holds 'w' whose parent 'n' is gone (a file whose foreign keys were off)
    and 'v' whose parent is 'w': importing 'n' with the parent 'v' closes n -> v -> w -> n."""
    store.create_session("v0", "cli")
    plant_orphan(store, db_url, "w", "n")
    store.create_session("v", "cli", parent_session_id="w")
    records = [session("m", "v"), session("n", "v"), session("o")]
    with pytest.raises(transfer.ParentCycleError, match=r"^line 2: the parent links 'n' -> 'v' "):
        import_lines(store, records, batch_size=2)
    assert parents(store) == {"v0": None, "w": "n", "v": "w"}
    # the same file without the ring imports, every link made
    import_lines(store, [session("m", "v"), session("o", "v0")], batch_size=2)
    assert parents(store) == {"v0": None, "w": "n", "v": "w", "m": "v", "o": "v0"}


def plant_orphan(store: SessionDB, url: URL, child: str, parent: str) -> None:
    """A session whose parent does not exist, written past the foreign key as a file whose
    foreign keys were off could hold it."""
    statement = "INSERT INTO sessions (id, source, started_at, parent_session_id) VALUES "
    if url.get_backend_name() == "sqlite":
        with sqlite3.connect(url.database or "") as con:
            con.execute("PRAGMA foreign_keys=OFF")
            con.execute(statement + "(?, 'cli', 1.0, ?)", (child, parent))
        return

    def insert(conn: sa.Connection) -> None:
        conn.exec_driver_sql("SET LOCAL session_replication_role = replica")
        values = {"child": child, "parent": parent}
        conn.execute(sa.text(statement + "(:child, 'cli', 1.0, :parent)"), values)

    store.uow.run(insert)


@BOTH
@pytest.mark.parametrize("order", ["newest first", "oldest first"])
def test_a_chain_of_fifty_generations_is_linked_whole(store: SessionDB, order: str) -> None:
    """Each session the parent of the next, 50 deep, in small batches: as an export writes it
    (children before their parents) and the other way round; nothing refused."""
    chain = [session(f"g{n:02d}", f"g{n - 1:02d}" if n else None, float(n)) for n in range(50)]
    records = chain[::-1] if order == "newest first" else chain
    report = import_lines(store, records, batch_size=7)
    assert (report.sessions, report.parents_missing) == (50, 0)
    assert parents(store) == {f"g{n:02d}": f"g{n - 1:02d}" if n else None for n in range(50)}
