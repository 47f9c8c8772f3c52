"""A writer for the Ctrl-C tests (``python -m tests.support.interrupt_workers PATH THREADS``).

Its writer threads and its main thread append messages through group commit, each recording
the ids the store acknowledged. The main thread catches every ``KeyboardInterrupt``, counts it
and answers on stdout (``interrupt N``; ``interrupt 0``: it writes) before it writes again, so
the test sends the next SIGINT only once the last one was seen. A line on stdin stops it; it
then prints what every writer had acknowledged as one JSON line and exits.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import threading

from hermes_store import SessionDB

SESSION = "ctrl-c"


def _say(line: str) -> None:
    os.write(1, f"{line}\n".encode())


def main(path: str, threads: int) -> None:
    # Switch threads often: with the default interval the thread that leads first tends to
    # lead every group, and the main thread must lead some (and wait in others).
    sys.setswitchinterval(1e-4)
    faulthandler.register(signal.SIGUSR1)  # the test asks for every thread's stack on a hang
    store = SessionDB(path)
    store.create_session(SESSION, "cli")
    stop = threading.Event()
    acked: dict[str, list[list[object]]] = {}
    started = threading.Barrier(threads + 1)

    def write(name: str) -> None:
        mine = acked[name] = []
        started.wait()
        serial = 0
        while not stop.is_set():
            content = f"{name}-{serial}"
            serial += 1
            mine.append([store.append_message(SESSION, "user", content), content])

    def stop_on_stdin() -> None:
        sys.stdin.readline()
        stop.set()

    workers = [threading.Thread(target=write, args=(f"t{n}",)) for n in range(threads)]
    for worker in workers:
        worker.start()
    threading.Thread(target=stop_on_stdin, daemon=True).start()
    started.wait()
    own = acked["main"] = []
    interrupts = 0
    answered = -1  # "interrupt 0": ready for the first
    serial = 0
    while not stop.is_set():
        # A SIGINT is sent only once the last one was answered, and the answer is written
        # inside the try, whose loop's back edge is inside it too: the next interrupt always
        # lands where it is caught.
        try:
            while not stop.is_set():
                if answered < interrupts:
                    answered = interrupts
                    _say(f"interrupt {interrupts}")
                content = f"main-{serial}"
                serial += 1
                own.append([store.append_message(SESSION, "user", content), content])
        except KeyboardInterrupt:
            interrupts += 1
    for worker in workers:
        worker.join()
    store.close()
    _say(json.dumps({"interrupts": interrupts, "acked": acked}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
