"""What killed backups and builds leave behind: a backup removes the copies killed backups left
in its folder under any name (a dated name is never backed up to again), never a live
backup's, never anything that is not exactly such a copy, never through a link; ``doctor``
names what killed builds left beside the database. Real files, real processes: the copies
are left by backups killed with SIGKILL in the middle of their copy."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from sqlalchemy.engine import URL

from hermes_store import SessionDB
from hermes_store.cli import cli
from hermes_store.engine import files
from hermes_store.ops import backup, health
from tests.support.leftover_workers import held_backup

#: Old enough for a backup to remove a dead copy of another name (and then some).
LONG_AGO = time.time() - backup.OTHER_COPIES_STALE_AFTER_S - 600


TURNS = range(500)


def _database(path: Path) -> Path:
    """Enough pages for a copy in steps, and for ``VACUUM INTO`` to call its progress handler."""
    with SessionDB(path) as store:
        for number in range(10):
            store.create_session(f"s{number}", "cli")
            store.append_messages(
                f"s{number}",
                [
                    {"role": "user", "content": f"turn {turn} of {number} " * 8}
                    for turn in range(500)
                ],
            )
    return path


def _killed_backup(database: Path, target: Path, method: str = "backup") -> list[Path]:
    """Back ``database`` up to ``target`` and SIGKILL it in the middle of its copy: what it
    left in the target's folder (its private copy, with ``vacuum`` its journal too)."""
    before = set(target.parent.iterdir())
    with held_backup(database, target, method) as child:
        child.send_signal(signal.SIGKILL)
        child.communicate()
    new = set(target.parent.iterdir()) - before  # the database's own -wal and -shm, too
    left = sorted(p for p in new if p.name.startswith(f".{target.name}."))
    assert left and all(p.name.startswith(f".{target.name}.{child.pid}.") for p in left), left
    return left


def _dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _age(*paths: Path) -> None:
    for path in paths:
        os.utime(path, (LONG_AGO, LONG_AGO), follow_symlinks=False)


@pytest.mark.parametrize("method", ["backup", "vacuum"])
def test_a_backup_removes_old_copies_killed_backups_left_under_other_names(
    tmp_path: Path, method: str
) -> None:
    database = _database(tmp_path / "state.db")
    folder = tmp_path / "backups"
    folder.mkdir()
    left = _killed_backup(database, folder / "state-2026-12-06.db", method)
    if method == "vacuum":
        assert any(p.name.endswith(".backup-journal") for p in left), left
    _age(*left)
    with SessionDB(database) as store:
        backup.backup(store.engine, folder / "state-2026-12-07.db", method=method)
    assert sorted(p.name for p in folder.iterdir()) == ["state-2026-12-07.db"]


def test_a_young_dead_copy_of_another_name_is_kept_and_one_of_the_same_name_goes(
    tmp_path: Path,
) -> None:
    """The age keeps a backup that runs elsewhere (its pid means nothing here) from losing
    its copy; a copy of the very name being written is removed at once, as before."""
    database = _database(tmp_path / "state.db")
    folder = tmp_path / "backups"
    folder.mkdir()
    other = _killed_backup(database, folder / "state-2026-12-06.db")
    same = _killed_backup(database, folder / "state-2026-12-07.db")
    with SessionDB(database) as store:
        backup.backup(store.engine, folder / "state-2026-12-07.db")
    assert sorted(folder.iterdir()) == sorted([*other, folder / "state-2026-12-07.db"])
    assert not any(p.exists() for p in same)


def test_a_live_backups_copy_is_never_removed_however_old(tmp_path: Path) -> None:
    database = _database(tmp_path / "state.db")
    folder = tmp_path / "backups"
    folder.mkdir()
    with held_backup(database, folder / "state-2026-12-06.db") as running:
        copies = [p for p in folder.iterdir() if p.name.endswith(".backup")]
        assert len(copies) == 1
        _age(*copies)
        with SessionDB(database) as store:
            backup.backup(store.engine, folder / "state-2026-12-07.db")
        assert all(p.exists() for p in copies)  # the live backup's copy is its own
        assert running.poll() is None
        assert _leftovers(folder / "state-2026-12-07.db").status == "ok"  # nor named
    assert "state-2026-12-07.db" in {p.name for p in folder.iterdir()}


