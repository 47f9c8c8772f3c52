"""Retrying: the policy for a database found locked, and the patience for a server not reached.

A unit that meets a lock before it ran anything is retried up to ``attempts`` times,
``random.uniform(min_wait, max_wait)`` s apart: the original store's policy, which keeps
competing processes from retrying in lockstep. A PostgreSQL server that cannot be reached (a
restart, a failover) is waited for by time instead (:class:`Patience`). Every pause goes
through :func:`sleep`, which awaits inside SQLAlchemy's asyncio greenlet, so an
``AsyncSessionDB``'s event loop keeps serving other tasks while one call waits.
"""

from __future__ import annotations

import asyncio
import logging
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Engine

from hermes_store.errors import (
    DatabaseLockedError,
    DatabaseUnavailableError,
    WriteNotLandedError,
    WriteOutcomeUnknownError,
    connection_lost,
    login_refused,
    mapped_errors,
)
from hermes_store.uow.counters import Counters

log = logging.getLogger(__name__)

#: How long a call waits for an unreachable server before DatabaseUnavailableError.
DEFAULT_UNAVAILABLE_TIMEOUT_S = 30.0
#: The pauses while waiting for it: from this, doubling (jittered) up to the next one.
UNAVAILABLE_FIRST_WAIT_S = 0.05
UNAVAILABLE_MAX_WAIT_S = 1.0
#: A call still waiting for the server says so this often (WARNING).
UNAVAILABLE_LOG_EVERY_S = 5.0


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long to retry a unit that found the database locked; and, separately,
    how long a call waits for a PostgreSQL server it cannot reach (``unavailable_timeout``
    seconds: a restart or failover takes seconds, far longer than a lock retry's budget)."""

    attempts: int = 15
    min_wait: float = 0.020
    max_wait: float = 0.150
    unavailable_timeout: float = DEFAULT_UNAVAILABLE_TIMEOUT_S

    def waits(self) -> Iterator[float]:
        """One random pause before each retry (so ``attempts - 1`` of them)."""
        for _ in range(self.attempts - 1):
            yield random.uniform(self.min_wait, self.max_wait)


def pause(
    policy: RetryPolicy, waits: Iterator[float], error: BaseException | None, counters: Counters
) -> None:
    """The pause before the next attempt after a lock (counted as a retry), or, once
    ``waits`` is spent, :class:`DatabaseLockedError`."""
    try:
        delay = next(waits)
    except StopIteration:
        raise DatabaseLockedError(
            f"the database stayed locked through {policy.attempts} attempts: {error}"
        ) from error
    counters.record_retry()
    log.debug("database busy (%s); retrying in %.0f ms", error, delay * 1000)
    sleep(delay)


def sleep(delay: float) -> None:
    """``time.sleep``, except inside SQLAlchemy's asyncio greenlet (``AsyncSessionDB`` on
    PostgreSQL), where the pause awaits: the event loop keeps serving other tasks."""
    if "greenlet" in sys.modules:
        from sqlalchemy.util.concurrency import await_only, in_greenlet

        if in_greenlet():
            await_only(asyncio.sleep(delay))
            return
    time.sleep(delay)


class Patience:
    """One call's wait for a server it cannot reach: a deadline counted from the first failure
    (the policy's ``unavailable_timeout``), jittered pauses growing from 50 ms to 1 s (a
    fleet does not reconnect in lockstep), progress logged. The pauses go through
    :func:`sleep`, so an asyncio store's loop keeps running."""

    __slots__ = ("counters", "logged", "maybe_landed", "policy", "started", "tries", "wait")

    def __init__(
        self, policy: RetryPolicy, counters: Counters, *, maybe_landed: bool = False
    ) -> None:
        self.policy = policy
        self.counters = counters
        self.started: float | None = None
        self.logged = 0.0
        self.tries = 0
        self.wait = UNAVAILABLE_FIRST_WAIT_S
        #: An earlier attempt of this write was lost after it was sent (an idempotent write,
        #: retried): past the deadline its outcome is unknown, not "did not land".
        self.maybe_landed = maybe_landed

    def pause(self, error: sa_exc.DBAPIError, *, write: bool) -> None:
        """Wait before the next attempt; past the deadline, report the server unreachable: a
        write says whether it may have landed (an attempt was lost in flight) or did not."""
        now = time.monotonic()
        if self.started is None:
            self.started = self.logged = now
        waited = now - self.started
        timeout = self.policy.unavailable_timeout
        if waited >= timeout:
            unreachable = (
                f"the database stayed unreachable for {waited:.1f} s ({self.tries} retries)"
            )
            if write and self.maybe_landed:
                raise WriteOutcomeUnknownError(
                    f"{unreachable}; an attempt was lost after it was sent, so the write may "
                    f"have landed: {error.orig}"
                ) from error
            if write:
                raise WriteNotLandedError(
                    f"{unreachable}; the write did not land: {error.orig}"
                ) from error
            raise DatabaseUnavailableError(f"{unreachable}: {error.orig}") from error
        delay = min(random.uniform(0.5, 1.0) * self.wait, timeout - waited)
        self.wait = min(self.wait * 2, UNAVAILABLE_MAX_WAIT_S)
        self.counters.record_retry()
        if self.tries == 0:
            log.info("database unreachable (%s); retrying for up to %.0f s", error.orig, timeout)
        elif now - self.logged >= UNAVAILABLE_LOG_EVERY_S:
            self.logged = now
            log.warning(
                "the database has been unreachable for %.1f s (%s); still retrying, for up to "
                "%.0f s",
                waited,
                error.orig,
                timeout,
            )
        self.tries += 1
        sleep(delay)


def wait_for_server(engine: Engine, policy: RetryPolicy) -> None:
    """Opening's first connection to a server, waited for as a call waits (:class:`Patience`):
    a store opened during a restart or failover (no primary reachable yet) opens once one is,
    within ``unavailable_timeout``, instead of failing at once. A server that refuses the
    login itself (a missing database or role, bad credentials) fails at once. The connection
    goes back to the engine's pool for the open-time check that follows."""
    patience = Patience(policy, Counters(0))
    with mapped_errors():
        while True:
            try:
                engine.connect().close()
            except sa_exc.DBAPIError as error:
                if not connection_lost(error) or login_refused(error):
                    raise
                patience.pause(error, write=False)
                continue
            if patience.tries:
                log.info("database reached after %d retries; opening", patience.tries)
            return
