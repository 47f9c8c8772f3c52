"""A writer process for tests/faults/test_pgbouncer_restart.py: THREADS threads appending to one
session until stdin closes, each outcome one line on stdout (tab-separated):
``ok <thread> <content> <time>``, ``unknown ...`` (may or may not have landed), ``failed ...``
(did not land) and ``error ...`` (anything else), with ``time`` from ``time.time()``."""

from __future__ import annotations

import sys
import threading
import time

from hermes_store import SessionDB
from hermes_store.errors import (
    DatabaseUnavailableError,
    HermesStoreError,
    WriteNotLandedError,
)

THREADS = 4


def main(url: str, session: str, tag: str) -> None:
    db = SessionDB(url, migrate="check")
    stop = threading.Event()
    out = threading.Lock()

    def say(kind: str, thread: int, content: str, detail: str = "") -> None:
        flat = " ".join(detail.split())  # driver messages span lines and hold tabs
        line = f"{kind}\t{thread}\t{content}\t{time.time():.6f}\t{flat}\n"
        with out:
            sys.stdout.write(line)
            sys.stdout.flush()

    def writer(thread: int) -> None:
        number = 0
        while not stop.is_set():
            number += 1
            content = f"{tag}-{thread}-{number}"
            try:
                db.append_message(session, "user", content)
            except DatabaseUnavailableError as error:
                landed = not isinstance(error, WriteNotLandedError)
                say("unknown" if landed else "failed", thread, content, str(error)[-200:])
                continue
            except HermesStoreError as error:
                say("error", thread, content, f"{type(error).__name__}: {error}"[:300])
                continue
            say("ok", thread, content)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(THREADS)]
    for thread in threads:
        thread.start()
    sys.stdin.read()  # the test closes stdin to stop the writers
    stop.set()
    for thread in threads:
        thread.join()
    db.close()


if __name__ == "__main__":
    main(*sys.argv[1:4])
