"""A fleet that survives its database: a private primary and a streaming standby (never the
shared server), two processes of four writer threads (``append_message`` and
``update_token_counts``) on the multi-host URL with ``target_session_attrs=read-write``, and the
primary stopped in immediate mode, then the standby promoted.

- Synchronous replication, three failovers (one whose promotion takes 5 s): every writer writes
  again on the new primary, nothing fails beyond the one write each writer had in flight, and
  every acknowledged write is there exactly once.
- Asynchronous replication: what the standby had not received is lost, exactly as the README
  says (and ``doctor`` warns beforehand).
- A store opened on a read-only server (a standby, ``default_transaction_read_only``) never
  migrates: it opens read-only, refuses a schema behind head, and its writes say why.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from sqlalchemy.engine import URL
from sqlalchemy.pool import NullPool

from hermes_store import (
    AsyncSessionDB,
    ReadOnlyDatabaseError,
    RetryPolicy,
    SchemaBehindError,
    SessionDB,
)
from hermes_store.cli import cli as cli_main
from hermes_store.schema import migrate
from tests.support.backends import url_string
from tests.support.failover_workers import THREADS, session_of
from tests.support.log_events import LogSays
from tests.support.opening import Opening
from tests.support.pg_pair import DEADLINE_S, Pair, binaries

PROCESSES = 2
#: How long the promotion of one of the synchronous rounds takes (the standby is promoted this
#: long after the primary died): the writers wait for it.
SLOW_PROMOTION_S = 5.0
#: The bound on a writer's return after a promotion: the store's own patience for a server it
#: cannot reach (past it a call gives up with DatabaseUnavailableError).
BACK_WITHIN_S = RetryPolicy().unavailable_timeout

#: kind, writer, op, content, when the call started, when it returned, detail
Outcome = tuple[str, str, str, str, float, float, str]


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    bin_dir = binaries()
    if bin_dir is None:
        if os.environ.get("HERMES_STORE_REQUIRE_PG") == "1":
            pytest.fail("PostgreSQL's server binaries are missing but HERMES_STORE_REQUIRE_PG=1")
        pytest.skip("PostgreSQL's server binaries (initdb, pg_ctl) are needed for a private pair")
    made = Pair(bin_dir, synchronous=True)
    try:
        made.start()
        migrate.upgrade(made.primary.url)
        yield made
    finally:
        made.close()


@dataclass
class Ledger:
    """Every outcome the writer processes reported, as they report them."""

    outcomes: list[Outcome] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)

    def read(self, tag: str, stream: Iterator[str]) -> None:
        for line in stream:
            kind, thread, op, content, started, ended, detail = line.rstrip("\n").split("\t", 6)
            writer = session_of(tag, int(thread))
            with self.cond:
                self.outcomes.append(
                    (kind, writer, op, content, float(started), float(ended), detail)
                )
                self.cond.notify_all()

    def oks_after(self, since: float, op: str = "append") -> dict[str, float]:
        """Each writer's first acknowledged ``op`` after ``since``."""
        first: dict[str, float] = {}
        for kind, writer, done, _, _, ended, _ in self.outcomes:
            if kind == "ok" and done == op and ended > since and writer not in first:
                first[writer] = ended
        return first

    def wait_all_ok_after(self, since: float) -> dict[str, float]:
        with self.cond:
            self.cond.wait_for(
                lambda: len(self.oks_after(since)) == PROCESSES * THREADS, timeout=DEADLINE_S
            )
            first = self.oks_after(since)
        assert len(first) == PROCESSES * THREADS, f"writers never wrote again: {first}"
        return first


