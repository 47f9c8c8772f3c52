"""A database file with two names: refused when SQLite cannot share one WAL through them.

SQLite keeps the WAL and its index beside the name a process opened. Two processes writing
``state.db`` and a hard link ``hard.db`` to it keep two WALs and corrupt the file, so a file
with more than one link is refused at open (naming the other link when it is found). A symlink
is fine (SQLite opens the file it points to, WAL beside it), and so is the same folder reached
through a bind mount (the WAL is the same file): both are written by two real processes here.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from hermes_store import SessionDB
from hermes_store.cli import cli
from hermes_store.engine import files
from hermes_store.errors import DatabaseAliasError, StoreConfigError
from tests.support.waiting import GUARD

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def state(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "db" / "state.db"
    with SessionDB(path) as db:
        db.create_session("s", "cli")
        db.append_message("s", "user", "before")
    yield path


def _writer(
    where: str | Path, tag: str, count: int | None = None, *, prefix: tuple[str, ...] = ()
) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "tests.support.alias_workers", str(where), tag]
    if count is not None:
        command.append(str(count))
    return subprocess.Popen(
        [*prefix, *command],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen[str]) -> tuple[int, str]:
    out, err = proc.communicate(timeout=GUARD)
    return proc.returncode, out + err


def _sound(path: Path) -> dict[str, int]:
    """integrity_check passes; the number of messages written by each tag."""
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        rows = conn.execute("SELECT content FROM messages").fetchall()
    finally:
        conn.close()
    tags: dict[str, int] = {}
    for (content,) in rows:
        tag = content.split(" ", 1)[0]
        tags[tag] = tags.get(tag, 0) + 1
    return tags


def test_a_second_process_writing_through_a_hard_link_is_refused_and_the_file_stays_sound(
    state: Path,
) -> None:
    hard = state.with_name("hard.db")
    first = _writer(state, "a")  # opened while the file still has one name: it may write
    try:
        assert first.stdout is not None and first.stdout.readline() == "ready\n"
        os.link(state, hard)  # a "backup" taken while the agent runs
        code, said = _finish(_writer(hard, "b", 300))
        assert code == 3, said
        assert "refused:" in said and f"also named {state}" in said
        assert first.stdin is not None
        first.stdin.write("stop\n")
        first.stdin.flush()
        code, said = _finish(first)
    finally:
        first.kill()
    assert code == 0, said
    wrote = int(said.rsplit("wrote ", 1)[1].split()[0])
    assert _sound(state) == {"before": 1, "a": wrote}
    assert not Path(f"{hard}-wal").exists()


def test_every_name_of_a_hard_linked_file_is_refused_before_anything_is_written(
    state: Path, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    hard = elsewhere / "copy.db"
    os.link(state, hard)
    before = state.read_bytes()
    # The link is in a folder the check does not look in: refused all the same, unnamed.
    with pytest.raises(
        DatabaseAliasError, match=f"its other name is not in {state.parent}"
    ) as refused:
        SessionDB(state)
    assert isinstance(refused.value, StoreConfigError)
    with pytest.raises(DatabaseAliasError, match=f"its other name is not in {elsewhere}"):
        SessionDB(hard)
    engine = sa.create_engine(f"sqlite:///{state}")
    with pytest.raises(DatabaseAliasError):
        SessionDB(engine)
    engine.dispose()
    # Given through a symlink in the link's folder: that folder is looked in too.
    (elsewhere / "via.db").symlink_to(state)
    with pytest.raises(DatabaseAliasError, match=f"also named {hard}"):
        SessionDB(elsewhere / "via.db")
    assert state.read_bytes() == before
    assert sorted(p.name for p in elsewhere.iterdir()) == ["copy.db", "via.db"]
    hard.unlink()
    with SessionDB(elsewhere / "via.db") as db:
        assert [m["content"] for m in db.get_messages("s")] == ["before"]


@pytest.mark.parametrize("kind", ["new", "import"])
def test_a_new_database_linked_into_place_is_no_alias(state: Path, kind: str) -> None:
    """Creating a database (``new``) and importing into a new file (``import``) link a
    complete private file to its name, then remove the private name: an opener in between
    (or after a kill in between) sees two links, which must not be refused."""
    temporary = files.partial_path(state, kind)
    os.link(state, temporary)
    with SessionDB(state) as db:
        db.append_message("s", "user", "after")
    temporary.unlink()


def test_the_cli_reports_an_alias_in_one_line_and_exits_3(state: Path) -> None:
    hard = state.with_name("hard.db")
    os.link(state, hard)
    runner = CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1", "HERMES_STORE_URL": None})
    result = runner.invoke(cli, ["--db", str(hard), "stats"], catch_exceptions=False)
    assert result.exit_code == 3, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    assert f"also named {state}" in lines[0]


def test_two_processes_writing_through_a_symlink_and_the_file_share_one_wal(
    state: Path,
) -> None:
    link = state.with_name("link.db")
    link.symlink_to(state)
    writers = [
        _writer(state, "a", 300),
        _writer(link, "b", 300),
        _writer(f"sqlite:///{link}", "c", 300),  # a URL: SQLite itself resolves the link
    ]
    outcomes = [_finish(proc) for proc in writers]
    assert [code for code, _ in outcomes] == [0, 0, 0], outcomes
    assert _sound(state) == {"before": 1, "a": 300, "b": 300, "c": 300}
    assert not Path(f"{link}-wal").exists() and not Path(f"{link}-shm").exists()


def _can_bind_mount(tmp_path: Path) -> bool:
    if sys.platform != "linux" or os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    source, target = tmp_path / "probe-a", tmp_path / "probe-b"
    source.mkdir()
    target.mkdir()
    probe = [
        "unshare",
        "-m",
        "--propagation",
        "private",
        "mount",
        "--bind",
        str(source),
        str(target),
    ]
    return subprocess.run(probe, capture_output=True).returncode == 0


def test_two_processes_writing_one_folder_through_a_bind_mount_share_one_wal(
    state: Path, tmp_path: Path
) -> None:
    if not _can_bind_mount(tmp_path):
        pytest.skip("needs root and mount namespaces (unshare) to bind-mount a folder")
    mounted = tmp_path / "mounted"
    mounted.mkdir()
    # A private mount namespace: the bind mount exists only for the writer inside it.
    inside = (
        "unshare",
        "-m",
        "--propagation",
        "private",
        "sh",
        "-c",
        'mount --bind "$0" "$1" && shift && exec "$@"',
        str(state.parent),
        str(mounted),
    )
    writers = [_writer(state, "a", 300), _writer(mounted / "state.db", "b", 300, prefix=inside)]
    outcomes = [_finish(proc) for proc in writers]
    assert [code for code, _ in outcomes] == [0, 0], outcomes
    assert _sound(state) == {"before": 1, "a": 300, "b": 300}
    assert not list(mounted.iterdir())  # the mount was the writer's alone


def test_a_symlinks_sidecars_are_the_targets(tmp_path: Path) -> None:
    """SQLite keeps the WAL beside the file a symlink names, so that is where an opener must
    look before reading the file without locks (else it reads a live file torn)."""
    state = tmp_path / "state.db"
    with SessionDB(state) as db:
        db.create_session("s", "cli")
        link = tmp_path / "elsewhere" / "link.db"
        link.parent.mkdir()
        link.symlink_to(state)
        assert Path(f"{state}-wal").exists()  # open: its WAL is there
        assert files.sidecars(link) == files.sidecars(state) != []
