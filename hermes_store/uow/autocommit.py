"""PostgreSQL's one-statement path: a write or read of one statement as its own transaction.

On the engine's autocommit twin (:func:`hermes_store.engine.factory.autocommit_engine`) the
statement is the whole round trip: no BEGIN, no COMMIT. A deadlock or serialization failure
(the server rolled the statement back) is retried by the retry policy; a server that cannot be
reached is waited for (:class:`~hermes_store.uow.retry.Patience`). A lost connection is retried
only when the statement provably never reached the server (connecting failed, or the driver
failed to send it) or when it is idempotent; otherwise :class:`WriteOutcomeUnknownError` says
the write may have landed: an unacknowledged write is never applied twice. A write whose
server stayed unreachable past the patience gets :class:`WriteNotLandedError` when no attempt
was ever sent, :class:`WriteOutcomeUnknownError` when one was lost in flight.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection, Engine

from hermes_store.engine.factory import autocommit_engine
from hermes_store.errors import (
    WriteOutcomeUnknownError,
    connection_lost,
    is_retryable,
    mapped_errors,
    never_sent,
)
from hermes_store.uow import retry
from hermes_store.uow.counters import Counters

log = logging.getLogger(__name__)

T = TypeVar("T")


def close_quietly(conn: Connection) -> None:
    """Give back a connection after a failed statement (a broken one is discarded)."""
    try:
        conn.close()
    except sa_exc.DBAPIError as error:
        log.info("discarding a broken connection: %s", error.orig)
        conn.invalidate()


class Autocommit:
    """One-statement units on a PostgreSQL engine's autocommit twin."""

    def __init__(self, engine: Engine, policy: retry.RetryPolicy, counters: Counters) -> None:
        self.base = engine
        self.policy = policy
        self.counters = counters

    @property
    def engine(self) -> Engine:
        """The autocommit twin of the engine (made once, kept by the engine factory)."""
        return autocommit_engine(self.base)

    def run(
        self,
        fn: Callable[[Connection], T],
        *,
        write: bool,
        idempotent: bool,
        maybe_landed: bool = False,
    ) -> T:
        """``fn(connection)``, one statement, with its retries; driver errors named.
        ``maybe_landed``: an earlier attempt (a lost group) may have landed already."""
        with mapped_errors(write=write):
            return self._attempts(fn, write=write, idempotent=idempotent, maybe_landed=maybe_landed)

    def _attempts(
        self, fn: Callable[[Connection], T], *, write: bool, idempotent: bool, maybe_landed: bool
    ) -> T:
        engine = self.engine
        waits = self.policy.waits()
        patience = retry.Patience(self.policy, self.counters, maybe_landed=maybe_landed)
        while True:
            try:
                conn = engine.connect()
            except sa_exc.DBAPIError as error:
                # Nothing was sent: retrying cannot apply anything twice.
                if not (is_retryable(error) or connection_lost(error)):
                    raise
                patience.pause(error, write=write)
                continue
            try:
                result = fn(conn)
            except sa_exc.DBAPIError as error:
                close_quietly(conn)
                # A deadlock or serialization failure rolled the statement back on the server.
                if is_retryable(error):
                    retry.pause(self.policy, waits, error, self.counters)
                    continue
                if not connection_lost(error):
                    raise
                if never_sent(error):
                    patience.pause(error, write=write)
                    continue
                if idempotent:  # sent, maybe run: running it again equals running it once
                    patience.maybe_landed = True
                    patience.pause(error, write=write)
                    continue
                raise WriteOutcomeUnknownError(
                    "lost the database connection while the write was in flight: it may have "
                    f"landed (not retried, so it is never applied twice): {error.orig}"
                ) from error
            except BaseException:
                close_quietly(conn)
                raise
            conn.close()
            self.counters.count(write)
            return result