class Fleet:
    """PROCESSES writer processes on ``url`` (sessions ``<tag><n>-<thread>``, created first),
    their outcomes in a ledger; :meth:`stop` closes their stdin and waits for them."""

    def __init__(self, url: str, admin_url: str, tag: str) -> None:
        self.tags = [f"{tag}{n}" for n in range(PROCESSES)]
        with SessionDB(admin_url) as db:
            for name in self.tags:
                for thread in range(THREADS):
                    db.create_session(session_of(name, thread), "gateway")
        self.ledger = Ledger()
        self.workers = [
            subprocess.Popen(
                [sys.executable, "-m", "tests.support.failover_workers", url, name],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                cwd=Path(__file__).resolve().parents[2],
            )
            for name in self.tags
        ]
        self.readers = [
            threading.Thread(target=self.ledger.read, args=(name, worker.stdout), daemon=True)
            for name, worker in zip(self.tags, self.workers, strict=True)
        ]
        for reader in self.readers:
            reader.start()

    def stop(self) -> None:
        for worker in self.workers:
            assert worker.stdin is not None
            worker.stdin.close()
        try:
            for worker in self.workers:
                worker.wait(timeout=DEADLINE_S)
        finally:
            for worker in self.workers:
                if worker.poll() is None:
                    worker.kill()
                    worker.wait()
        for reader in self.readers:
            reader.join(timeout=DEADLINE_S)
        assert [worker.returncode for worker in self.workers] == [0] * PROCESSES

    def sessions(self) -> list[str]:
        return [session_of(name, thread) for name in self.tags for thread in range(THREADS)]


def _stored(url: str, sessions: list[str]) -> tuple[collections.Counter[str], dict[str, int]]:
    """Every message content of ``sessions`` (with its count) and each session's input_tokens."""
    engine = sa.create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            contents = collections.Counter(
                conn.execute(
                    sa.text("SELECT content FROM messages WHERE session_id = ANY(:s)"),
                    {"s": sessions},
                ).scalars()
            )
            tokens = {
                row.id: int(row.input_tokens)
                for row in conn.execute(
                    sa.text("SELECT id, input_tokens FROM sessions WHERE id = ANY(:s)"),
                    {"s": sessions},
                )
            }
    finally:
        engine.dispose()
    return contents, tokens


def _doctor(url: str) -> dict[str, dict[str, str]]:
    result = CliRunner().invoke(cli_main, ["--db", url, "doctor", "--json"])
    return {check["name"]: check for check in json.loads(result.stdout)["checks"]}


@pytest.mark.slow
def test_synchronous_failovers_keep_every_acknowledged_write_exactly_once(pair: Pair) -> None:
    pair.set_synchronous(True)
    replication = _doctor(pair.primary.url)["replication"]
    assert replication["status"] == "ok", replication
    assert "a failover to it loses no acknowledged write" in replication["detail"]
    fleet = Fleet(pair.fleet_url, pair.primary.url, "sync")
    kills: list[tuple[float, float]] = []  # from the stop's start until the primary was gone
    back_after: list[float] = []
    try:
        fleet.ledger.wait_all_ok_after(0.0)  # every writer is writing
        for round_number in range(3):
            stopping = time.time()
            pair.stop_primary()
            kills.append((stopping, time.time()))
            if round_number == 1:
                # A promotion that takes 5 s: the writers wait for it (the delay is the fault
                # injected, not a wait for a condition).
                time.sleep(SLOW_PROMOTION_S)
            pair.promote()
            promoted = time.time()
            first = fleet.ledger.wait_all_ok_after(promoted)
            back_after.append(max(first.values()) - promoted)
            pair.resync()
            # Writes acknowledged under synchronous replication again before the next failover.
            fleet.ledger.wait_all_ok_after(time.time())
    finally:
        fleet.stop()
    outcomes = fleet.ledger.outcomes
    kinds = collections.Counter(o[0] for o in outcomes)
    print("\n" + json.dumps({"back_after_s": back_after, "outcomes": kinds}))
    assert max(back_after) < BACK_WITHIN_S, back_after

    # Nothing failed beyond the writes in flight when a primary died: each "may or may not have
    # landed" was sent before that primary was gone and answered after it began to stop (its
    # backends exit one by one, so a writer may lose two in a row on a loaded machine).
    bad = [o for o in outcomes if o[0] not in ("ok", "unknown")]
    assert bad == [], bad[:5]

    def in_flight(outcome: Outcome) -> bool:
        return any(outcome[4] < gone and outcome[5] >= stopping for stopping, gone in kills)

    assert [o for o in outcomes if o[0] == "unknown" and not in_flight(o)] == []

    contents, tokens = _stored(pair.primary.url, fleet.sessions())
    acked = [o[3] for o in outcomes if o[0] == "ok" and o[2] == "append"]
    unknown = {o[3] for o in outcomes if o[0] == "unknown" and o[2] == "append"}
    assert len(acked) == len(set(acked))
    assert [c for c in acked if contents[c] != 1] == []  # acknowledged: exactly once
    assert [c for c in unknown if contents[c] > 1] == []  # in flight: at most once
    assert set(contents) <= set(acked) | unknown  # nothing else landed
    for session in fleet.sessions():
        done = [o for o in outcomes if o[1] == session and o[2] == "tokens"]
        ok = sum(1 for o in done if o[0] == "ok")
        maybe = sum(1 for o in done if o[0] == "unknown")
        assert ok <= tokens[session] <= ok + maybe, (session, ok, maybe, tokens[session])


