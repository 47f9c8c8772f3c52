"""Adoption of ``state.db`` files written by the original store, the refusal of anything else,
and the two stores sharing one file (files stay readable and writable by the original store's code).

Each legacy file is built as the original store left it (``tests/support/legacy.py``) and adopted
three ways: ``hermes_store.upgrade(path)``, opening ``SessionDB(path)``, and the ``alembic
upgrade head`` command line.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

import hermes_store
from hermes_store import (
    NotADatabaseError,
    SchemaError,
    SchemaTooNewError,
    SessionDB,
    UnrecognizedSchemaError,
)
from hermes_store.schema import ddl, migrate
from hermes_store.search.query import unsegmented
from tests.support import legacy, proc_workers
from tests.support.backends import reset_pg, url_string
from tests.support.migration_checks import (
    CJK_OBJECTS,
    FTS_TRIGGERS,
    HEAD,
    alembic_cli,
    alembic_revision,
    cjk_index_ids,
    cjk_objects,
    file_state,
    fts_integrity_check,
    full_text_ids,
    plain_engine,
    schema_version,
    table_names,
)
from tests.support.seed_store import SeedSessionDB

LEGACY_CASES = [pytest.param(v, False, id=f"v{v}") for v in range(1, 7)] + [
    pytest.param(v, True, id=f"v{v}-with-later-columns") for v in range(1, 6)
]
ADOPTERS = ("upgrade", "SessionDB", "alembic")

#: The value each post-v1 column holds in a row written before the column existed.
DEFAULTS: dict[str, tuple[str, Any]] = {
    column: ("integer", 0) if "DEFAULT 0" in decl else ("null", None)
    for alters in legacy.VERSION_ALTERS.values()
    for _table, column, decl, _quoted in alters
}


def sqlite_url(path: Path) -> URL:
    return sa.make_url(f"sqlite:///{path}")


def adopt(how: str, path: Path, tmp_path: Path) -> None:
    """Bring a file to head the way ``how`` names (each must adopt a legacy file)."""
    if how == "upgrade":
        assert hermes_store.upgrade(path) == HEAD
    elif how == "SessionDB":
        db = SessionDB(path)
        try:
            assert db.get_session(legacy.S_ROOT) is not None
        finally:
            db.close()
    else:
        result = alembic_cli("upgrade", "head", env_url=f"sqlite:///{path}", tmp_path=tmp_path)
        assert result.returncode == 0, result.stderr


def seed_v6_signature(tmp_path: Path) -> dict[str, Any]:
    reference = tmp_path / "seed_v6.db"
    legacy.build_from_ddl(reference)
    return legacy.schema_signature(reference, trigger_sql=True)


def assert_seed_can_use(path: Path) -> int:
    """The original store opens the file, finds old content, appends and finds that too.
    Returns the id of the appended message."""
    seed = SeedSessionDB(path)
    try:
        assert seed.get_session(legacy.S_ROOT)["source"] == "cli"  # type: ignore[index]
        assert [m["id"] for m in seed.search_messages("zebracorn")] == [6]
        new_id = seed.append_message(legacy.S_TG, "user", "the original store saw a quagga")
        assert [m["id"] for m in seed.search_messages("quagga")] == [new_id]
    finally:
        seed.close()
    return new_id


# -- adoption -----------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ADOPTERS)
@pytest.mark.parametrize(("version", "later_columns"), LEGACY_CASES)
def test_adopts_legacy_file(tmp_path: Path, version: int, later_columns: bool, how: str) -> None:
    """A file at v{version} with rows: nothing lost, new columns at their defaults, version 6,
    stamped at head, the original v6 schema, old content searchable, still usable by the
    original store."""
    path = tmp_path / "state.db"
    legacy.build_legacy_db(path, version, extra_later_columns=later_columns)
    before = legacy.dump_rows(path, typed=True)
    assert before == legacy.expected_rows(version, extra_later_columns=later_columns, typed=True)

    adopt(how, path, tmp_path)

    after = legacy.dump_rows(path, typed=True)
    for table in ("sessions", "messages"):
        assert len(after[table]) == len(before[table])
        for old, new in zip(before[table], after[table], strict=True):
            assert {c: new[c] for c in old} == old  # every value, with its storage class
            assert {c: new[c] for c in new if c not in old} == {
                c: DEFAULTS[c] for c in new if c not in old
            }
    url = sqlite_url(path)
    assert schema_version(url) == 6
    assert alembic_revision(url) == HEAD
    assert legacy.schema_signature(path, trigger_sql=True) == seed_v6_signature(tmp_path)
    assert full_text_ids(url, "zebracorn") == [6]
    fts_integrity_check(path)
    # Stamped at the matching v-revision, then upgraded through h7_cjk_index: the old CJK
    # messages are in the CJK index, schema_version still 6.
    with_cjk = [
        row["id"][1]
        for row in after["messages"]
        if row["content"][1] and unsegmented(row["content"][1])
    ]
    assert with_cjk and cjk_objects(path) == CJK_OBJECTS
    assert cjk_index_ids(path) == with_cjk

    new_id = assert_seed_can_use(path)
    assert schema_version(url) == 6 and alembic_revision(url) == HEAD
    fts_integrity_check(path)
    db = SessionDB(path)  # and back in hermes_store, the original store's message is there
    try:
        assert [m["id"] for m in db.get_messages(legacy.S_TG)][-1] == new_id
        assert db.check_search_index()
    finally:
        db.close()


def test_legacy_file_without_fts_is_indexed_on_adoption(tmp_path: Path) -> None:
    """A legacy file whose FTS objects are gone gets them back, indexing the old content."""
    path = tmp_path / "state.db"
    legacy.build_legacy_db(path, 4)
    legacy.drop_full_text(path)
    assert hermes_store.upgrade(path) == HEAD
    assert full_text_ids(sqlite_url(path), "zebracorn") == [6]
    assert sorted(legacy.schema_signature(path)["triggers"]) == FTS_TRIGGERS
    fts_integrity_check(path)


@pytest.mark.parametrize("how", ADOPTERS)
def test_an_index_the_original_store_created_empty_is_filled_on_adoption(
    tmp_path: Path, how: str
) -> None:
    """A legacy file without FTS objects, opened first by the original store: its ``CREATE
    ... IF NOT EXISTS`` makes an empty external-content index and its triggers, which hold
    only what it writes since. Adoption sees that the index holds fewer messages than there
    are and rebuilds it: the old messages are found (they were not, and nothing repaired it)."""
    path = tmp_path / "state.db"
    legacy.build_legacy_db(path, 3)
    legacy.drop_full_text(path)
    seed = SeedSessionDB(path)
    try:
        since = seed.append_message(legacy.S_TG, "user", "written after the index: a quagga")
    finally:
        seed.close()
    adopt(how, path, tmp_path)
    url = sqlite_url(path)
    assert full_text_ids(url, "zebracorn") == [6]
    assert full_text_ids(url, "quagga") == [since]
    fts_integrity_check(path)
    with SessionDB(path) as db:
        assert db.check_search_index()


def test_a_sound_index_is_not_rebuilt_on_adoption(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The check that finds an index missing messages costs two counts: a sound index is
    kept as it is (no rebuild under the write lock)."""
    path = tmp_path / "state.db"
    legacy.build_legacy_db(path, 6)
    with caplog.at_level("INFO", logger="hermes_store.schema.migrate"):
        assert hermes_store.upgrade(path) == HEAD
    assert not [r for r in caplog.records if "built the full-text index" in r.getMessage()]
    assert full_text_ids(sqlite_url(path), "zebracorn") == [6]