def test_a_backup_removes_nothing_that_is_not_exactly_a_dead_copy(tmp_path: Path) -> None:
    database = _database(tmp_path / "state.db")
    folder = tmp_path / "backups"
    folder.mkdir()
    dead, hexa = _dead_pid(), "0123456789abcdef"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    precious = elsewhere / "precious.db"
    precious.write_bytes(b"keep me")
    kept_files = [
        "state-2026-12-06.db",  # a backup
        ".state-2026-12-06.db.backup",  # no pid, no hex
        f".state-2026-12-06.db.{dead}.nothexnothexnoth.backup",
        f".state-2026-12-06.db.{dead}.{hexa}.backupx",
        f".state-2026-12-06.db.{dead}.{hexa}.backup.old",
        f".state-2026-12-06.db.{dead}.{hexa}.import",  # a build of another kind
        f"state-2026-12-06.db.{dead}.{hexa}.backup",  # not hidden: not the package's name
        f".state-2026-12-06.db.{hexa}.backup",  # no pid: never judged by another name
        f"..{dead}.{hexa}.backup-wal.x",
    ]
    for name in kept_files:
        (folder / name).write_bytes(b"x")
    link = folder / f".linked.db.{dead}.{hexa}.backup"
    link.symlink_to(precious)
    dangling = folder / f".dangling.db.{dead}.{hexa}.backup"
    dangling.symlink_to(elsewhere / "nothing")
    folder_named = folder / f".folder.db.{dead}.{hexa}.backup"
    folder_named.mkdir()
    removed = [f".gone.db.{dead}.{hexa}.backup", f".gone.db.{dead}.{hexa}.backup-journal"]
    for name in removed:
        (folder / name).write_bytes(b"x")
    _age(*folder.iterdir())
    with SessionDB(database) as store:
        backup.backup(store.engine, folder / "state-2026-12-07.db")
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [*kept_files, link.name, dangling.name, folder_named.name, "state-2026-12-07.db"]
    )
    assert precious.read_bytes() == b"keep me"


def _leftovers(database: Path) -> health.Check:
    checks = health.run_doctor(URL.create("sqlite", database=str(database)))
    return next(check for check in checks if check.name == "leftover files")


def test_doctor_names_what_killed_builds_left_beside_the_database(tmp_path: Path) -> None:
    database = _database(tmp_path / "state.db")
    assert _leftovers(database).status == "ok"
    copy = _killed_backup(database, tmp_path / "state-2026-12-07.db", "vacuum")
    dead, hexa = _dead_pid(), "fedcba9876543210"
    imported = tmp_path / f".state.db.{dead}.{hexa}.import"
    imported.write_bytes(b"x")
    Path(f"{imported}-wal").write_bytes(b"x")
    found = _leftovers(database)
    assert found.status == "warn", found
    for path in [*copy, imported, Path(f"{imported}-wal")]:
        assert str(path) in found.detail, (path, found.detail)
    assert found.detail.startswith(f"{len(copy) + 2} file(s) left by killed builds")

    result = CliRunner().invoke(cli, ["--db", str(database), "doctor", "--json"])
    assert result.exit_code == 0, result.output  # a warning: the database is sound
    assert str(imported) in result.stdout


def test_doctor_does_not_name_a_live_backups_copy_nor_what_is_no_leftover(
    tmp_path: Path,
) -> None:
    database = _database(tmp_path / "state.db")
    dead, hexa = _dead_pid(), "fedcba9876543210"
    for name in (f".state.db.{hexa}.new", f".state.db.{dead}.{hexa}.newer", "state.db.bak"):
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / f".state.db.{dead}.{hexa}.import").symlink_to(tmp_path / "state.db.bak")
    with held_backup(database, tmp_path / "state-2026-12-07.db") as running:
        copies = [p for p in tmp_path.iterdir() if p.name.endswith(".backup")]
        assert len(copies) == 1
        assert _leftovers(database).status == "ok"
        assert files.dead_partials(tmp_path, files.PARTIAL_KINDS) == []
        running.send_signal(signal.SIGKILL)
        running.communicate()
    assert files.dead_partials(tmp_path, files.PARTIAL_KINDS) == copies  # now it is dead