@pytest.mark.slow
def test_asynchronous_failover_loses_what_the_standby_had_not_received(pair: Pair) -> None:
    pair.set_synchronous(False)
    replication = _doctor(pair.primary.url)["replication"]
    assert replication["status"] == "warn", replication
    assert "can be lost" in replication["detail"]
    fleet = Fleet(pair.fleet_url, pair.primary.url, "async")
    try:
        fleet.ledger.wait_all_ok_after(0.0)
        received = time.time()
        pair.wait_received()  # everything acknowledged so far reached the standby
        pair.cut_standby_off()
        cut = time.time()
        # Each writer's next append after these started after the cut: the primary alone has it.
        fleet.ledger.wait_all_ok_after(cut)
        fleet.ledger.wait_all_ok_after(time.time())
        killed = time.time()
        pair.stop_primary()
        pair.promote()
        promoted = time.time()
        fleet.ledger.wait_all_ok_after(promoted)
        pair.resync()
    finally:
        fleet.stop()
    outcomes = fleet.ledger.outcomes
    assert [o for o in outcomes if o[0] not in ("ok", "unknown")] == []
    contents, _ = _stored(pair.primary.url, fleet.sessions())
    appends = [o for o in outcomes if o[0] == "ok" and o[2] == "append"]
    # Sent after the cut and acknowledged by the dead primary: nothing could carry them over.
    lost = [o[3] for o in appends if o[4] > cut and o[5] < killed]
    print("\n" + json.dumps({"lost_acknowledged_appends": len(lost)}))
    # What the standby had received is there once; what only the dead primary had is gone,
    # although it was acknowledged; after the promotion every write lands again.
    assert [o[3] for o in appends if o[5] < received and contents[o[3]] != 1] == []
    assert lost and [c for c in lost if contents[c] != 0] == []
    assert [o[3] for o in appends if o[4] > promoted and contents[o[3]] != 1] == []


