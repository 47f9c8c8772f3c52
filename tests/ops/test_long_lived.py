"""A state.db that lives for years: prune and optimize beside a writer, space given back,
steps over the bound counted, retention that runs by itself at most once a day.

The scenario runs once per module on a scratch file of a few tens of MB (a year of sessions,
chat turns and tool outputs, 5% CJK): a prune of the older half then an online optimize, while
another process appends one message after another through SessionDB. How long a step held
the write lock is read from the job's own report (its steps over the bound), never timed here.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import shutil
import sqlite3
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from sqlalchemy.engine import URL

from hermes_store import SessionDB, transfer
from hermes_store.cli import cli
from hermes_store.errors import InvalidInputError
from hermes_store.ops import maintenance, pacing, retention
from hermes_store.schema import fulltext
from tests.support import fts_damage_workers, long_lived_workers

#: A hang guard only: every wait is on an event or a pipe.
DEADLINE = 300.0
#: The issue's bound on the file after prune + optimize, against a fresh import of the rest.
OVER_FRESH = 1.15
DAY = 86400.0


def _bytes(path: Path) -> int:
    wal = Path(f"{path}-wal")
    return path.stat().st_size + (wal.stat().st_size if wal.exists() else 0)


@pytest.fixture(scope="module")
def year(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """1,000 ended sessions over the last 365 days, 12 messages each (every fifth a tool
    output of 300-1,500 words): ~40 MB."""
    path = tmp_path_factory.mktemp("long-lived") / "year.db"
    fts_damage_workers.build_history(path, sessions=1_000, per_session=12)
    return path


@dataclass
class Beside:
    """What a prune + optimize beside a writer process did."""

    path: Path
    pruned: retention.Report
    optimized: maintenance.Report
    acknowledged: list[int]
    errors: list[str]
    before: int


@pytest.fixture(scope="module")
def beside_a_writer(year: Path, tmp_path_factory: pytest.TempPathFactory) -> Beside:
    """Prune the sessions older than 180 days, then optimize online, while another process
    appends until both are done."""
    path = tmp_path_factory.mktemp("beside") / "state.db"
    shutil.copy(year, path)
    before = _bytes(path)
    context = mp.get_context("spawn")
    ready, stop = context.Event(), context.Event()
    receiver, sender = context.Pipe(duplex=False)
    writer = context.Process(
        target=long_lived_workers.append_acknowledged,
        args=(str(path), "live", ready, stop, sender),
    )
    writer.start()
    store = SessionDB(path)
    try:
        assert ready.wait(DEADLINE)
        pruned = retention.run(store.uow, retention.Policy(180))  # as the CLI prunes
        optimized = maintenance.optimize(store.uow)
    finally:
        stop.set()
        assert receiver.poll(DEADLINE), "the writer process did not report"
        acknowledged, errors = receiver.recv()
        writer.join(DEADLINE)
        store.close()
    return Beside(path, pruned, optimized, acknowledged, errors, before)


def test_a_writer_beside_prune_and_optimize_never_fails_and_keeps_every_write(
    beside_a_writer: Beside,
) -> None:
    run = beside_a_writer
    assert run.errors == []
    assert len(run.acknowledged) > 50  # it wrote all along, not once at the end
    assert run.pruned.sessions > 400
    connection = sqlite3.connect(run.path)
    try:
        rows = connection.execute("SELECT id FROM messages WHERE session_id = 'live'")
        held = {row[0] for row in rows}
        count = connection.execute(
            "SELECT message_count FROM sessions WHERE id = 'live'"
        ).fetchone()[0]
        for table in ("messages_fts", "messages_cjk"):
            connection.execute(fulltext.integrity_statement(table))
        indexed = connection.execute(
            "SELECT count(*) FROM messages_fts WHERE messages_fts MATCH 'kept'"
        ).fetchone()[0]
    finally:
        connection.close()
    assert set(run.acknowledged) <= held
    assert count == len(run.acknowledged) == indexed
    with SessionDB(run.path) as store:
        last = f'"turn {len(run.acknowledged) - 1} kept"'
        assert [hit["id"] for hit in store.search_messages(last)] == [run.acknowledged[-1]]


def test_the_paced_steps_stay_within_their_bound(beside_a_writer: Beside) -> None:
    """Counted from the jobs' reports: the work is cut into many short units, each measuring
    its own hold of the write lock against the bound. How many went over depends on how
    loaded the machine is (a step preempted while it holds the lock): ``bench/scale.py``
    measures that; here the accounts must add up."""
    for report in (beside_a_writer.pruned, beside_a_writer.optimized):
        assert report.bound_s == pacing.STEP_SECONDS
        assert report.steps > 5  # paced: many short units, not one long one
        assert 0 <= report.steps_over_bound <= report.steps, report
        assert report.longest_step_s > 0, report
    assert beside_a_writer.optimized.steps == (
        beside_a_writer.optimized.merge_steps + beside_a_writer.optimized.vacuum_steps + 1
    )


def test_after_prune_and_optimize_the_file_is_near_a_fresh_import_of_what_remains(
    beside_a_writer: Beside, tmp_path: Path
) -> None:
    run = beside_a_writer
    with SessionDB(run.path) as store:
        records = [json.loads(json.dumps(record)) for record in store.iter_export()]
    fresh = tmp_path / "fresh.db"
    with SessionDB(fresh) as store:
        transfer.import_sessions(store, enumerate(records, 1))
    after, fresh_bytes = _bytes(run.path), _bytes(fresh)
    assert after < run.before * 0.75  # about half the text went, and its space with it
    assert after <= fresh_bytes * OVER_FRESH, (after, fresh_bytes, run.optimized)


# -- steps over the bound ------------------------------------------------------------------------


class _SkewedClock:
    """``time`` for the pacing module whose monotonic clock jumps ``skew`` seconds inside
    the ``nth`` step of a job: that step then measured itself that much longer than it was."""

    def __init__(self, nth: int, skew: float) -> None:
        self.nth, self.skew = nth, skew
        self.offset = 0.0
        self.steps = 0

    def monotonic(self) -> float:
        return time.monotonic() + self.offset

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)  # the pause between steps, as the module would

    def wrap(self, run_step: Callable[..., Any]) -> Callable[..., Any]:
        def skewed(uow: Any, pace: Any, log: Any, body: Callable[..., Any]) -> Any:
            self.steps += 1
            number = self.steps

            def inner(conn: Any, budget: Any) -> Any:
                result = body(conn, budget)
                if number == self.nth:
                    self.offset += self.skew
                return result

            return run_step(uow, pace, log, inner)

        return skewed


@pytest.fixture
def skewed(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[int, float], _SkewedClock]]:
    def install(nth: int, skew: float) -> _SkewedClock:
        clock = _SkewedClock(nth, skew)
        monkeypatch.setattr(pacing, "time", clock)
        monkeypatch.setattr(pacing, "run_step", clock.wrap(pacing.run_step))
        return clock

    yield install


def _old_sessions(path: Path, count: int, messages: int) -> None:
    with SessionDB(path, clock=lambda: time.time() - 400 * DAY) as store:
        for number in range(count):
            sid = f"old-{number:03d}"
            store.create_session(sid, "cli")
            text = "lorem ipsum " * 40
            turns = [{"role": "user", "content": f"note {i} {text}"} for i in range(messages)]
            store.append_messages(sid, turns)
            store.end_session(sid, "done")


def test_a_step_over_the_bound_is_counted_with_the_longest_step(
    tmp_path: Path, skewed: Callable[[int, float], _SkewedClock]
) -> None:
    path = tmp_path / "state.db"
    _old_sessions(path, 30, 20)
    skewed(2, 30.0)  # the second step of each job: 30 s on a bound of 10 s
    with SessionDB(path) as store:
        pruned = retention.run(store.uow, retention.Policy(30), chunk=3, step_seconds=10)
        assert pruned.sessions == 30 and pruned.steps >= 3
        assert pruned.steps_over_bound == 1
        assert pruned.longest_step_s >= 30.0 and pruned.bound_s == 10
    skewed(1, 30.0)
    with SessionDB(path) as store:
        optimized = maintenance.optimize(store.uow, step_seconds=10)
    assert optimized.steps_over_bound == 1
    assert optimized.longest_step_s >= 30.0
    assert optimized.longest_step_kind == "merge"
    assert optimized.steps == optimized.merge_steps + optimized.vacuum_steps + 1


@pytest.mark.parametrize(
    "argv", [["db", "optimize"], ["sessions", "prune", "--older-than", "30", "--yes"]]
)
def test_the_cli_shows_the_longest_step_and_the_steps_over_the_bound(
    tmp_path: Path, skewed: Callable[[int, float], _SkewedClock], argv: list[str]
) -> None:
    path = tmp_path / "state.db"
    _old_sessions(path, 10, 10)
    skewed(1, 5.0)
    shown = CliRunner().invoke(cli, ["--db", str(path), *argv])
    assert shown.exit_code == 0, shown.output
    line = re.search(
        r"(\d+) step\(s\); the longest held the write lock ([\d.]+) ms; (\d+) over the 100 ms "
        r"bound",
        shown.output,
    )
    assert line is not None, shown.output
    assert float(line[2]) >= 5000 and int(line[3]) >= 1
    skewed(1, 5.0)
    as_json = CliRunner().invoke(cli, ["--db", str(path), *argv, "--json"])
    assert as_json.exit_code == 0, as_json.output
    report = json.loads(as_json.stdout)
    assert report["steps_over_bound"] >= 1 and report["steps"] >= 1
    assert report["bound_s"] == pacing.STEP_SECONDS


# -- retention by itself -------------------------------------------------------------------------


def test_retention_runs_at_most_once_a_day_across_processes(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    _old_sessions(path, 20, 5)
    context = mp.get_context("spawn")
    start = context.Event()
    racers = []
    for _ in range(2):
        arrived = context.Event()
        receiver, sender = context.Pipe(duplex=False)
        process = context.Process(
            target=long_lived_workers.retention_when_told,
            args=(str(path), 30, arrived, start, sender),
        )
        process.start()
        racers.append((process, arrived, receiver))
    try:
        for _, arrived, _ in racers:
            assert arrived.wait(DEADLINE)  # both open, both waiting on one start
        start.set()
        outcomes = []
        for _, _, receiver in racers:
            assert receiver.poll(DEADLINE), "a racer did not report"
            outcomes.append(receiver.recv())
    finally:
        start.set()
        for process, _, _ in racers:
            process.join(DEADLINE)
    assert sorted(outcomes, key=str) == sorted([None, (20, 100)], key=str), outcomes
    marker = Path(f"{path}{retention.MARKER_SUFFIX}")
    record = retention.last_run(marker)
    assert record["sessions"] == 20 and record["messages"] == 100
    assert stat.S_IMODE(marker.stat().st_mode) == 0o600
    with SessionDB(path) as store:
        assert store.session_count() == 0
        began = float(record["started_at"])
        # Within the day: claimed already. A day later: this caller's turn.
        assert retention.maybe_run(store.uow, retention.Policy(30), now=began + DAY - 1) is None
        again = retention.maybe_run(store.uow, retention.Policy(30), now=began + DAY)
        assert again is not None and again.sessions == 0


def test_retention_needs_a_marker_place_for_a_database_without_a_file(
    pg_url: URL, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server database keeps its marker under $HERMES_HOME/retention, named by the
    database (never its password), shared by this machine's processes; an in-memory
    database, gone with its process, has no place for one."""
    home = tmp_path / "home"
    monkeypatch.setenv("HERMES_HOME", str(home))
    with SessionDB(pg_url, clock=lambda: time.time() - 400 * DAY) as old:
        for number in range(5):
            old.create_session(f"old-{number}", "cli")
            old.append_message(f"old-{number}", "user", "from last year")
            old.end_session(f"old-{number}", "done")
    with SessionDB(pg_url, retention=retention.Policy(30)) as store:
        job = store.retention_job
        assert job is not None and job.done.wait(DEADLINE)
        assert job.error is None, job.error
        assert job.report is not None and job.report.sessions == 5
        marker = job.marker
        assert store.session_count() == 0
    assert marker.parent == home / "retention"
    assert stat.S_IMODE(marker.stat().st_mode) == 0o600
    password = pg_url.password or "no-password-in-this-url"
    assert password not in marker.name and str(pg_url.database) not in marker.name
    assert retention.last_run(marker)["sessions"] == 5
    # Another process of this machine (a second open) finds the day claimed.
    with SessionDB(pg_url, retention=retention.Policy(30)) as again:
        job = again.retention_job
        assert job is not None and job.done.wait(DEADLINE)
        assert job.error is None and job.report is None
        assert job.marker == marker
    # The same database has the same marker; another store on the server (a schema of its
    # own) has its own.
    with SessionDB(pg_url) as store:
        assert retention.marker_for(store.uow) == marker
    with SessionDB(pg_url, schema="elsewhere") as elsewhere:
        assert retention.marker_for(elsewhere.uow) != marker
    memory = sa.create_engine("sqlite://")
    try:  # marker_for reads the unit's URL only
        with pytest.raises(InvalidInputError, match="in-memory"):
            retention.marker_for(SimpleNamespace(engine=memory))  # type: ignore[arg-type]
    finally:
        memory.dispose()
    assert os.listdir(home / "retention") == [marker.name]


