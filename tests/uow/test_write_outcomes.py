"""The two outcomes of a write the server did not acknowledge, as the Unit of Work names them.

``WriteNotLandedError`` only when the store knows nothing landed; ``WriteOutcomeUnknownError``
once an attempt was lost after it was sent. Both are ``DatabaseUnavailableError``s, so code
written for the one class keeps working. The driver errors here are real: psycopg failing to
connect to a port nothing listens on.
"""

from __future__ import annotations

import socket

import psycopg
import pytest
from sqlalchemy import exc as sa_exc

import hermes_store
from hermes_store import (
    DatabaseUnavailableError,
    RetryPolicy,
    WriteNotLandedError,
    WriteOutcomeUnknownError,
)
from hermes_store.uow import retry
from hermes_store.uow.counters import Counters

pytestmark = pytest.mark.unit


def refused_connection() -> sa_exc.DBAPIError:
    """A real driver error: connecting to a loopback port that nothing listens on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    try:
        psycopg.connect(host="127.0.0.1", port=port, connect_timeout=5).close()
    except psycopg.OperationalError as orig:
        wrapped = sa_exc.DBAPIError.instance(None, None, orig, psycopg.Error)
        assert isinstance(wrapped, sa_exc.DBAPIError)
        return wrapped
    raise AssertionError(f"something listens on port {port}")


def test_both_outcomes_are_unavailable_errors_exported_at_the_root() -> None:
    for outcome in (WriteNotLandedError, WriteOutcomeUnknownError):
        assert issubclass(outcome, DatabaseUnavailableError)
        assert outcome.__name__ in hermes_store.__all__
    assert not issubclass(WriteNotLandedError, WriteOutcomeUnknownError)
    assert not issubclass(WriteOutcomeUnknownError, WriteNotLandedError)


def test_patience_past_its_deadline_names_the_outcome() -> None:
    """Nothing ever sent: did not land. An attempt lost in flight: unknown. A read: only
    unavailable (it wrote nothing either way)."""
    error = refused_connection()
    policy = RetryPolicy(unavailable_timeout=0.0)

    def outcome(*, write: bool, maybe_landed: bool) -> DatabaseUnavailableError:
        patience = retry.Patience(policy, Counters(50), maybe_landed=maybe_landed)
        with pytest.raises(DatabaseUnavailableError) as raised:
            patience.pause(error, write=write)
        assert raised.value.__cause__ is error
        return raised.value

    assert type(outcome(write=True, maybe_landed=False)) is WriteNotLandedError
    assert "did not land" in str(outcome(write=True, maybe_landed=False))
    assert type(outcome(write=True, maybe_landed=True)) is WriteOutcomeUnknownError
    assert "may have landed" in str(outcome(write=True, maybe_landed=True))
    assert type(outcome(write=False, maybe_landed=False)) is DatabaseUnavailableError