@pytest.mark.slow
def test_a_store_on_a_read_only_server_never_migrates_and_says_why_writes_fail(
    pair: Pair, caplog: pytest.LogCaptureFixture
) -> None:
    with SessionDB(pair.primary.url) as db:
        db.create_session("standby-read", "cli")
        db.append_message("standby-read", "user", "written on the primary")
    pair.wait_replayed()
    standby = pair.standby.url
    with caplog.at_level(logging.WARNING, logger="hermes_store"), SessionDB(standby) as db:
        assert "read-only standby" in caplog.text
        assert db.get_messages("standby-read")[0]["content"] == "written on the primary"
        assert [hit["session_id"] for hit in db.search_messages("primary")] == ["standby-read"]
        assert db.export_session("standby-read") is not None
        with pytest.raises(ReadOnlyDatabaseError, match="the server is a read-only standby"):
            db.append_message("standby-read", "user", "refused")
        with pytest.raises(ReadOnlyDatabaseError, match="the server is a read-only standby"):
            db.update_token_counts("standby-read", input_tokens=1)
        refused = pytest.raises(ReadOnlyDatabaseError, match="the server is a read-only standby")
        with refused, db.transaction():
            db.create_session("standby-new", "cli")
    standby_doctor = _doctor(standby)["replication"]
    assert standby_doctor["status"] == "info" and "standby" in standby_doctor["detail"]

    # A database behind head on the standby: refused, nothing tried.
    pair.query(pair.primary, "CREATE DATABASE behind")
    older = migrate.revision_for_version(5)
    migrate.upgrade(pair.primary.database_url("behind"), older)
    pair.wait_replayed()
    behind = pair.standby.database_url("behind")
    with pytest.raises(SchemaBehindError, match="read-only standby") as refused:
        SessionDB(behind)
    assert "upgrade" in str(refused.value) and "primary" in str(refused.value)
    assert migrate.current(behind) == older

    # A primary whose database refuses writes (default_transaction_read_only).
    pair.query(pair.primary, "CREATE DATABASE readonly")
    readonly = pair.primary.database_url("readonly")
    migrate.upgrade(readonly)
    pair.query(pair.primary, "ALTER DATABASE readonly SET default_transaction_read_only = on")
    with SessionDB(readonly) as db:
        assert db.list_sessions_rich() == []
        with pytest.raises(ReadOnlyDatabaseError, match="default_transaction_read_only"):
            db.create_session("refused", "cli")


@pytest.mark.slow
def test_an_async_store_on_a_standby_says_why_its_writes_fail(pair: Pair) -> None:
    """AsyncSessionDB's writes on a standby, transaction blocks included, name the cause as
    SessionDB's do, not the server's "cannot execute ... in a read-only transaction"."""
    with SessionDB(pair.primary.url) as db:
        db.create_session("standby-async", "cli")
    pair.wait_replayed()
    standby_says = "the server is a read-only standby"

    async def main() -> None:
        async with AsyncSessionDB(pair.standby.url) as adb:
            assert (await adb.get_session("standby-async")) is not None
            with pytest.raises(ReadOnlyDatabaseError, match=standby_says):
                async with adb.transaction():
                    await adb.append_message("standby-async", "user", "refused")
            with pytest.raises(ReadOnlyDatabaseError, match=standby_says):
                async with adb.transaction():
                    await adb.create_session("standby-async-new", "cli")
            with pytest.raises(ReadOnlyDatabaseError, match=standby_says):
                await adb.append_message("standby-async", "user", "refused")
            with pytest.raises(ReadOnlyDatabaseError, match=standby_says):
                await adb.update_token_counts("standby-async", input_tokens=1)
            assert await adb.get_messages("standby-async") == []

    asyncio.run(main())


@pytest.mark.slow
def test_a_store_opened_before_the_promotion_waits_for_the_new_primary(pair: Pair) -> None:
    """A gateway started during a failover: on the multi-host URL no host takes writes (the
    primary is gone, the standby read-only), so opening waits, as a call would, and opens on
    the standby once it is promoted."""
    with SessionDB(pair.primary.url) as db:
        db.create_session("opened-in-failover", "cli")
    pair.wait_replayed()
    pair.stop_primary()
    try:
        with LogSays("hermes_store.uow.retry", "unreachable") as waiting:
            opening = Opening(pair.fleet_url, ended=waiting.said)
            assert waiting.said.wait(DEADLINE_S), "the opening never said it waits"
            assert opening.outcome() is None  # waiting (said so), not ended
            pair.promote()
            with opening.store(DEADLINE_S) as store:
                assert store.get_session("opened-in-failover") is not None
                store.append_message("opened-in-failover", "user", "on the new primary")
                assert store.message_count("opened-in-failover") == 1
    finally:
        if not pair.primary.running:
            pair.promote()
        pair.resync()


def test_doctor_on_a_server_without_standbys_says_a_failover_has_nothing_to_promote(
    pg_url: URL,
) -> None:
    replication = _doctor(url_string(pg_url))["replication"]
    assert replication["status"] == "info", replication
    assert "no standby connected" in replication["detail"]
    assert "synchronous_commit = on" in replication["detail"]