# -- FTS5's own merging while a job runs ---------------------------------------------------------


def _fts5_settings(path: Path) -> dict[str, int]:
    connection = sqlite3.connect(path)
    try:
        rows = connection.execute(
            "SELECT k, v FROM messages_fts_config WHERE k IN ('automerge', 'crisismerge')"
        ).fetchall()
    finally:
        connection.close()
    return {str(k): int(v) for k, v in rows}


@pytest.mark.parametrize("merge_index", [False, True])
def test_a_job_turns_fts5_merging_inside_writes_off_and_puts_the_settings_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, merge_index: bool
) -> None:
    """FTS5 merges hundreds of pages inside whichever write crosses its counter (a prune step,
    a writer's append): while a job runs that is off, and the job merges in paced steps. The
    merge a prune ends with runs within those settings too: with FTS5's merging back on, a
    writer's append continued a full merge in progress inside its own transaction."""
    path = tmp_path / "state.db"
    _old_sessions(path, 12, 10)
    connection = sqlite3.connect(path, isolation_level=None)
    connection.execute("INSERT INTO messages_fts(messages_fts, rank) VALUES ('automerge', 8)")
    connection.close()
    seen: list[tuple[str, dict[str, int]]] = []
    run_step = pacing.run_step

    def watched(uow: Any, pace: Any, log: Any, body: Callable[..., Any]) -> Any:
        seen.append((pace.kind, _fts5_settings(path)))  # what a writer beside would find
        return run_step(uow, pace, log, body)

    monkeypatch.setattr(pacing, "run_step", watched)
    with SessionDB(path) as store:
        pruned = retention.run(store.uow, retention.Policy(30), chunk=2, merge_index=merge_index)
        assert pruned.sessions == 12 and pruned.chunks >= 6
        assert pruned.index_merged is merge_index
        ends = len(seen)
        maintenance.optimize(store.uow)
    assert seen[ends - 1][0] == "merge"  # the prune ended with its index merge
    writing = [settings for kind, settings in seen if kind in ("prune", "merge")]
    assert len(writing) > 12 and {kind for kind, _ in seen} >= {"prune", "merge"}
    assert all(settings == maintenance.JOB_FTS5_SETTINGS for settings in writing), seen
    assert _fts5_settings(path) == {"automerge": 8, "crisismerge": 16}


