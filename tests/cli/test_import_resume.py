"""An import run again over sessions already in the database: a link to a parent that the
first run never made (it stopped before the parent was in, or the parent was not in its file)
is restored, never one the database holds replaced.

What must hold, on SQLite and PostgreSQL: a session skipped because its id exists, stored
with no parent, is linked to the parent the file gives once that parent exists (in the
database, or later in the file), under the same cycle refusal as any link, and the report
counts it; a stored parent other than the file's is kept and counted.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from hermes_store import SessionDB, transfer
from hermes_store.cli import cli
from tests.support.import_records import import_lines, parents, session

BOTH = pytest.mark.parametrize("backend", ["sqlite", "postgresql"])


@BOTH
def test_the_full_file_after_the_child_alone_links_the_child(store: SessionDB) -> None:
    first = import_lines(store, [session("s2", "s1")])
    assert first.parents_missing == 1
    report = import_lines(store, [session("s1"), session("s2", "s1")])
    assert parents(store) == {"s1": None, "s2": "s1"}
    assert (report.sessions, report.sessions_skipped) == (1, 1)
    assert (report.parents_restored, report.parents_missing, report.parents_differing) == (
        1,
        0,
        0,
    )


@BOTH
def test_a_rerun_after_a_stop_links_children_to_parents_later_in_the_file(
    store: SessionDB,
) -> None:
    """Newest first: the children come before their parents. The first run stopped after
    the first batch; the run again restores the links once the parents are in."""
    records = [
        session("c1", "p", 3.0),
        session("c2", "c1", 2.5),
        session("x", None, 2.2),
        session("p", None, 1.0),
    ]
    import_lines(store, records[:2], batch_size=2)  # the batch that committed before a stop
    assert parents(store) == {"c1": None, "c2": "c1"}
    report = import_lines(store, records, batch_size=1)
    assert parents(store) == {"c1": "p", "c2": "c1", "x": None, "p": None}
    assert (report.parents_restored, report.parents_missing, report.sessions_skipped) == (1, 0, 2)


@BOTH
def test_a_parent_already_in_the_database_is_restored_at_once(store: SessionDB) -> None:
    store.create_session("p", "cli")
    store.create_session("c", "cli")
    report = import_lines(store, [session("c", "p")])
    assert parents(store) == {"p": None, "c": "p"}
    assert (report.sessions_skipped, report.parents_restored) == (1, 1)


@BOTH
def test_a_stored_parent_other_than_the_files_is_kept_and_counted(store: SessionDB) -> None:
    store.create_session("p", "cli")
    store.create_session("q", "cli")
    store.create_session("c", "cli", parent_session_id="q")
    report = import_lines(store, [session("c", "p"), session("p")])
    assert parents(store) == {"p": None, "q": None, "c": "q"}
    assert (report.parents_differing, report.parents_restored) == (1, 0)


@BOTH
def test_a_restored_link_that_closes_a_cycle_is_refused(store: SessionDB) -> None:
    store.create_session("b", "cli")
    store.create_session("a", "cli", parent_session_id="b")
    with pytest.raises(transfer.ParentCycleError, match=r"^line 1: the parent links 'b' -> 'a'"):
        import_lines(store, [session("b", "a")])
    assert parents(store) == {"a": "b", "b": None}


def test_the_cli_says_how_many_links_it_restored(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    child_only, full = tmp_path / "child.jsonl", tmp_path / "full.jsonl"
    child_only.write_text(json.dumps(session("s2", "s1")) + "\n")
    full.write_text("".join(json.dumps(r) + "\n" for r in [session("s2", "s1"), session("s1")]))
    runner = CliRunner(env={"COLUMNS": "100", "NO_COLOR": "1", "HERMES_STORE_URL": None})
    assert runner.invoke(cli, ["--db", str(db), "import", str(child_only)]).exit_code == 0
    result = runner.invoke(cli, ["--db", str(db), "import", str(full)])
    assert result.exit_code == 0, result.output
    assert "1 parent link(s) restored on session(s) already in the database" in result.stdout
    with SessionDB(db) as store:
        assert parents(store) == {"s1": None, "s2": "s1"}
