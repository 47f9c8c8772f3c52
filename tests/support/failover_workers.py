"""A writer process for tests/faults/test_failover.py: THREADS threads, each on a session of its
own (``<tag>-<thread>``), alternating ``append_message`` (content ``<tag>-<thread>-<n>``) and
``update_token_counts(input_tokens=1)`` until stdin closes. Each outcome is one line on stdout
(tab-separated): ``kind thread op content started finished detail`` with ``kind`` one of
``ok``, ``unknown`` (may or may not have landed), ``failed`` (did not land) and ``error``
(anything else), ``op`` ``append`` or ``tokens``, and the call's start and end from
``time.time()``."""

from __future__ import annotations

import functools
import sys
import threading
import time
from collections.abc import Callable

from hermes_store import SessionDB
from hermes_store.errors import (
    DatabaseUnavailableError,
    HermesStoreError,
    WriteNotLandedError,
)

THREADS = 4


def session_of(tag: str, thread: int) -> str:
    return f"{tag}-{thread}"


def main(url: str, tag: str) -> None:
    db = SessionDB(url, migrate="check")
    stop = threading.Event()
    out = threading.Lock()

    def say(
        kind: str, thread: int, op: str, content: str, started: float, detail: str = ""
    ) -> None:
        flat = " ".join(detail.split())  # driver messages span lines and hold tabs
        times = f"{started:.6f}\t{time.time():.6f}"
        line = f"{kind}\t{thread}\t{op}\t{content}\t{times}\t{flat[-300:]}\n"
        with out:
            sys.stdout.write(line)
            sys.stdout.flush()

    def attempt(thread: int, op: str, content: str, call: Callable[[], object]) -> None:
        started = time.time()
        try:
            call()
        except DatabaseUnavailableError as error:
            landed = not isinstance(error, WriteNotLandedError)
            say("unknown" if landed else "failed", thread, op, content, started, str(error))
            return
        except HermesStoreError as error:
            say("error", thread, op, content, started, f"{type(error).__name__}: {error}")
            return
        say("ok", thread, op, content, started)

    def writer(thread: int) -> None:
        session = session_of(tag, thread)
        number = 0
        while not stop.is_set():
            number += 1
            content = f"{session}-{number}"
            append = functools.partial(db.append_message, session, "user", content)
            attempt(thread, "append", content, append)
            tokens = functools.partial(db.update_token_counts, session, input_tokens=1)
            attempt(thread, "tokens", content, tokens)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(THREADS)]
    for thread in threads:
        thread.start()
    sys.stdin.read()  # the test closes stdin to stop the writers
    stop.set()
    for thread in threads:
        thread.join()
    db.close()


if __name__ == "__main__":
    main(*sys.argv[1:3])
