"""The writer queue's descriptors and helper threads live as long as a store uses the file.

Before, every SQLite file a process had ever written kept its lock-file descriptors (and any
helper thread a waited turn had started) for the process's life: a notebook opening a few
hundred ``state.db`` files in turn met the limit of 1,024 open files. Counted from
``/proc/self/fd`` and ``threading.enumerate()``, never inferred from timing.
"""

from __future__ import annotations

import gc
import os
import threading
import weakref
from pathlib import Path

import pytest

from hermes_store import SessionDB
from hermes_store.engine.factory import to_url
from hermes_store.schema import migrate
from hermes_store.uow import writequeue
from tests.support.legacy import build_legacy_db
from tests.support.waiting import wait_until

GUARD = 90.0  # deadlock guard for any single wait; never a speed expectation


def open_descriptors() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def helpers() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("hermes-writequeue-")}


def write_behind_a_block(store: SessionDB, queue: writequeue.WriteQueue) -> None:
    """Two threads of this process write the store's file in ``transaction()`` blocks (a queued
    turn each): the second waits in line behind the first, on a descriptor whose helper
    thread blocks in the kernel. Its ticket is taken a moment before it asks for the first
    writer's place; on a loaded machine the first may be gone by then (no wait): the scene is
    played again until the second one waited."""
    waits = queue.stats().waits
    for _ in range(GUARD_ATTEMPTS):
        _write_behind_a_block_once(store, queue)
        if queue.stats().waits > waits:
            return
    raise AssertionError(f"no writer waited in line in {GUARD_ATTEMPTS} attempts")


GUARD_ATTEMPTS = 50


def _write_behind_a_block_once(store: SessionDB, queue: writequeue.WriteQueue) -> None:
    inside, leave = threading.Event(), threading.Event()

    def hold() -> None:
        with store.transaction():
            store.append_message("q", "user", "held")
            inside.set()
            assert leave.wait(GUARD)

    holder = threading.Thread(target=hold)
    holder.start()
    assert inside.wait(GUARD)
    issued = queue.tickets()[0]
    waiter = threading.Thread(target=lambda: store.append_message("q", "user", "behind"))
    waiter.start()
    wait_until(lambda: queue.tickets()[0] > issued, "the waiter's ticket")
    leave.set()
    holder.join(GUARD)
    waiter.join(GUARD)
    assert not holder.is_alive() and not waiter.is_alive()


@pytest.fixture
def db(tmp_path: Path) -> str:
    path = str(tmp_path / "state.db")
    with SessionDB(path) as store:
        store.create_session("q", "cli")
    return path


@pytest.fixture
def warm(tmp_path: Path) -> None:
    """Whatever a first store loads once per process (modules, the logging setup) is loaded."""
    store = SessionDB(str(tmp_path / "warm.db"))
    store.create_session("q", "cli")
    store.append_message("q", "user", "warm")
    store.close()


def test_closing_the_last_store_closes_its_files_descriptors_and_helpers(
    tmp_path: Path, warm: None
) -> None:
    before, threads = open_descriptors(), helpers()
    for index in range(40):
        path = str(tmp_path / f"notebook-{index}.db")
        store = SessionDB(path)
        store.create_session("q", "cli")
        queue = writequeue.for_database(path)
        write_behind_a_block(store, queue)
        assert queue.descriptors >= 2 and queue.stats().waits >= 1  # a helper blocked
        assert helpers() - threads
        store.close()
        assert queue.descriptors == 0
        for helper in helpers() - threads:
            helper.join(GUARD)
            assert not helper.is_alive()
    assert open_descriptors() <= before  # none left open (another test's may close meanwhile)
    assert helpers() <= threads


def test_a_second_store_keeps_the_descriptors_until_it_closes(db: str, warm: None) -> None:
    first, second = SessionDB(db), SessionDB(db)
    queue = writequeue.for_database(db)
    write_behind_a_block(first, queue)
    kept = queue.descriptors
    first.close()
    assert queue.descriptors == kept  # the second store still writes here
    second.append_message("q", "user", "still queued")
    second.close()
    assert queue.descriptors == 0


def test_a_file_opened_again_queues_as_before(db: str, warm: None) -> None:
    """The last store's close unregisters the file's queue (a process opening thousands of
    files keeps no object per file); a store opened again gets a queue of its own."""
    store = SessionDB(db)
    first = store.uow.write_queue
    assert first is not None
    write_behind_a_block(store, first)
    gone = weakref.ref(first)
    del first
    store.close()
    gc.collect()
    assert gone() is None
    again = SessionDB(db)
    queue = again.uow.write_queue
    assert queue is not None and writequeue.for_database(db) is queue
    write_behind_a_block(again, queue)
    assert queue.stats().turns >= 2 and queue.stats().waits >= 1 and queue.stats().fallbacks == 0
    again.close()
    assert queue.descriptors == 0
    with SessionDB(db) as reader:
        texts = [m["content"] for m in reader.get_messages("q")]
    assert texts.count("held") == 2 and texts.count("behind") == 2


def test_an_abandoned_wait_closes_its_descriptor_when_it_ends(db: str, warm: None) -> None:
    """A writer that gave up its place (the line did not move) leaves a helper blocked for it;
    closing the store retires that descriptor, and the helper closes it once its wait ends."""
    ahead = writequeue.WriteQueue(db)  # another member of the line, with descriptors of its own
    ahead.attach()
    queue = writequeue.for_database(db)
    before, threads = open_descriptors(), helpers()
    store = SessionDB(db)
    patience, queue.wait_timeout = queue.wait_timeout, 0.2
    try:
        with ahead.turn() as turn:
            assert turn.queued
            with store.transaction():  # its turn gives up past 0.2 s and falls back
                store.append_message("q", "user", "fell back")
            assert queue.stats().fallback_reasons.get("wait timed out") == 1
            blocked = helpers() - threads
            assert blocked
            store.close()
            assert queue.descriptors == 1  # the helper still waits for the abandoned place
        wait_until(lambda: queue.descriptors == 0, "the abandoned place's descriptor to close")
        for helper in blocked:
            helper.join(GUARD)
    finally:
        queue.wait_timeout = patience
        ahead.detach()
    assert ahead.descriptors == 0
    assert open_descriptors() <= before and helpers() <= threads


def test_an_adoption_leaves_no_descriptor(tmp_path: Path, warm: None) -> None:
    """Adopting a file of the original store lines up in the writer queue (the processes that
    open it at once wait behind the one migrating): that turn's descriptors close with it."""
    paths = [tmp_path / f"legacy-{index}.db" for index in range(10)]
    for path in paths:
        build_legacy_db(path, 5)
    before = open_descriptors()
    for path in paths:
        migrate.ensure_head(to_url(path))
        assert Path(f"{path}-writer.lock").is_file()  # the adoption took a turn in the line
    assert open_descriptors() <= before


def test_a_forked_child_closes_its_own_descriptors_and_the_parent_queues_on(
    db: str, warm: None
) -> None:
    store = SessionDB(db)
    queue = writequeue.for_database(db)
    write_behind_a_block(store, queue)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            child_queue = writequeue.for_database(db)
            write_behind_a_block(store, child_queue)  # the inherited store, its own descriptors
            opened = child_queue.descriptors
            store.close()
            ok = opened >= 2 and child_queue.descriptors == 0
            os.write(write_end, b"Y" if ok else b"N")
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    try:
        assert os.read(read_end, 1) == b"Y"
    finally:
        os.close(read_end)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    write_behind_a_block(store, queue)  # the parent's descriptors were never the child's
    assert queue.descriptors >= 2
    store.close()
    assert queue.descriptors == 0
