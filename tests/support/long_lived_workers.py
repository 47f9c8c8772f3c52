"""Processes for tests/ops/test_long_lived.py: a writer that records what it was told was
written, and a process that runs a retention policy by itself when told to start."""

from __future__ import annotations

from typing import Any

from hermes_store import SessionDB
from hermes_store.ops import retention


def append_acknowledged(path: str, session: str, ready: Any, stop: Any, pipe: Any) -> None:
    """Appends to ``session`` (created first) one message after another until ``stop`` is set,
    then sends (ids acknowledged, errors as text) down ``pipe``: an error is recorded and the
    writer goes on, as an agent would with its next turn."""
    store = SessionDB(path)
    acknowledged: list[int] = []
    errors: list[str] = []
    try:
        store.create_session(session, "gateway")
        ready.set()
        while not stop.is_set():
            try:
                acknowledged.append(
                    store.append_message(session, "user", f"turn {len(acknowledged)} kept")
                )
            except Exception as error:  # reported to the test, which fails on any
                errors.append(f"{type(error).__name__}: {error}")
    except Exception as error:  # the session itself could not be created
        errors.append(f"{type(error).__name__}: {error}")
    finally:
        ready.set()
        store.close()
        pipe.send((acknowledged, errors))


def retention_when_told(path: str, days: float, arrived: Any, start: Any, pipe: Any) -> None:
    """Opens the store, says it ``arrived``, waits for ``start``, then runs the policy by
    itself (:func:`retention.maybe_run`) and sends what it did: None when it did not run (the
    day was claimed), else (sessions, messages) deleted; an error as text."""
    store = SessionDB(path)
    try:
        arrived.set()
        start.wait(120)
        report = retention.maybe_run(store.uow, retention.Policy(days))
        pipe.send(None if report is None else (report.sessions, report.messages))
    except Exception as error:  # reported to the test
        pipe.send(f"{type(error).__name__}: {error}")
    finally:
        store.close()