SHARED_TITLE = "Same title"


@pytest.mark.parametrize("how", ADOPTERS)
def test_a_v3_file_with_shared_titles_is_refused_naming_them(tmp_path: Path, how: str) -> None:
    """Version 3 let two sessions share a title; version 4's unique index cannot be built on
    them. A package error names the titles and what to do (it was a raw IntegrityError, and a
    traceback from Alembic), and nothing is changed; once retitled, the file is adopted."""
    path = tmp_path / "state.db"
    legacy.build_legacy_db(path, 3)
    with sqlite3.connect(path) as con:
        con.execute(
            "UPDATE sessions SET title = ? WHERE id IN (?, ?)",
            (SHARED_TITLE, legacy.S_ROOT, legacy.S_CHILD),
        )
    con.close()
    before = legacy.dump_rows(path, typed=True)
    digest = file_state(path)[0]
    found = r"1 title\(s\) are held by several sessions each \('Same title' \(2 sessions\)\)"
    if how == "alembic":
        result = alembic_cli("upgrade", "head", env_url=f"sqlite:///{path}", tmp_path=tmp_path)
        output = result.stdout + result.stderr
        assert result.returncode != 0 and "Traceback" not in output, output
        failed = [line for line in output.splitlines() if line.startswith("FAILED: ")]
        assert len(failed) == 1 and re.search(found, failed[0]), output
        assert "set_session_title" in failed[0]
    else:
        with pytest.raises(UnrecognizedSchemaError, match=found) as caught:
            if how == "upgrade":
                hermes_store.upgrade(path)
            else:
                SessionDB(path)
        assert str(path) in str(caught.value) and "nothing was changed" in str(caught.value)
    assert file_state(path)[0] == digest
    assert legacy.dump_rows(path, typed=True) == before
    assert "alembic_version" not in table_names(sqlite_url(path))

    with sqlite3.connect(path) as con:
        con.execute("UPDATE sessions SET title = 'Renamed' WHERE id = ?", (legacy.S_CHILD,))
    con.close()
    assert hermes_store.upgrade(path) == HEAD


