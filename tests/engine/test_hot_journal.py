"""A hot rollback journal in a folder that cannot be written: refused, never read ``immutable``.

A writer in rollback-journal mode (the original store's files can be in DELETE mode) that is
killed mid-transaction leaves ``state.db-journal`` holding the pages it overwrote. SQLite rolls
it back at the next open, which needs to write. In a read-only folder the store opens a file
``immutable``, and an immutable reader ignores the journal: it would read the uncommitted
transaction and its torn pages as if they were the database. Journals SQLite does not call hot
(empty, or with a zeroed header) still open read-only as before.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import textwrap
from contextlib import closing
from pathlib import Path

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from hermes_store import SessionDB
from hermes_store.cli import cli
from hermes_store.engine import files
from hermes_store.errors import ReadOnlyDatabaseError
from hermes_store.ops.backup import backup
from hermes_store.query import read_only_query
from tests.support.read_only import archived_database, read_only_folder
from tests.support.waiting import GUARD

KEPT = "kept in a read-only folder"

#: A writer in DELETE mode with a tiny cache: its transaction spills into the file (the journal
#: header then written, not zeroed) before it is killed.
_KILLED_MID_TRANSACTION = """
    c.execute("PRAGMA cache_size = 5")
    c.execute("BEGIN IMMEDIATE")
    c.execute("INSERT INTO sessions (id, source, started_at) VALUES ('UNCOMMITTED', 'cli', 1)")
    for _ in range(300):
        c.execute(
            "INSERT INTO messages (session_id, role, content, timestamp)"
            " VALUES ('s1', 'user', ?, 1)",
            ("uncommitted " * 60,),
        )
    c.execute("UPDATE messages SET content = 'CLOBBERED'")
    os.kill(os.getpid(), signal.SIGKILL)
"""

#: Journals SQLite does not call hot, each left the way a real writer leaves it.
_NOT_HOT = {
    # TRUNCATE mode cuts the journal to 0 bytes at commit.
    "empty": """
    c.execute("PRAGMA journal_mode = TRUNCATE")
    c.execute("INSERT INTO sessions (id, source, started_at) VALUES ('later', 'cli', 1)")
    """,
    # PERSIST mode zeroes the journal's header at commit.
    "zeroed-header": """
    c.execute("PRAGMA journal_mode = PERSIST")
    c.execute("INSERT INTO sessions (id, source, started_at) VALUES ('later', 'cli', 1)")
    """,
    # Killed before anything reached the file: the header is only written (unzeroed) then.
    "killed-before-spilling": """
    c.execute("BEGIN IMMEDIATE")
    c.execute("INSERT INTO sessions (id, source, started_at) VALUES ('UNCOMMITTED', 'cli', 1)")
    os.kill(os.getpid(), signal.SIGKILL)
    """,
}


def _write(path: Path, body: str) -> None:
    """Run ``body`` as another process's plain SQLite writer on ``path``, in DELETE mode."""
    script = "import os, signal, sqlite3, sys\n" + textwrap.dedent(
        """
        c = sqlite3.connect(sys.argv[1], isolation_level=None)
        c.execute("PRAGMA journal_mode = DELETE")
        """
    )
    script += textwrap.dedent(body)
    subprocess.run([sys.executable, "-c", script, str(path)], timeout=GUARD, check=False)


@pytest.fixture
def hot(tmp_path: Path) -> Path:
    """``folder/state.db`` with the hot journal of a writer killed mid-transaction."""
    path = archived_database(tmp_path / "ro", "s1", KEPT)
    _write(path, _KILLED_MID_TRANSACTION)
    journal = Path(f"{path}-journal")
    assert journal.stat().st_size > 0 and journal.read_bytes()[:1] != b"\0"
    return path


def _untouched(path: Path) -> tuple[bytes, bytes]:
    return path.read_bytes(), Path(f"{path}-journal").read_bytes()


def test_a_hot_journal_in_a_read_only_folder_is_refused(hot: Path) -> None:
    before = _untouched(hot)
    with read_only_folder(hot.parent):
        # What the refusal spares the caller: the file read without its journal is torn.
        with closing(sqlite3.connect(f"file:{hot}?immutable=1", uri=True)) as torn:
            assert torn.execute("SELECT 1 FROM sessions WHERE id = 'UNCOMMITTED'").fetchone()
        with pytest.raises(ReadOnlyDatabaseError, match="hot rollback journal"):
            SessionDB(hot, migrate="never")
    assert _untouched(hot) == before
    # Where the folder can be written, opening rolls the journal back: nothing was lost.
    with SessionDB(hot, migrate="never") as db:
        assert db.get_session("UNCOMMITTED") is None
        assert [m["content"] for m in db.get_messages("s1")] == [KEPT]
    assert not Path(f"{hot}-journal").exists()


@pytest.mark.parametrize("mode", ["auto", "check"])
def test_a_hot_journal_where_the_folder_can_be_written_is_rolled_back_at_open(
    hot: Path, mode: str
) -> None:
    """The default open (and the CLI's read commands, ``check``) looked at the file read-only
    first, which SQLite refuses while a hot journal waits ("attempt to write a readonly
    database"): a file the original store left that way could not be adopted. The open now
    rolls the journal back first, as any SQLite open that may write does."""
    with SessionDB(hot, migrate=mode) as db:  # type: ignore[arg-type]
        assert db.get_session("UNCOMMITTED") is None
        assert [m["content"] for m in db.get_messages("s1")] == [KEPT]
    assert not Path(f"{hot}-journal").exists()
    with closing(sqlite3.connect(hot)) as raw:
        assert raw.execute("PRAGMA integrity_check").fetchone() == ("ok",)


def test_query_and_backup_refuse_a_hot_journal_in_a_read_only_folder(
    hot: Path, tmp_path: Path
) -> None:
    copy = tmp_path / "copy.db"
    with read_only_folder(hot.parent):
        with pytest.raises(ReadOnlyDatabaseError, match="hot rollback journal"):
            read_only_query(str(hot), "SELECT count(*) FROM sessions")
        engine = sa.create_engine(files.sqlite_uri(hot))
        try:
            with pytest.raises(ReadOnlyDatabaseError, match="hot rollback journal"):
                backup(engine, copy)
        finally:
            engine.dispose()
        done = CliRunner().invoke(cli, ["--db", str(hot), "query", "SELECT 1 FROM sessions"])
    assert not copy.exists()
    assert done.exit_code == 3, done.output
    assert "Traceback" not in done.stderr
    assert "hot rollback journal" in done.stderr


@pytest.mark.parametrize("journal", sorted(_NOT_HOT))
def test_a_journal_that_is_not_hot_still_opens_read_only(tmp_path: Path, journal: str) -> None:
    path = archived_database(tmp_path / "ro", "s1", KEPT)
    _write(path, _NOT_HOT[journal])
    assert Path(f"{path}-journal").exists()
    with read_only_folder(path.parent):
        assert not os.access(path.parent, os.W_OK)
        with SessionDB(path, migrate="never") as db:
            assert db.get_session("UNCOMMITTED") is None
            assert [m["content"] for m in db.get_messages("s1")] == [KEPT]
        rows = read_only_query(str(path), "SELECT count(*) FROM messages").rows
        assert rows == [(1,)]
