"""A writer process for the alias tests (``python -m tests.support.alias_workers PATH TAG``).

Opens ``PATH`` (exit 3 with ``refused: ...`` when the store refuses it), says ``ready``, then
appends messages tagged ``TAG`` without pause until a line arrives on stdin (or ``COUNT`` were
written, when given as a third argument), and prints how many it wrote.
"""

from __future__ import annotations

import os
import sys
import threading

from hermes_store import SessionDB
from hermes_store.errors import DatabaseAliasError


def main(path: str, tag: str, count: int | None) -> int:
    try:
        store = SessionDB(path)
    except DatabaseAliasError as error:
        print(f"refused: {error}", flush=True)
        return 3
    store.ensure_session("s", "cli")
    stop = threading.Event()

    def stop_on_stdin() -> None:
        sys.stdin.readline()
        stop.set()

    if count is None:
        threading.Thread(target=stop_on_stdin, daemon=True).start()
    print("ready", flush=True)
    wrote = 0
    while not stop.is_set() and (count is None or wrote < count):
        store.append_message("s", "user", f"{tag} {wrote} " + "x" * 1500)
        wrote += 1
    store.close()
    os.write(1, f"wrote {wrote}\n".encode())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else None))