@pytest.mark.parametrize("how", ADOPTERS)
@pytest.mark.parametrize("version", [6, 3, 1])
def test_a_schema_version_without_its_row_is_adopted_as_the_original_store_does(
    tmp_path: Path, version: int, how: str
) -> None:
    """The original store stopped between creating its tables and writing its version row:
    it opens such a file and writes the row. hermes_store adopts it at the version its tables'
    shape tells and writes the row too (it refused it, saying it had no schema_version while
    naming that table), and the original store keeps using it."""
    path = tmp_path / "state.db"
    legacy.build_legacy_db(path, version)
    with sqlite3.connect(path) as con:
        con.execute("DELETE FROM schema_version")
    con.close()
    before = legacy.dump_rows(path, typed=True)
    adopt(how, path, tmp_path)
    url = sqlite_url(path)
    assert alembic_revision(url) == HEAD and schema_version(url) == 6
    assert count(url, "schema_version") == 1
    after = legacy.dump_rows(path, typed=True)
    assert [{c: row[c] for c in before["messages"][0]} for row in after["messages"]] == before[
        "messages"
    ]
    assert legacy.schema_signature(path, trigger_sql=True) == seed_v6_signature(tmp_path)
    assert_seed_can_use(path)
    assert count(url, "schema_version") == 1


def test_alembic_check_leaves_a_legacy_file_as_it_was(tmp_path: Path) -> None:
    """``alembic check`` only reads: it no longer creates an empty alembic_version table in a
    file the original store wrote."""
    path = tmp_path / "state.db"
    legacy.build_legacy_db(path, 3)
    before = file_state(path)
    result = alembic_cli("check", env_url=f"sqlite:///{path}", tmp_path=tmp_path)
    assert "Traceback" not in result.stdout + result.stderr
    assert "alembic_version" not in table_names(sqlite_url(path))
    assert file_state(path) == before


def test_seed_reads_and_writes_a_hermes_file(tmp_path: Path) -> None:
    """A file created and written by hermes_store is a valid state.db for the original store,
    and what the original store writes into it is read back by hermes_store."""
    path = tmp_path / "state.db"
    db = SessionDB(path)
    try:
        db.create_session("h-root", "cli", model="m1", model_config={"t": 0.5})
        db.set_session_title("h-root", "Hermes wrote this")
        db.append_message("h-root", "user", "hello from the ibex")
        db.append_message("h-root", "assistant", "ok", finish_reason="stop", reasoning="r")
        db.update_token_counts("h-root", input_tokens=10, output_tokens=5)
    finally:
        db.close()
    signature = legacy.schema_signature(path, trigger_sql=True)
    assert signature == seed_v6_signature(tmp_path)

    seed = SeedSessionDB(path)
    try:
        session = seed.get_session("h-root")
        assert session is not None
        assert (session["title"], session["model_config"]) == ("Hermes wrote this", '{"t": 0.5}')
        assert (session["input_tokens"], session["output_tokens"]) == (10, 5)
        assert [m["content"] for m in seed.get_messages("h-root")] == ["hello from the ibex", "ok"]
        assert len(seed.search_messages("ibex")) == 1
        seed.create_session("s-child", "telegram", parent_session_id="h-root")
        seed_id = seed.append_message("s-child", "user", "the original store adds a yak")
        seed.set_session_title("s-child", "Seed wrote this")
    finally:
        seed.close()
    assert legacy.schema_signature(path, trigger_sql=True) == signature  # seed changed no DDL
    url = sqlite_url(path)
    assert schema_version(url) == 6 and alembic_revision(url) == HEAD

    db = SessionDB(path)
    try:
        assert [m["id"] for m in db.get_messages("s-child")] == [seed_id]
        assert db.get_session("s-child")["title"] == "Seed wrote this"  # type: ignore[index]
        assert db.message_count() == 3
    finally:
        db.close()
    assert full_text_ids(url, "yak") == [seed_id]
    fts_integrity_check(path)


