"""A chaos writer process, and the reading of what the writers journaled.

Run as ``python -m tests.support.chaos_workers CONFIG_JSON`` (the test SIGKILLs and respawns these).
Each thread journals, per operation, an intent line before the write and an ack line after it
(fsynced before the ack is announced), so the journal says what was acknowledged and which
writes were in flight (may or may not have landed). Each ack is also announced on stdout
(one byte line), which drives the test's kill schedule.
"""

from __future__ import annotations

import json
import os
import random
import sqlite3
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SHARED = "chaos-shared"


def own_session(worker: int) -> str:
    return f"chaos-w{worker}"


def content_of(key: str, index: int) -> str:
    """Unique text per message; ``{key}m{index}`` is one searchable word on both backends."""
    return f"chaos {key}m{index} lorem ipsum"


def word_of(content: str) -> str:
    return content.split()[1]


# -- the writer process -------------------------------------------------------------------------


def _open(config: dict[str, Any]) -> Any:
    """The store (or the original store), retried while a restarting server or a busy file
    refuses it; bounded, so a broken database still fails the writer."""
    last: BaseException | None = None
    for _ in range(200):
        try:
            if config["kind"] == "seed":
                from tests.support.seed_store import SeedSessionDB

                return SeedSessionDB(config["target"])
            from hermes_store import SessionDB

            return SessionDB(config["target"])
        except Exception as error:
            last = error
            time.sleep(0.05)  # back off: the server is restarting or the file is busy
    raise RuntimeError(f"could not open {config['target']}: {last!r}")


def writer_main(config: dict[str, Any]) -> None:
    from hermes_store import HermesStoreError

    store = _open(config)
    seed = config["kind"] == "seed"
    expected: tuple[type[BaseException], ...] = (sqlite3.Error,) if seed else (HermesStoreError,)
    worker, incarnation = config["worker"], config["incarnation"]
    announce = threading.Lock()

    def thread_main(thread: int) -> None:
        rng = random.Random(f"{config['seed']}-{worker}-{incarnation}-{thread}")
        path = Path(config["journal"]) / f"w{worker}-i{incarnation}-t{thread}.jsonl"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            for op in range(config["ops"]):
                key = f"w{worker}i{incarnation}t{thread}o{op}"
                sid = SHARED if rng.random() < 0.5 else own_session(worker)
                roll = rng.random()
                kind = "tokens" if roll < 0.3 else "bulk" if roll < 0.5 and not seed else "append"
                intent: dict[str, Any] = {"k": key, "op": kind, "sid": sid}
                call: Callable[[], Any]
                if kind == "tokens":
                    tokens = rng.randint(1, 9)
                    intent["tokens"] = tokens
                    call = _tokens(store, sid, tokens)
                elif kind == "bulk":
                    contents = [content_of(key, i) for i in range(rng.randint(2, 5))]
                    intent["contents"] = contents
                    rows = [{"role": "user", "content": c} for c in contents]
                    call = _bulk(store, sid, rows)
                else:
                    intent["contents"] = [content_of(key, 0)]
                    call = _append(store, sid, intent["contents"][0])
                os.write(fd, (json.dumps(intent) + "\n").encode())
                try:
                    result = call()
                except expected as error:
                    os.write(fd, (json.dumps({"k": key, "fail": repr(error)}) + "\n").encode())
                    time.sleep(0.02)  # back off (a restarting server), not synchronisation
                    continue
                except Exception as error:
                    os.write(fd, (json.dumps({"k": key, "raw": repr(error)}) + "\n").encode())
                    continue
                ids = result if isinstance(result, list) else [result] if kind != "tokens" else []
                os.write(fd, (json.dumps({"k": key, "ack": ids}) + "\n").encode())
                os.fsync(fd)
                with announce:
                    os.write(1, b"a\n")
        finally:
            os.close(fd)

    threads = [threading.Thread(target=thread_main, args=(t,)) for t in range(config["threads"])]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    store.close()


def _tokens(store: Any, sid: str, tokens: int) -> Callable[[], Any]:
    return lambda: store.update_token_counts(sid, input_tokens=tokens, output_tokens=2 * tokens)


def _bulk(store: Any, sid: str, rows: list[dict[str, Any]]) -> Callable[[], Any]:
    return lambda: store.append_messages(sid, rows)


def _append(store: Any, sid: str, content: str) -> Callable[[], Any]:
    return lambda: store.append_message(sid, "user", content)


# -- reading the journals -----------------------------------------------------------------------


@dataclass
class Op:
    key: str
    op: str
    sid: str
    contents: list[str] = field(default_factory=list)
    tokens: int = 0
    acked: list[int] | None = None  # the ids returned ([] for tokens); None: not acknowledged
    failed: str | None = None
    raw: str | None = None


def read_journals(folder: Path) -> dict[str, Op]:
    """Every operation any writer started; a torn last line (killed mid-write) is ignored."""
    ops: dict[str, Op] = {}
    for path in sorted(folder.glob("*.jsonl")):
        for line in _complete_lines(path):
            entry = json.loads(line)
            key = entry["k"]
            if "op" in entry:
                ops[key] = Op(
                    key,
                    entry["op"],
                    entry["sid"],
                    entry.get("contents", []),
                    entry.get("tokens", 0),
                )
            elif "ack" in entry:
                ops[key].acked = entry["ack"]
            elif "fail" in entry:
                ops[key].failed = entry["fail"]
            else:
                ops[key].raw = entry["raw"]
    return ops


def _complete_lines(path: Path) -> Iterator[str]:
    data = path.read_text()
    lines = data.split("\n")
    yield from (line for line in lines[:-1] if line)  # the part after the last \n is torn


if __name__ == "__main__":
    writer_main(json.loads(sys.argv[1]))
