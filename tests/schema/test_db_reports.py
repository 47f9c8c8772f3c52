"""What the ``db`` commands report, as library calls: where a database stands
(``state_of``, ``revision_of``, ``current``), an upgrade that says where it started
(``run_upgrade``), and the comparison with the models that changes nothing (``check_drift``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL
from sqlalchemy.pool import NullPool

from hermes_store.errors import SchemaTooNewError
from hermes_store.ops import health
from hermes_store.schema import migrate
from tests.support import legacy, proc_workers
from tests.support.backends import url_string

HEAD = migrate.head_revision()


def _execute(url: URL, sql: str) -> None:
    engine = sa.create_engine(url, poolclass=NullPool)
    with engine.begin() as conn:
        conn.exec_driver_sql(sql)
    engine.dispose()


def test_nothing_there_yet(empty_url: URL) -> None:
    state = migrate.state_of(empty_url)
    assert state is None or state.is_empty  # SQLite: no file; PostgreSQL: an empty database
    assert migrate.revision_of(state) is None and migrate.current(empty_url) is None
    report = migrate.check_drift(empty_url)
    assert (report.exists, report.compared, report.drifted) == (False, False, False)
    assert report.head == HEAD


def test_a_fresh_upgrade_reports_from_nothing_to_head(empty_url: URL) -> None:
    report = migrate.run_upgrade(empty_url)
    assert report == migrate.UpgradeReport(before=None, after=HEAD, adopted_version=None)
    state = migrate.state_of(empty_url)
    assert state is not None and state.revision == HEAD
    assert migrate.revision_of(state) == migrate.current(url_string(empty_url)) == HEAD


def test_an_upgrade_from_a_revision_reports_it(empty_url: URL) -> None:
    migrate.upgrade(empty_url, "v5_billing_columns")
    report = migrate.run_upgrade(empty_url)
    assert (report.before, report.after, report.adopted_version) == (
        "v5_billing_columns",
        HEAD,
        None,
    )
    assert migrate.run_upgrade(empty_url).before == HEAD  # again: nothing to do


def test_an_adoption_reports_the_original_stores_version(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    legacy.build_legacy_db(path, 3)
    state = migrate.state_of(path)
    assert state is not None and state.is_legacy and state.schema_version == 3
    assert migrate.revision_of(state) == migrate.current(path) == "v3_session_title"
    report = migrate.run_upgrade(path)
    assert report == migrate.UpgradeReport(before="v3_session_title", after=HEAD, adopted_version=3)
    assert migrate.current(path) == HEAD


def test_a_newer_releases_file_is_refused_or_described(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    migrate.upgrade(path)
    _execute(
        URL.create("sqlite", database=str(path)), "UPDATE alembic_version SET version_num='v99'"
    )
    with pytest.raises(SchemaTooNewError):
        migrate.state_of(path)
    with pytest.raises(SchemaTooNewError):
        migrate.run_upgrade(path)  # refused by the first read: nothing written
    described = migrate.state_of(path, adoptable=False)
    assert described is not None and described.revision == "v99"


def test_a_database_at_head_matches_the_models_until_it_drifts(db_url: URL) -> None:
    report = migrate.check_drift(db_url)
    assert report == migrate.DriftReport(exists=True, revision=HEAD, head=HEAD, compared=True)
    assert not report.drifted
    _execute(db_url, "ALTER TABLE sessions ADD COLUMN mood TEXT")
    drifted = migrate.check_drift(url_string(db_url))
    assert drifted.compared and drifted.drifted
    assert drifted.differences is not None and "mood" in drifted.differences


def test_a_database_behind_head_is_not_compared(empty_url: URL) -> None:
    migrate.upgrade(empty_url, "v5_billing_columns")
    report = migrate.check_drift(empty_url)
    assert (report.exists, report.revision, report.compared, report.drifted) == (
        True,
        "v5_billing_columns",
        False,
        False,
    )


def test_a_legacy_file_at_the_last_version_is_compared_without_being_changed(
    tmp_path: Path,
) -> None:
    """Adopted and brought to head inside a transaction that is rolled back."""
    path = tmp_path / "state.db"
    legacy.build_legacy_db(path, 6)
    before = legacy.dump_rows(path)
    report = migrate.check_drift(path)
    assert report.compared and not report.drifted
    assert report.revision == migrate.revision_for_version(6)
    state = migrate.state_of(path)
    assert state is not None and state.is_legacy  # still not adopted
    assert legacy.dump_rows(path) == before


def test_an_older_legacy_file_is_not_compared(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    legacy.build_legacy_db(path, 3)
    report = migrate.check_drift(path)
    assert report.exists and not report.compared and report.revision == "v3_session_title"
    state = migrate.state_of(path)
    assert state is not None and state.is_legacy


def test_comparing_a_legacy_file_waits_for_another_processs_writer(tmp_path: Path) -> None:
    """Another process holds the write lock for 1.5 s (past the writer's 1 s busy timeout):
    the rolled-back adoption waits for it with the migrations' retries, instead of failing
    at once with "database is locked"."""
    path = tmp_path / "state.db"
    legacy.build_legacy_db(path, 6)
    holder, ready = proc_workers.spawn(proc_workers.hold_write_lock, str(path), 1.5)
    try:
        assert ready.wait(timeout=120), "the other process never took the lock"
        report = migrate.check_drift(path)
    finally:
        holder.join(timeout=60)
    assert holder.exitcode == 0
    assert report.compared and not report.drifted
    state = migrate.state_of(path)
    assert state is not None and state.is_legacy  # still not adopted


def _drop_title(url: URL) -> None:
    engine = sa.create_engine(url, poolclass=NullPool)
    with engine.begin() as conn:
        if conn.dialect.name == "sqlite":  # SQLite keeps an index on a column it drops
            for name in conn.exec_driver_sql(
                "SELECT name FROM sqlite_master WHERE type = 'index' "
                "AND tbl_name = 'sessions' AND sql LIKE '%title%'"
            ).scalars():
                conn.exec_driver_sql(f'DROP INDEX "{name}"')
        conn.exec_driver_sql("ALTER TABLE sessions DROP COLUMN title")
    engine.dispose()


#: Damage Alembic's comparison with the models does not all see, and what the reports name.
_DAMAGE: dict[str, tuple[Callable[[URL], None], str, str]] = {
    "a column gone": (_drop_title, "lacks columns ['title']", "restore it from a backup"),
    "write_keys gone": (
        lambda url: _execute(url, "DROP TABLE write_keys"),
        "the write_keys table is missing",
        "repairs it from the data",
    ),
    "schema_version wrong": (
        lambda url: _execute(url, "UPDATE schema_version SET version = 5"),
        "schema_version 5",
        "repairs it from the data",
    ),
}


@pytest.mark.parametrize("case", sorted(_DAMAGE))
def test_damage_at_head_is_reported_by_doctor_and_db_check(db_url: URL, case: str) -> None:
    """``doctor`` said "Healthy." (exit 0) on a database at head without its ``title`` column
    or its ``write_keys`` table, which every listing or keyed write then failed on; ``db
    check`` saw no drift where the models do not describe what was gone."""
    damage, named, advice = _DAMAGE[case]
    damage(db_url)
    [schema] = [check for check in health.run_doctor(db_url) if check.name == "schema"]
    assert schema.status == "error" and named in schema.detail and advice in schema.detail
    drift = migrate.check_drift(db_url)
    assert drift.drifted and drift.differences is not None and named in drift.differences