def test_hermes_opens_a_file_the_seed_created(tmp_path: Path) -> None:
    """A state.db created fresh by the original store (v6, no alembic_version) opens here."""
    path = tmp_path / "state.db"
    seed = SeedSessionDB(path)
    try:
        seed.create_session("s1", "cli", model="m")
        first = seed.append_message("s1", "user", "a fresh capybara")
        seed.set_session_title("s1", "Seed title")
    finally:
        seed.close()
    url = sqlite_url(path)
    assert "alembic_version" not in table_names(url)
    before = legacy.dump_rows(path, typed=True)

    db = SessionDB(path)
    try:
        assert db.get_session("s1")["title"] == "Seed title"  # type: ignore[index]
        second = db.append_message("s1", "assistant", "capybara acknowledged")
    finally:
        db.close()
    assert alembic_revision(url) == HEAD and schema_version(url) == 6
    after = legacy.dump_rows(path, typed=True)
    assert after["sessions"][0] == {**before["sessions"][0], "message_count": ("integer", 2)}
    assert after["messages"][0] == before["messages"][0]
    assert full_text_ids(url, "capybara") == [first, second]
    assert legacy.schema_signature(path, trigger_sql=True) == seed_v6_signature(tmp_path)
    fts_integrity_check(path)


# -- refusal -------------------------------------------------------------------------------------


def make_v7(path: Path) -> None:
    legacy.build_legacy_db(path, 6)
    con = sqlite3.connect(path)
    con.execute("UPDATE schema_version SET version = 7")
    con.commit()
    con.close()


def make_garbage(path: Path) -> None:
    path.write_bytes(os.urandom(3) + b"not sqlite" + os.urandom(8179))


def make_empty(path: Path) -> None:
    path.write_bytes(b"")