def test_settings_a_killed_job_left_are_not_kept_as_the_tables_own(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    _old_sessions(path, 3, 4)
    connection = sqlite3.connect(path, isolation_level=None)
    for key, value in maintenance.JOB_FTS5_SETTINGS.items():  # what a SIGKILL mid-job leaves
        connection.execute(
            "INSERT INTO messages_fts(messages_fts, rank) VALUES (?, ?)", (key, value)
        )
    connection.close()
    with SessionDB(path) as store:
        maintenance.optimize(store.uow)
    assert _fts5_settings(path) == maintenance.FTS5_DEFAULT_SETTINGS


# -- what a prune merges -------------------------------------------------------------------------


def _merged_whole(path: Path) -> int:
    """The index made one segment (FTS5 'optimize'); that segment's id."""
    connection = sqlite3.connect(path, isolation_level=None)
    try:
        connection.execute("INSERT INTO messages_fts(messages_fts) VALUES ('optimize')")
    finally:
        connection.close()
    segments = [s for _, ids in long_lived_workers.index_levels(str(path)) for s in ids]
    assert len(segments) == 1
    return segments[0]


def _recent_sessions(path: Path, count: int) -> None:
    with SessionDB(path) as store:
        for number in range(count):
            sid = f"new-{number:03d}"
            store.create_session(sid, "cli")
            store.append_messages(sid, [{"role": "user", "content": f"kept {number} " * 30}])


def test_a_prune_folds_its_delete_records_and_leaves_the_big_segments_alone(
    tmp_path: Path,
) -> None:
    """The merge of the whole index writes each common word's list of rows in one statement
    (no bound cuts it), so a prune only merges the levels its deletes and the writers fill:
    at its end no level holds FTS5's ``usermerge`` (4) segments, none is half merged, and the
    index's big segment is the one it had before; ``db optimize`` merges the rest."""
    path = tmp_path / "state.db"
    _old_sessions(path, 30, 8)
    _recent_sessions(path, 5)
    big = _merged_whole(path)
    with SessionDB(path) as store:
        pruned = retention.run(store.uow, retention.Policy(30), chunk=1)
        assert pruned.sessions == 30 and pruned.chunks >= 30 and not pruned.index_merged
        assert pruned.by_kind["prune"][0] >= 30 and pruned.by_kind["merge"][0] >= 1
        assert sum(int(kind[0]) for kind in pruned.by_kind.values()) == pruned.steps
        assert store.search_messages("lorem") == []
        assert len(store.search_messages("kept")) == 5
    levels = long_lived_workers.index_levels(str(path))
    assert all(merging == 0 and len(ids) < 4 for merging, ids in levels), levels
    assert big in [s for _, ids in levels for s in ids]
    with SessionDB(path) as store:
        maintenance.optimize(store.uow)
        assert len(store.search_messages("kept")) == 5
    after = [s for _, ids in long_lived_workers.index_levels(str(path)) for s in ids]
    assert len(after) == 1 and after != [big]
    connection = sqlite3.connect(path)
    try:
        connection.execute(fulltext.integrity_statement("messages_fts"))
    finally:
        connection.close()


@pytest.mark.parametrize("secure", [False, True])
def test_the_cli_prune_merges_the_whole_index_only_with_secure_delete(
    tmp_path: Path, secure: bool
) -> None:
    path = tmp_path / "state.db"
    _old_sessions(path, 10, 6)
    _recent_sessions(path, 3)
    big = _merged_whole(path)
    argv = ["--db", str(path), "sessions", "prune", "--older-than", "30", "--yes"]
    argv += ["--secure-delete"] if secure else []
    shown = CliRunner().invoke(cli, [*argv, "--json"])
    assert shown.exit_code == 0, shown.output
    report = json.loads(shown.stdout)
    assert report["sessions"] == 10 and report["index_merged"] is secure
    assert set(report["by_kind"]) == {"prune", "merge"}
    segments = [s for _, ids in long_lived_workers.index_levels(str(path)) for s in ids]
    assert (big in segments) is not secure
    if secure:
        assert len(segments) == 1
    _old_sessions(path, 2, 2)
    shown = CliRunner().invoke(cli, argv)
    assert shown.exit_code == 0, shown.output
    assert re.search(r"By kind: prune \d+ \(longest [\d.]+ ms, \d+ over\)", shown.output)
    assert ("db optimize` merges them" in shown.output) is not secure


# -- a step yields to a writer that waits --------------------------------------------------------


@pytest.mark.parametrize("floor", [0.0, 1.0])
def test_a_step_ends_after_its_piece_once_a_writer_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, floor: float
) -> None:
    """A writer that joins the line behind a step waits for the piece of work in progress,
    not for the rest of the step: once the step has worked its floor (``YIELD_AFTER`` of the
    bound), its budget says "no more" as soon as the writer's ticket is issued, and the
    writer's append lands once the step has committed. Within the floor the step works on
    (a floor of the whole bound: it never yields)."""
    monkeypatch.setattr(pacing, "YIELD_AFTER", floor)
    path = tmp_path / "state.db"
    SessionDB(path).close()
    context = mp.get_context("spawn")
    ours, theirs = context.Pipe()
    writer = context.Process(target=fts_damage_workers.append_on_request, args=(str(path), theirs))
    writer.start()
    try:
        assert ours.poll(DEADLINE) and ours.recv() == "ready"
        with SessionDB(path) as store:
            queue = store.uow.write_queue
            assert queue is not None and queue.enabled
            seen: list[bool] = []

            def body(conn: Any, budget: pacing.Budget) -> tuple[None, int]:
                seen.append(budget.left())  # nobody waits yet
                issued = queue.tickets()[0]
                ours.send(1)  # the writer's append now waits for this step
                guard = time.monotonic() + DEADLINE  # a hang guard only
                while queue.tickets()[0] == issued and time.monotonic() < guard:
                    time.sleep(0.001)
                time.sleep(pacing.WAITERS_EVERY_S)
                seen.extend([budget.left(), budget.left()])
                return None, 1

            # A bound of 10 s: only the writer can end this step early.
            pace = pacing.Pace("test", 1, 1, 1, bound=10.0)
            pacing.run_step(store.uow, pace, pacing.StepLog(), body)
        assert seen == ([True, False, False] if floor == 0.0 else [True, True, True])
        assert ours.poll(DEADLINE)
        assert isinstance(ours.recv(), int)  # its append landed after the step
    finally:
        ours.send(None)
        writer.join(DEADLINE)


def test_without_the_writer_queue_a_step_ends_by_its_clock_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HERMES_STORE_WRITE_QUEUE", "0")
    path = tmp_path / "state.db"
    budgets: list[pacing.Budget] = []
    with SessionDB(path) as store:
        pace = pacing.Pace("test", 1, 1, 1, bound=10.0)
        pacing.run_step(store.uow, pace, pacing.StepLog(), lambda _, b: (budgets.append(b), 1))
    assert budgets[0].waiting is None and budgets[0].left()
