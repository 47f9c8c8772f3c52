"""``SessionDB(migrate=...)``: a database behind head is migrated only when asked to."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from sqlalchemy.engine import URL

from hermes_store import InvalidInputError, SessionDB
from hermes_store.cli import cli
from hermes_store.errors import NotADatabaseError, SchemaBehindError
from hermes_store.schema import migrate
from tests.support import legacy
from tests.support.backends import url_string


def _fingerprint(folder: Path) -> dict[str, str]:
    """Every file in the folder and a hash of its bytes (no handle on a database in use:
    nothing has it open here)."""
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if p.is_file()
    }


def test_check_refuses_a_legacy_file_and_changes_no_byte(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    legacy.build_legacy_db(path, 3)
    before = _fingerprint(tmp_path)
    with pytest.raises(SchemaBehindError, match=r"hermes-store db upgrade"):
        SessionDB(path, migrate="check")
    assert _fingerprint(tmp_path) == before
    with SessionDB(path) as store:  # "auto", the default, still adopts it
        assert migrate.current(path) == migrate.head_revision()
        assert store.session_count() >= 0


def test_check_refuses_an_older_revision_on_both_backends(empty_url: URL) -> None:
    migrate.upgrade(empty_url, "v5_billing_columns")
    with pytest.raises(SchemaBehindError, match="v5_billing_columns"):
        SessionDB(url_string(empty_url), migrate="check")
    assert migrate.current(empty_url) == "v5_billing_columns"
    migrate.upgrade(empty_url)
    with SessionDB(url_string(empty_url), migrate="check") as store:
        store.create_session("s", "cli")  # at head: a normal store
        assert store.get_session("s") is not None


def test_check_never_creates_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(NotADatabaseError, match="no database"):
        SessionDB(tmp_path / "missing.db", migrate="check")
    assert os.listdir(tmp_path) == []


def test_never_neither_checks_nor_migrates(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    migrate.upgrade(path, "v5_billing_columns")
    with SessionDB(path, migrate="never") as store:
        assert store.session_count() == 0
    assert migrate.current(path) == "v5_billing_columns"


def test_an_unknown_mode_is_refused_before_anything_is_opened(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="migrate must be one of"):
        SessionDB(tmp_path / "state.db", migrate="yes")  # type: ignore[arg-type]
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "command",
    [
        ["sessions", "list"],
        ["sessions", "show", "anything"],
        ["search", "hello"],
        ["stats"],
        ["export", "-o", "-"],
    ],
)
def test_cli_read_commands_never_upgrade_a_file_behind_head(
    tmp_path: Path, command: list[str]
) -> None:
    path = tmp_path / "state.db"
    legacy.build_legacy_db(path, 3)
    before = _fingerprint(tmp_path)
    result = CliRunner().invoke(cli, ["--db", str(path), *command])
    assert result.exit_code == 3, result.output
    assert "hermes-store db upgrade" in result.output
    assert len(result.output.strip().splitlines()) == 1  # one line, no traceback
    assert _fingerprint(tmp_path) == before