def make_truncated(path: Path) -> None:
    full = path.with_name("full.db.bak")
    legacy.build_legacy_db(full, 6)
    data = full.read_bytes()
    full.unlink()
    assert data.startswith(b"SQLite format 3\x00") and len(data) > 8192
    path.write_bytes(data[: len(data) // 2])


def make_unrelated(path: Path) -> None:
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY, body TEXT)")
    con.execute("INSERT INTO notes (body) VALUES ('keep me')")
    con.commit()
    con.close()


def make_unknown_column(path: Path) -> None:
    legacy.build_legacy_db(path, 6)
    con = sqlite3.connect(path)
    con.execute("ALTER TABLE sessions ADD COLUMN mood TEXT")
    con.commit()
    con.close()


def make_future_revision(path: Path) -> None:
    """A file a newer hermes_store migrated past this one's head."""
    hermes_store.upgrade(path)
    con = sqlite3.connect(path)
    con.execute("UPDATE alembic_version SET version_num = 'v7_future_feature'")
    con.commit()
    con.close()


def legacy_v6_with(*statements: str) -> Callable[[Path], None]:
    """A maker: the original store's v6 file, then ``statements`` run on it."""

    def make(path: Path) -> None:
        legacy.build_legacy_db(path, 6)
        con = sqlite3.connect(path)
        try:
            con.executescript(";\n".join(statements))
        finally:
            con.close()

    return make


def make_only_a_sessions_view(path: Path) -> None:
    con = sqlite3.connect(path)
    con.execute("CREATE VIEW sessions AS SELECT 1 AS id")
    con.commit()
    con.close()


def make_empty_schema_version_unknown_shape(path: Path) -> None:
    """Version row missing, and the tables match no version (an extra column)."""
    legacy.build_legacy_db(path, 6)
    con = sqlite3.connect(path)
    con.execute("DELETE FROM schema_version")
    con.execute("ALTER TABLE sessions ADD COLUMN mood TEXT")
    con.commit()
    con.close()


DROP_FTS = (
    "DROP TRIGGER messages_fts_insert",
    "DROP TRIGGER messages_fts_delete",
    "DROP TRIGGER messages_fts_update",
    "DROP TABLE messages_fts",
)
ALEMBIC_TABLE = "CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL PRIMARY KEY)"
NOT_THE_INDEX = r"messages_fts is not the original store's full-text index"

REFUSALS: dict[str, tuple[Callable[[Path], None], type[SchemaError], str]] = {
    "schema-v7": (make_v7, SchemaTooNewError, r"schema_version 7"),
    "future-revision": (
        make_future_revision,
        SchemaTooNewError,
        r"'v7_future_feature', which is not one of this hermes_store's revisions",
    ),
    "two-alembic-rows": (
        legacy_v6_with(
            ALEMBIC_TABLE,
            "INSERT INTO alembic_version VALUES ('v6_reasoning_columns')",
            f"INSERT INTO alembic_version VALUES ('{HEAD}')",
        ),
        UnrecognizedSchemaError,
        r"alembic_version holds 2 rows",
    ),
    "alembic-version-view": (
        legacy_v6_with(f"CREATE VIEW alembic_version AS SELECT '{HEAD}' AS version_num"),
        UnrecognizedSchemaError,
        r"view named alembic_version",
    ),
    "messages-cjk-view": (
        legacy_v6_with("CREATE VIEW messages_cjk AS SELECT id AS rowid, content FROM messages"),
        UnrecognizedSchemaError,
        r"view named messages_cjk",
    ),
    "only-a-sessions-view": (
        make_only_a_sessions_view,
        UnrecognizedSchemaError,
        r"view named sessions",
    ),
    "fts-plain-table": (
        legacy_v6_with(*DROP_FTS, "CREATE TABLE messages_fts (content TEXT)"),
        UnrecognizedSchemaError,
        NOT_THE_INDEX,
    ),
    "fts4": (
        legacy_v6_with(
            *DROP_FTS, "CREATE VIRTUAL TABLE messages_fts USING fts4(content, content=messages)"
        ),
        UnrecognizedSchemaError,
        NOT_THE_INDEX,
    ),
    "fts5-own-content": (
        legacy_v6_with(*DROP_FTS, "CREATE VIRTUAL TABLE messages_fts USING fts5(content)"),
        UnrecognizedSchemaError,
        NOT_THE_INDEX,
    ),
    "foreign-write-keys": (
        legacy_v6_with("CREATE TABLE write_keys (k TEXT, note TEXT)"),
        UnrecognizedSchemaError,
        r"not made by it: write_keys \(k, note\)",
    ),
    "foreign-messages-cjk": (
        legacy_v6_with("CREATE TABLE messages_cjk (content TEXT)"),
        UnrecognizedSchemaError,
        r"not made by it: messages_cjk",
    ),
    "schema-version-without-row-unknown-shape": (
        make_empty_schema_version_unknown_shape,
        UnrecognizedSchemaError,
        r"schema_version table without a row .* shape of no version",
    ),
    "garbage": (make_garbage, NotADatabaseError, r"not a SQLite database"),
    "empty": (make_empty, NotADatabaseError, r"empty file \(0 bytes\)"),
    "truncated": (make_truncated, NotADatabaseError, r"malformed|not a readable"),
    "unrelated-tables": (make_unrelated, UnrecognizedSchemaError, r"\(notes\)"),
    "unknown-column": (make_unknown_column, UnrecognizedSchemaError, r"unknown \['mood'\]"),
}


@pytest.mark.parametrize("how", ADOPTERS)
@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refuses_and_leaves_file_untouched(tmp_path: Path, case: str, how: str) -> None:
    """A clear package error naming what was found, and not one byte (or -wal/-shm) changed."""
    make, error, found = REFUSALS[case]
    folder = tmp_path / "db"
    folder.mkdir()
    path = folder / "state.db"
    make(path)
    before = file_state(path)
    assert before[1] == ["state.db"]

    if how == "alembic":
        result = alembic_cli("upgrade", "head", env_url=f"sqlite:///{path}", tmp_path=tmp_path)
        assert result.returncode != 0
        output = result.stdout + result.stderr
        assert "Traceback" not in output, output  # Alembic's convention: one FAILED line
        failed = [line for line in output.splitlines() if line.startswith("FAILED: ")]
        assert len(failed) == 1, output
        assert str(path) in failed[0]
        assert re.search(found, failed[0]), failed[0]
    else:
        with pytest.raises(error, match=found) as caught:
            if how == "upgrade":
                hermes_store.upgrade(path)
            else:
                SessionDB(path)
        assert str(path) in str(caught.value)
        with pytest.raises(error):
            hermes_store.current(path)
    assert file_state(path) == before


def test_refusals_in_postgresql(pg_worker_url: URL | None) -> None:
    """On a server too: a newer schema_version and unrelated tables are refused, unchanged."""
    if pg_worker_url is None:
        pytest.skip("PostgreSQL tests need HERMES_STORE_TEST_PG_URL")
    reset_pg(pg_worker_url)
    empty_url = pg_worker_url
    engine = plain_engine(empty_url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE notes (id integer PRIMARY KEY, body text)"))
            conn.execute(sa.text("INSERT INTO notes VALUES (1, 'keep me')"))
        for target in (empty_url, url_string(empty_url)):
            with pytest.raises(UnrecognizedSchemaError, match="notes"):
                hermes_store.upgrade(target)
        with pytest.raises(UnrecognizedSchemaError, match="notes"):
            SessionDB(url_string(empty_url))
        assert table_names(empty_url) == {"notes"}

        with engine.begin() as conn:
            conn.execute(sa.text("DROP TABLE notes"))
        hermes_store.upgrade(empty_url)
        with engine.begin() as conn:
            conn.execute(sa.text("UPDATE schema_version SET version = 7"))
            conn.execute(sa.text("DELETE FROM alembic_version"))
        with pytest.raises(SchemaTooNewError, match="schema_version 7"):
            hermes_store.upgrade(empty_url)
        with pytest.raises(SchemaTooNewError, match="schema_version 7"):
            SessionDB(url_string(empty_url))
        assert schema_version(empty_url) == 7
        assert alembic_revision(empty_url) is None
    finally:
        engine.dispose()


# -- a database of this package that lost its Alembic row -----------------------------------------


@pytest.mark.parametrize("how", ["dropped", "emptied"])
@pytest.mark.parametrize(
    ("at", "told"), [("h7_cjk_index", "h7_cjk_index"), (HEAD, "h9_write_keys")]
)
def test_a_sqlite_file_that_lost_its_alembic_row_is_adopted_where_it_is(
    tmp_path: Path, how: str, at: str, told: str
) -> None:
    """A file this package wrote whose ``alembic_version`` was dropped or emptied by hand
    holds tables of revisions past the original store's version 6: adopted at the newest
    of them (the later ones change nothing on SQLite), nothing lost. From version 6 the
    upgrade met ``write_keys`` and failed with a raw "table write_keys already exists"."""
    path = tmp_path / "state.db"
    url = URL.create("sqlite", database=str(path))
    with SessionDB(path) as db:
        db.create_session("s", "cli")
        db.append_message("s", "user", "kept 表示の確認")
        keyed = db.append_message("s", "user", "keyed", idempotency_key="k1")
    if at != HEAD:
        hermes_store.downgrade(path, at)
    with sqlite3.connect(path) as con:
        con.execute(
            "DROP TABLE alembic_version" if how == "dropped" else "DELETE FROM alembic_version"
        )
    con.close()
    assert hermes_store.current(path) == told  # by its tables
    with SessionDB(path) as db:
        assert [m["content"] for m in db.get_messages("s")] == ["kept 表示の確認", "keyed"]
        assert [hit["id"] for hit in db.search_messages("表示")] == [1]
        assert db.append_message("s", "user", "again", idempotency_key="k1") == (
            keyed if at == HEAD else db.get_messages("s")[-1]["id"]
        )
    assert alembic_revision(url) == HEAD
    assert schema_version(url) == 6
    assert cjk_index_ids(path) == [1]


def test_a_postgresql_database_that_lost_its_alembic_row_is_refused_unchanged(
    pg_url: URL,
) -> None:
    """On a server the revisions past version 6 retype columns in place: which of them ran
    cannot be told from the tables, so the database is refused, naming the fix."""
    with SessionDB(url_string(pg_url)) as db:
        db.create_session("s", "cli")
        db.append_message("s", "user", "kept")
    engine = plain_engine(pg_url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("DELETE FROM alembic_version"))
        for open_it in (
            lambda: hermes_store.upgrade(pg_url),
            lambda: SessionDB(url_string(pg_url)),
        ):
            with pytest.raises(UnrecognizedSchemaError, match="the one row of alembic_version"):
                open_it()
        assert alembic_revision(pg_url) is None
        with engine.begin() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM messages")).scalar() == 1
            conn.execute(
                sa.text("INSERT INTO alembic_version (version_num) VALUES (:v)"), {"v": HEAD}
            )
    finally:
        engine.dispose()
    with SessionDB(url_string(pg_url)) as db:
        assert [m["content"] for m in db.get_messages("s")] == ["kept"]


# -- opening without the write lock; many processes at once --------------------------------------


def test_open_at_head_takes_no_write_lock(tmp_path: Path) -> None:
    """With another connection holding the write lock, a head database still opens and reads;
    a file that needs migrating cannot (so the lock really is held)."""
    path = tmp_path / "state.db"
    db = SessionDB(path)
    db.create_session("s1", "cli")
    db.append_message("s1", "user", "locked llama")
    db.close()
    stale = tmp_path / "stale.db"
    legacy.build_legacy_db(stale, 5)

    holders = [sqlite3.connect(p, isolation_level=None) for p in (path, stale)]
    try:
        for holder in holders:
            holder.execute("BEGIN IMMEDIATE")
        opened = SessionDB(path)
        try:
            assert opened.message_count("s1") == 1
            assert opened.get_session("s1")["source"] == "cli"  # type: ignore[index]
            assert hermes_store.current(path) == HEAD
        finally:
            opened.close()
        with pytest.raises(hermes_store.DatabaseLockedError):  # after its (short) retries
            SessionDB(stale, retry=hermes_store.RetryPolicy(attempts=2))
    finally:
        for holder in holders:
            holder.close()
    assert schema_version(sqlite_url(stale)) == 5  # untouched while locked


def run_openers(target: str, processes: int) -> None:
    """Start ``processes`` spawned processes that open ``target`` at the same moment and each
    write one session and one message; fail with every child's error."""
    ctx = multiprocessing.get_context("spawn")
    barrier, errors = ctx.Barrier(processes), ctx.Queue()
    workers = [
        ctx.Process(target=proc_workers.open_and_append, args=(target, i, barrier, errors))
        for i in range(processes)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
    problems = []
    while not errors.empty():
        problems.append(errors.get())
    assert problems == []
    assert [w.exitcode for w in workers] == [0] * processes


def count(url: URL, table: str) -> int:
    engine = plain_engine(url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar_one())
    finally:
        engine.dispose()


def test_concurrent_first_open(empty_url: URL) -> None:
    """Six processes opening the same new database at the same moment: no error, one head
    database, every message stored (SQLite: a new path; PostgreSQL: an empty database)."""
    run_openers(url_string(empty_url), 6)
    assert alembic_revision(empty_url) == HEAD
    assert schema_version(empty_url) == 6
    for table, rows in (("messages", 6), ("sessions", 6), ("schema_version", 1)):
        assert count(empty_url, table) == rows, table
    assert count(empty_url, "alembic_version") == 1
    assert len(full_text_ids(empty_url, "concurrent")) == 6
    if empty_url.get_backend_name() == "sqlite":
        path = Path(empty_url.database or "")
        fts_integrity_check(path)
        leftovers = [p.name for p in path.parent.iterdir() if p.name.endswith(".new")]
        assert leftovers == []


def test_concurrent_first_open_of_a_legacy_file(tmp_path: Path) -> None:
    """Six processes opening one legacy v3 file at once: adopted once, nothing lost."""
    path = tmp_path / "state.db"
    legacy.build_legacy_db(path, 3)
    before = legacy.dump_rows(path, typed=True)
    run_openers(str(path), 6)
    url = sqlite_url(path)
    assert alembic_revision(url) == HEAD and schema_version(url) == 6
    after = legacy.dump_rows(path, typed=True)
    assert [{c: row[c] for c in before["messages"][0]} for row in after["messages"][:9]] == before[
        "messages"
    ]
    assert len(after["messages"]) == 9 + 6 and len(after["sessions"]) == 4 + 6
    assert full_text_ids(url, "zebracorn") == [6]
    assert len(full_text_ids(url, "concurrent")) == 6
    fts_integrity_check(path)


def test_opening_a_legacy_file_waits_for_another_processs_writer(tmp_path: Path) -> None:
    """Another process holds the write lock for 1.5 s (past the writer's 1 s busy timeout)
    while a legacy file is opened: adoption waits with the writes' retry policy, then runs."""
    path = tmp_path / "state.db"
    legacy.build_legacy_db(path, 5)
    holder, ready = proc_workers.spawn(proc_workers.hold_write_lock, str(path), 1.5)
    try:
        assert ready.wait(timeout=120), "the other process never took the lock"
        db = SessionDB(path)
        try:
            db.append_message(db.search_sessions()[0]["id"], "user", "after the wait")
        finally:
            db.close()
    finally:
        holder.join(timeout=60)
    assert holder.exitcode == 0
    assert alembic_revision(sqlite_url(path)) == HEAD
    assert schema_version(sqlite_url(path)) == 6


def build_big_legacy_db(path: Path, messages: int) -> None:
    """A v3 legacy file with many messages and no full-text index: adopting it rebuilds the
    index, holding the write lock for a while (others opening it meanwhile must wait)."""
    legacy.build_legacy_db(path, 3)
    legacy.drop_full_text(path)
    raw = sqlite3.connect(path, isolation_level=None)
    try:
        owner = raw.execute("SELECT id FROM sessions ORDER BY id LIMIT 1").fetchone()[0]
        raw.execute("BEGIN")
        raw.executemany(
            "INSERT INTO messages (session_id, role, content, timestamp) VALUES (?, 'user', ?, ?)",
            (
                (owner, f"bulk note {i} about llamas, migrations and word{i % 977}", 1e9 + i)
                for i in range(messages)
            ),
        )
        raw.execute("COMMIT")
    finally:
        raw.close()


BIG_LEGACY_MESSAGES = 60_000


@pytest.mark.slow
@pytest.mark.parametrize("round_", range(3))
def test_eight_processes_open_a_big_legacy_file_at_once(tmp_path: Path, round_: int) -> None:
    """Eight processes open one big legacy file at the same moment: one adopts it (rebuilding
    the full-text index under the write lock), the others wait for the lock; all succeed."""
    path = tmp_path / "state.db"
    build_big_legacy_db(path, BIG_LEGACY_MESSAGES)
    run_openers(str(path), 8)
    url = sqlite_url(path)
    assert alembic_revision(url) == HEAD and schema_version(url) == 6
    assert count(url, "messages") == 9 + BIG_LEGACY_MESSAGES + 8
    assert len(full_text_ids(url, "concurrent")) == 8
    assert len(full_text_ids(url, "word976")) == len(range(976, BIG_LEGACY_MESSAGES, 977))
    fts_integrity_check(path)


#: The openers' retry policy behind the slow adopter: a fixed budget of about 3.5 s (3 x the
#: writer's 1 s busy timeout and a pause), which the adopter's work outlasts.
SHORT_RETRY_ATTEMPTS = 3
#: Once every opener waits, the adopter works on for this many of its heartbeats (0.2 s
#: apart: 6 s or more, past the openers' fixed budget).
ADOPTER_BEATS = 30


@pytest.mark.slow
@pytest.mark.parametrize(
    "queue_wait",
    [pytest.param(1.0, id="in-line"), pytest.param(0.05, id="fell-back")],
)
def test_openers_wait_for_a_working_adopter_past_their_retry_budget(
    tmp_path: Path, queue_wait: float
) -> None:
    """An adoption outlasts the openers' whole retry budget, and they all open anyway: they
    wait as long as the adopter is alive and working (its heartbeat), not a fixed budget.

    A legacy file has no writer-queue lock file yet; the adopter creates it and takes the
    head of the line. ``in-line``: the openers wait in the queue, in the kernel. ``fell-back``:
    the queue's bounded wait is shorter than the adopter's heartbeat, so the openers leave the
    line at once and retry on SQLite's lock; each retries more often than its fixed policy
    allows, and keeps going because the line moves."""
    path = tmp_path / "state.db"
    legacy.build_legacy_db(path, 3)
    openers = 3
    ctx = multiprocessing.get_context("spawn")
    ready, barrier, out = ctx.Event(), ctx.Barrier(openers), ctx.Queue()
    adopter = ctx.Process(
        target=proc_workers.adopt_slowly, args=(str(path), openers, ADOPTER_BEATS, ready)
    )
    adopter.start()
    workers = [
        ctx.Process(
            target=proc_workers.open_behind_an_adopter,
            args=(str(path), i, SHORT_RETRY_ATTEMPTS, queue_wait, barrier, out),
        )
        for i in range(openers)
    ]
    try:
        assert ready.wait(timeout=120), "the adopter never took the lock"
        for worker in workers:
            worker.start()
        reports = sorted(out.get(timeout=300) for _ in workers)
    finally:
        for proc in (adopter, *workers):
            proc.join(timeout=120)
    assert [error for _, error, _, _ in reports] == [""] * openers
    assert [p.exitcode for p in (adopter, *workers)] == [0] * (openers + 1)
    if queue_wait < 0.2:
        assert all(fallbacks > 0 for _, _, _, fallbacks in reports), reports
        assert all(retries >= SHORT_RETRY_ATTEMPTS for _, _, retries, _ in reports), reports
    url = sqlite_url(path)
    assert alembic_revision(url) == HEAD and schema_version(url) == 6
    assert count(url, "messages") == 9 + openers
    assert len(full_text_ids(url, "concurrent")) == openers
    fts_integrity_check(path)


def test_a_torn_unlocked_read_is_read_again_before_a_refusal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file nobody holds open is read without locks; a process that adopted it and
    checkpointed within one tick of the file's timestamps left its inode, size and mtime as
    they were, so the read, torn (v3's columns, schema_version 6), refused a sound file. The
    first read here is such a torn one; the refusal waits for a second read, which is sound."""
    path = tmp_path / "state.db"
    legacy.build_legacy_db(path, 6)
    reads: list[bool] = []
    probe = migrate._probe

    def first_read_torn(where: Path, *, immutable: bool) -> migrate.DatabaseState:
        state = probe(where, immutable=immutable)
        reads.append(immutable)
        if len(reads) == 1:  # what a read across another process's checkpoint saw
            state.columns["sessions"] = set(ddl.columns_at(3)["sessions"])
        return state

    monkeypatch.setattr(migrate, "_probe", first_read_torn)
    state = migrate.preflight_sqlite(path)
    assert state is not None and state.schema_version == 6
    assert reads == [True, True]  # both unlocked: nobody has the file open
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.db"]
