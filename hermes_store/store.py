"""``SessionDB``: the original store's ``SessionDB`` as a repository over the Unit of Work.

Same method names, keywords, defaults, return shapes and ``ValueError`` messages as the
contract; every write is one unit (``BEGIN IMMEDIATE`` + jittered retry), every read a deferred
transaction. A method checks its arguments, then hands the work to its backend's objects, each
looked up once when the store opens: the writes that differ per backend to
:mod:`hermes_store.repo` (``Statements``), search to :mod:`hermes_store.search` (``Searcher``).
Hot paths use Core statements (SQLAlchemy caches their compiled form); the ORM models in
:mod:`hermes_store.models` remain the query surface for applications.
"""

from __future__ import annotations

import json
import logging
import os
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, cast

import sqlalchemy as sa
from sqlalchemy import delete, func, or_, select, update
from sqlalchemy.engine import Connection, Engine, Row

from hermes_store import search, titles, validate
from hermes_store.echo import echoed
from hermes_store.engine import files, placement
from hermes_store.engine.factory import (
    READER_BUSY_TIMEOUT_S,
    WRITER_BUSY_TIMEOUT_S,
    Target,
    check_synchronous,
    create_engine,
    default_db_path,
    refuse_sqlite_aliases,
    sqlite_file,
    to_url,
)
from hermes_store.errors import (
    InvalidInputError,
    StoreConfigError,
    StoreMisuseError,
    extras_named,
)
from hermes_store.ops import retention
from hermes_store.repo import dialects, listing, statements
from hermes_store.repo.messages import (
    decode_tool_calls,
    from_json,
    messages_params,
    messages_statement,
)
from hermes_store.rows import (
    ConversationTurn,
    ExportRecord,
    MessageRow,
    SearchHit,
    SessionListRow,
    SessionRow,
)
from hermes_store.schema.migrate import check_head, ensure_head
from hermes_store.tables import messages_table as M
from hermes_store.tables import sessions_table as S
from hermes_store.uow import shared
from hermes_store.uow.retry import wait_for_server
from hermes_store.uow.unit import RetryPolicy, StoreStats, UnitOfWork

if TYPE_CHECKING:
    from hermes_store.ops.backup import BackupReport

log = logging.getLogger(__name__)

RowDict = dict[str, Any]
#: How opening treats a database behind head: migrate it (``auto``), refuse it without
#: changing a byte (``check``: rolling deploys, notebooks, read-only tools), or neither check
#: nor migrate (``never``).
MIGRATE_MODES = ("auto", "check", "never")


def _bring_to_head(target: Engine | sa.URL, mode: str, retry: RetryPolicy) -> None:
    if mode == "auto":
        ensure_head(target, retry=retry)
    elif mode == "check":
        check_head(target)


def _check_text(name: str, value: object, *, required: bool = False, nul_ok: bool = True) -> None:
    """Refuse, before anything is written, text the database would mangle or reject."""
    if value is None:
        if required:
            raise InvalidInputError(f"{name} is required")
        return
    if not isinstance(value, str):
        raise InvalidInputError(f"{name} must be a string, not {type(value).__name__}")
    if value.isascii():  # O(1) in CPython: nothing to encode-check (the hot path's usual case)
        if not nul_ok and "\x00" in value:
            raise InvalidInputError(
                f"{name} contains a NUL character, which PostgreSQL text cannot hold"
            )
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidInputError(f"{name} is not valid Unicode text: {error.reason}") from None
    if not nul_ok and "\x00" in value:
        raise InvalidInputError(
            f"{name} contains a NUL character, which PostgreSQL text cannot hold"
        )


def _to_json(name: str, value: Any) -> str | None:
    """JSON text when truthy, NULL when falsy, as the original store writes it; fails before
    writing."""
    try:
        if not value:
            return None
    except Exception as error:  # no truth value (a numpy array): not the list or dict meant
        raise InvalidInputError(
            f"{name} must be JSON data (a list, a dict ...), not a {type(value).__name__} "
            f"without a truth value ({type(error).__name__}: {error})"
        ) from None
    try:
        # No NaN or Infinity: not JSON (jq and most readers refuse the whole text).
        text = json.dumps(value, allow_nan=False)
        if "\\ud" in text:  # a character beyond the BMP, or a lone surrogate: see below
            json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        # Escaped, a lone surrogate looks like half of a pair ("\ud800" "\udc00" are read
        # back as one character): it would come back as another string, so it is refused as
        # it is in text.
        raise InvalidInputError(
            f"{name} holds text that is not Unicode (a lone surrogate)"
        ) from None
    except (TypeError, ValueError, RecursionError) as error:
        if isinstance(error, ValueError) and str(error).startswith("Out of range float"):
            raise InvalidInputError(f"{name} holds NaN or an infinity, not JSON") from None
        raise InvalidInputError(f"{name} cannot be stored as JSON: {error}") from error
    return text


class _ClosedUnitOfWork:
    """A closed store's Unit of Work: every call meets a clear error. The store's writer was
    let go of (another store on the file may hold it now): carrying on, its calls became a
    second writer of the file in this process, waiting on the first."""

    def __getattr__(self, name: str) -> Any:
        raise StoreMisuseError("this SessionDB is closed")


_CLOSED = _ClosedUnitOfWork()


def _row_dict(row: Row[Any]) -> RowDict:
    return dict(row._mapping)


_RetentionPolicy = retention.Policy
_RetentionJob = retention.Background


def _background_retention(store: SessionDB, policy: retention.Policy) -> retention.Background:
    return retention.Background(store.uow, policy)


class SessionDB:
    """Drop-in for the original store's ``SessionDB``, on a SQLite file or any SQLAlchemy URL.

    ``db_path`` is a file path (``None``: ``$HERMES_HOME/state.db``), a URL such as
    ``postgresql+psycopg://host/db``, or an Engine. Opening brings the schema to head,
    adopting files written by the original store; it takes no lock when already at head.
    ``migrate="check"`` refuses a database behind head with :class:`SchemaBehindError` and
    changes nothing (old instances during a rolling deploy, notebooks on the live file);
    ``migrate="never"`` neither checks nor migrates. ``clock`` (default ``time.time``) gives
    every timestamp the store writes and the prune cutoff. ``schema`` (PostgreSQL) and
    ``version_table`` place the tables beside an application's own (default: the
    ``HERMES_STORE_SCHEMA`` and ``HERMES_STORE_VERSION_TABLE`` environment variables).
    ``max_message_bytes`` (16 MiB; ``None``: no limit) bounds one message's text: a larger
    one is refused with :class:`InvalidInputError` before anything is written.
    ``retention`` (a :class:`hermes_store.ops.retention.Policy`) deletes what the policy
    selects by itself: at open, at most once a day across processes (recorded beside the
    file; for a server database under ``$HERMES_HOME/retention``), in a background thread of
    short steps that ``close`` stops.
    """

    MAX_TITLE_LENGTH = titles.MAX_TITLE_LENGTH

    def __init__(
        self,
        db_path: Target | None = None,
        *,
        retry: RetryPolicy | None = None,
        checkpoint_every: int = 50,
        writer_busy_timeout: float | None = None,
        synchronous: str = "full",
        migrate: str = "auto",
        clock: Callable[[], float] = time.time,
        schema: str | None = None,
        version_table: str | None = None,
        max_message_bytes: int | None = validate.DEFAULT_MAX_MESSAGE_BYTES,
        retention: retention.Policy | None = None,
    ) -> None:
        validate.target(db_path)
        if retention is not None and not isinstance(retention, _RetentionPolicy):
            raise InvalidInputError(
                f"retention must be a retention Policy, not {echoed(retention)}"
            )
        #: The most UTF-8 bytes of text one message may hold (None: no limit); see
        #: :data:`hermes_store.validate.DEFAULT_MAX_MESSAGE_BYTES`.
        self.max_message_bytes = validate.max_message_bytes(max_message_bytes)
        #: Where the tables live (:mod:`hermes_store.engine.placement`): checked before anything.
        self.placement = placement.Placement.resolve(schema, version_table)
        if not callable(clock):
            raise InvalidInputError(
                f"clock must be a callable returning seconds, not {echoed(clock)}"
            )
        #: Every timestamp the store writes (started_at, ended_at, message timestamps) and the
        #: prune cutoff; injectable so tests order events without sleeping.
        self.clock = clock
        if migrate not in MIGRATE_MODES:
            raise InvalidInputError(
                f"migrate must be one of {', '.join(MIGRATE_MODES)}, not {echoed(migrate)}"
            )
        validate.open_options(retry, checkpoint_every, writer_busy_timeout)
        target: Target = default_db_path() if db_path is None else db_path
        given = target if isinstance(target, Engine) else None
        options = shared.StoreOptions(
            retry=retry or RetryPolicy(),
            checkpoint_every=checkpoint_every,
            writer_busy_timeout=(
                WRITER_BUSY_TIMEOUT_S if writer_busy_timeout is None else writer_busy_timeout
            ),
            reader_busy_timeout=READER_BUSY_TIMEOUT_S,
            synchronous=check_synchronous(synchronous),
            engine=None if given is None else id(given),
        )
        self._owns_engine = given is None
        url = given.url if given is not None else to_url(target)  # type: ignore[arg-type]
        self.db_path = None if given is not None else target
        self.placement.check_dialect(url.get_backend_name())
        path = sqlite_file(url)
        self._file: files.FileKey | None = None
        self._dropped: weakref.finalize[Any, Any] | None = None
        with placement.using(self.placement):
            if path is not None:
                # A second name first: reading a live file through a name whose WAL is not
                # beside it would take it for a torn one instead of saying what is wrong.
                refuse_sqlite_aliases(url, None if given is not None else target)
                # Brought to head first (without the write lock when already there); then the
                # file's one writer in this process is shared.
                _bring_to_head(url, migrate, options.retry)
                self._file = files.file_key(path)
                self.uow = shared.acquire(
                    self._file, options, lambda: self._make_uow(target, options), str(path)
                )
                # A store dropped without close() gives its share of the writer back (the
                # last close on the file then checkpoints and lets every connection go).
                self._dropped = dropped = weakref.finalize(self, shared.forget, self._file)
                dropped.atexit = False
                self.engine: Engine = self.uow.engine
            else:
                self.uow, _ = self._make_uow(target, options, migrate=migrate)
                self.engine = self.uow.engine
        dialect = self.engine.dialect
        self.is_sqlite = dialect.name == "sqlite"
        # The backend is chosen here, once: no method asks for the dialect again.
        self._statements = dialects.for_dialect(dialect)
        self._searcher = search.for_dialect(dialect.name)
        self._nul_ok = self._statements.holds_nul
        self._closed = False
        #: The retention policy's background run (None without a policy).
        self.retention_job: _RetentionJob | None = None
        if retention is not None:
            try:
                self.retention_job = _background_retention(self, retention)
            except BaseException:
                self.close()
                raise

    @staticmethod
    def _make_uow(
        target: Target, options: shared.StoreOptions, *, migrate: str | None = None
    ) -> tuple[UnitOfWork, bool]:
        """The engine and unit of work for ``target``; ``migrate``: the open-time mode for a
        server (SQLite files are brought to head before the shared writer is looked up)."""
        with extras_named():
            engine = create_engine(
                target,
                writer_busy_timeout=options.writer_busy_timeout,
                reader_busy_timeout=options.reader_busy_timeout,
                synchronous=options.synchronous,
            )
        owns = not isinstance(target, Engine)
        if engine.dialect.name == "sqlite" and sqlite_file(engine.url) is None:
            if owns:
                engine.dispose()
            raise StoreConfigError(
                "an in-memory SQLite database cannot hold a store: each of its connections "
                "(the writer, every reader thread) would see a database of its own. Use a "
                "file, e.g. SessionDB(tmp_path / 'state.db')"
            )
        try:
            if migrate is not None:  # a server: SQLite files are brought to head before this
                if migrate != "never":
                    # During a restart or failover: wait for a server as calls do.
                    wait_for_server(engine, options.retry)
                _bring_to_head(engine, migrate, options.retry)
                if owns:
                    engine.pool.dispose()  # no server slot held for the open-time check
            uow = UnitOfWork(engine, retry=options.retry, checkpoint_every=options.checkpoint_every)
        except BaseException:
            if owns:
                engine.dispose()
            raise
        return uow, owns

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> SessionDB:
        """The same store on any SQLAlchemy URL (``postgresql+psycopg://...``, ``sqlite:///...``)."""
        validate.text("url", url)
        return cls(url, **kwargs)

    # -- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        """Leave the file's shared writer; the last store on a file in this process runs a
        best-effort WAL checkpoint and releases every connection. Safe to call twice."""
        if self._closed:
            return
        if self.uow.current() is not None:  # before anything is let go of: the block goes on
            raise StoreMisuseError(
                "close() inside an open unit (db.transaction(), uow.connect()): leave the "
                "block first"
            )
        self._closed = True
        if self.retention_job is not None:
            self.retention_job.stop()
        uow, self.uow = self.uow, cast(UnitOfWork, _CLOSED)
        owns = self._owns_engine
        if self._file is not None:
            if self._dropped is not None:
                self._dropped.detach()
            last, owns = shared.release(self._file)
            if not last:
                return
        uow.checkpoint()
        uow.release()
        if owns:
            self.engine.dispose()

    def transaction(self) -> AbstractContextManager[Connection]:
        """One unit for every call inside the block (this thread or asyncio task).

        One ``BEGIN IMMEDIATE`` (waiting for another writer is retried: nothing ran yet), one
        commit at the end, everything rolled back on an exception. Calls inside
        ``uow.session()``/``uow.connect()`` join it; a nested block is a SAVEPOINT in it (an
        exception leaving the nested block rolls back its writes only; blocks end innermost
        first, else :class:`~hermes_store.TransactionMisuseError` and the whole transaction is
        rolled back); other threads' calls
        wait for the lock and land after it. The block belongs to the thread that opened it:
        resumed in another one (a generator), it raises
        :class:`~hermes_store.TransactionMisuseError`. The block runs once: a lock met inside
        it rolls it back and raises :class:`~hermes_store.DatabaseLockedError`. Yields the
        unit's Connection.
        """
        return self.uow.transaction()

    def stats(self) -> StoreStats:
        """A snapshot of the counters (units, lock waits, retries, checkpoints) of the file's
        shared writer in this process; also logged at debug level."""
        snapshot = self.uow.stats
        log.debug("store stats: %s", snapshot)
        return snapshot

    def __reduce__(self) -> Any:
        """Refused: a store is connections, locks and threads of this process; another
        process opens its own."""
        raise StoreMisuseError(
            "a SessionDB cannot be pickled (or passed to another process, e.g. as a "
            "multiprocessing.Pool argument): pass its path or URL and open a SessionDB in the "
            "other process"
        )

    def __enter__(self) -> SessionDB:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _text(self, name: str, value: object, *, required: bool = False) -> None:
        _check_text(name, value, required=required, nul_ok=self._nul_ok)

    def _read(self) -> AbstractContextManager[Connection]:
        return self.uow.connect(write=False)

    # -- sessions ---------------------------------------------------------------------------

    def create_session(
        self,
        session_id: str,
        source: str,
        model: str | None = None,
        model_config: dict[str, Any] | None = None,
        system_prompt: str | None = None,
        user_id: str | None = None,
        parent_session_id: str | None = None,
    ) -> str:
        """Insert a session (an existing id is left as it is: first write wins)."""
        validate.text("session_id", session_id)
        self._text("session_id", session_id, required=True)
        self._text("source", source, required=True)
        for name, value in (
            ("model", model),
            ("system_prompt", system_prompt),
            ("user_id", user_id),
            ("parent_session_id", parent_session_id),
        ):
            self._text(name, value)
        config_json = _to_json("model_config", model_config)
        self._text("model_config", config_json)
        values = {
            "id": session_id,
            "source": source,
            "user_id": user_id,
            "model": model,
            "model_config": config_json,
            "system_prompt": system_prompt,
            "parent_session_id": parent_session_id,
            "started_at": self.clock(),
        }
        self._statements.create_session(self.uow, values)
        return session_id

    def ensure_session(
        self, session_id: str, source: str = "unknown", model: str | None = None
    ) -> None:
        """Insert-or-ignore of (id, source, model, started_at); never overwrites."""
        validate.text("session_id", session_id)
        self._text("session_id", session_id, required=True)
        self._text("source", source, required=True)
        self._text("model", model)
        values = {"id": session_id, "source": source, "model": model, "started_at": self.clock()}
        self._statements.ensure_session(self.uow, values)

    def end_session(self, session_id: str, end_reason: str) -> None:
        """Mark the session ended; the first end wins until it is reopened."""
        validate.text("session_id", session_id)
        validate.text("end_reason", end_reason, optional=True)
        self._text("end_reason", end_reason)
        statement = (
            update(S)
            .where(S.c.id == session_id, S.c.ended_at.is_(None))
            .values(ended_at=self.clock(), end_reason=end_reason)
        )
        self.uow.run_statement(lambda conn: conn.execute(statement), idempotent=True)

    def reopen_session(self, session_id: str) -> None:
        validate.text("session_id", session_id)
        statement = update(S).where(S.c.id == session_id).values(ended_at=None, end_reason=None)
        self.uow.run_statement(lambda conn: conn.execute(statement), idempotent=True)

    def update_system_prompt(self, session_id: str, system_prompt: str | None) -> None:
        validate.text("session_id", session_id)
        validate.text("system_prompt", system_prompt, optional=True)
        self._text("system_prompt", system_prompt)
        statement = update(S).where(S.c.id == session_id).values(system_prompt=system_prompt)
        self.uow.run_statement(lambda conn: conn.execute(statement), idempotent=True)

    def get_session(self, session_id: str) -> SessionRow | None:
        validate.text("session_id", session_id)
        found = self.uow.read_rows(_SESSION_BY_ID, {"sid": session_id})
        return cast(SessionRow, found[0]) if found else None

    def resolve_session_id(self, session_id_or_prefix: str) -> str | None:
        """The exact id, else the one session whose id starts with the prefix (else None)."""
        validate.text("session_id_or_prefix", session_id_or_prefix)
        with self._read() as conn:
            if statements.exists(conn, session_id_or_prefix):
                return session_id_or_prefix
            ids = conn.scalars(
                select(S.c.id)
                .where(listing.starts_with(S.c.id, session_id_or_prefix))
                .order_by(S.c.started_at.desc())
                .limit(2)
            ).all()
        return ids[0] if len(ids) == 1 else None

    def unique_id_prefixes(self, session_ids: Sequence[str], minimum: int = 8) -> dict[str, str]:
        """Each id shortened to a prefix no other session in the database shares (at least
        ``minimum`` characters): what a listing may show, since such a prefix always resolves
        through :meth:`resolve_session_id`."""
        ids = validate.names("session_ids", session_ids)
        if ids is None:
            raise InvalidInputError("session_ids must be a list of session ids, not None")
        minimum = validate.integer("minimum", minimum, minimum=1, maximum=1 << 16)
        with self._read() as conn:
            return listing.unique_id_prefixes(conn, ids, minimum)

    def get_child_sessions(self, session_id: str) -> list[dict[str, Any]]:
        """The sessions whose parent is ``session_id`` (subagents, continuations), oldest
        first: their id, title, source and started_at."""
        validate.text("session_id", session_id)
        with self._read() as conn:
            return listing.children_of(conn, session_id)

    def delete_session(self, session_id: str) -> bool:
        """Delete a session and its messages; its children are orphaned, never deleted."""
        validate.text("session_id", session_id)

        def unit(conn: Connection) -> bool:
            return retention.delete_sessions(conn, [session_id])[0] == 1

        return self.uow.run(unit)

    def prune_sessions(self, older_than_days: float = 90, source: str | None = None) -> int:
        """Delete ended sessions started before the cutoff; active sessions are never pruned."""
        validate.real("older_than_days", older_than_days, scale=86400.0)
        validate.text("source", source, optional=True)
        self._text("source", source)
        doomed_query = retention.candidates(
            retention.Policy.of(older_than_days, source), now=self.clock()
        )

        def unit(conn: Connection) -> int:
            doomed = list(conn.scalars(doomed_query))
            # What the deletes removed: a session another process deleted meanwhile counts 0.
            return sum(retention.delete_sessions(conn, chunk)[0] for chunk in _chunks(doomed, 500))

        retention.check_index(self.uow)  # deletes into a damaged index: refused, none made
        return self.uow.run(unit)

    def get_compression_tip(self, session_id: str) -> str | None:
        """Follow the compression chain forward (at most 100 hops) to its newest continuation."""
        validate.text("session_id", session_id)
        with self._read() as conn:
            return listing.compression_tip(conn, session_id)

    # -- titles -----------------------------------------------------------------------------

    @staticmethod
    def sanitize_title(title: str | None) -> str | None:
        validate.text("title", title, optional=True)
        return titles.sanitize_title(title)

    def set_session_title(self, session_id: str, title: str | None) -> bool:
        """Set (or with an empty title, clear) the title; a title held elsewhere raises."""
        validate.text("session_id", session_id)
        validate.text("title", title, optional=True)
        clean = titles.sanitize_title(title)
        self._text("title", clean)
        return self._statements.set_title(self.uow, session_id, clean)

    def get_session_title(self, session_id: str) -> str | None:
        validate.text("session_id", session_id)
        title: str | None = self.uow.read_scalar(_TITLE_BY_ID, {"sid": session_id})
        return title

    def get_session_by_title(self, title: str) -> SessionRow | None:
        validate.text("title", title)
        with self._read() as conn:
            row = conn.execute(select(S).where(S.c.title == title)).first()
        return cast(SessionRow, _row_dict(row)) if row else None

    def resolve_session_by_title(self, title: str) -> str | None:
        """The newest "title #N" variant when any exists, else the exact title, else None."""
        validate.text("title", title)
        with self._read() as conn:
            candidates = conn.execute(
                select(S.c.id, S.c.title)
                .where(listing.starts_with(S.c.title, f"{title} #"))
                .order_by(S.c.started_at.desc())
            ).all()
            for session_id, held in candidates:
                if titles.lineage_number(title, held) is not None:
                    return str(session_id)
            exact: str | None = conn.scalar(select(S.c.id).where(S.c.title == title))
        return exact

    def get_next_title_in_lineage(self, base_title: str) -> str:
        """``"x"`` -> ``"x #2"``; with ``"x #3"`` present -> ``"x #4"``."""
        validate.text("base_title", base_title)
        base = titles.lineage_base(base_title)
        with self._read() as conn:
            held = conn.scalars(
                select(S.c.title).where(
                    or_(S.c.title == base, listing.starts_with(S.c.title, f"{base} #"))
                )
            ).all()
        numbers = [n for t in held if (n := titles.lineage_number(base, t)) is not None]
        if base not in held and not numbers:
            return base
        return f"{base} #{max([1, *numbers]) + 1}"

    # -- tokens and billing -----------------------------------------------------------------

    def update_token_counts(
        self,
        session_id: str,
        input_tokens: int = 0,
        output_tokens: int = 0,
        model: str | None = None,
        cache_read_tokens: int = 0,
        cache_write_tokens: int = 0,
        reasoning_tokens: int = 0,
        estimated_cost_usd: float | None = None,
        actual_cost_usd: float | None = None,
        cost_status: str | None = None,
        cost_source: str | None = None,
        pricing_version: str | None = None,
        billing_provider: str | None = None,
        billing_base_url: str | None = None,
        billing_mode: str | None = None,
        absolute: bool = False,
        *,
        idempotency_key: str | None = None,
    ) -> None:
        """Add to (or with ``absolute``, set) the counters and costs in one atomic statement.

        ``idempotency_key``: an increment sent again with the same key (after a
        :class:`~hermes_store.errors.WriteOutcomeUnknownError`) adds once in all (the counts
        are not compared); a key already used for an append, or for another session's
        increment, raises :class:`~hermes_store.errors.InvalidInputError`. An absolute set is
        idempotent already and records no key."""
        # The usual call (a str id, no key, plain ints, no texts) costs no validating call.
        if type(session_id) is not str:
            validate.text("session_id", session_id)
        if idempotency_key is not None:
            validate.idempotency_key(idempotency_key)
        counts = (input_tokens, output_tokens, cache_read_tokens, cache_write_tokens,
                  reasoning_tokens)  # fmt: skip
        validate.token_counts(statements.COUNTERS, counts, estimated_cost_usd, actual_cost_usd)
        if absolute is not False and absolute is not True:
            validate.flag("absolute", absolute)
        # In statements.TOKEN_TEXTS' order: overwritten when given, then filled once.
        texts = (cost_status, cost_source, pricing_version,
                 billing_provider, billing_base_url, billing_mode, model)  # fmt: skip
        if not (cost_status is None and cost_source is None and pricing_version is None
                and billing_provider is None and billing_base_url is None
                and billing_mode is None and model is None):  # fmt: skip
            for name, text_value in zip(statements.TOKEN_TEXTS, texts, strict=True):
                self._text(name, text_value)
        key = None
        if idempotency_key is not None and not absolute:
            key = statements.WriteKey(idempotency_key, session_id, self.clock())
        self._statements.update_token_counts(
            self.uow,
            session_id,
            counts,
            texts,
            (estimated_cost_usd, actual_cost_usd),
            bool(absolute),
            key,
        )

    # -- messages ---------------------------------------------------------------------------

    def append_message(
        self,
        session_id: str,
        role: str,
        content: str | None = None,
        tool_name: str | None = None,
        tool_calls: Any = None,
        tool_call_id: str | None = None,
        token_count: int | None = None,
        finish_reason: str | None = None,
        reasoning: str | None = None,
        reasoning_details: Any = None,
        codex_reasoning_items: Any = None,
        *,
        idempotency_key: str | None = None,
    ) -> int:
        """Append one message and bump the session's counters in the same transaction.

        ``idempotency_key``: a call sent again with the same key (after a
        :class:`~hermes_store.errors.WriteOutcomeUnknownError`) lands once and returns the
        first call's message id; the key is recorded in the append's own transaction."""
        if idempotency_key is not None:
            validate.idempotency_key(idempotency_key)
        values = self._message_values(
            session_id,
            role,
            content,
            tool_name,
            tool_calls,
            tool_call_id,
            token_count,
            finish_reason,
            reasoning,
            reasoning_details,
            codex_reasoning_items,
        )
        key = None
        if idempotency_key is not None:
            key = statements.WriteKey(idempotency_key, session_id, values["timestamp"])
        calls = 0 if tool_calls is None else _tool_call_increment(role, tool_calls)
        return self._statements.append_message(self.uow, values, calls, key)

    def append_messages(self, session_id: str, messages: Iterable[Mapping[str, Any]]) -> list[int]:
        """Append many messages in one transaction (imports); all or nothing. Returns the ids.

        Each mapping takes the keyword arguments of :meth:`append_message` (``role`` required).
        """
        validate.text("session_id", session_id)
        messages = validate.messages(messages)
        rows: list[dict[str, Any]] = []
        tool_call_total = 0
        for index, message in enumerate(messages):
            if type(message) is not dict:  # a Mapping is read once, through keys(), as ** does
                message = dict(message)
            unknown = set(message) - _MESSAGE_ARGUMENTS
            if unknown:
                raise InvalidInputError(f"message {index}: unknown keys {sorted(unknown)}")
            if "role" not in message:
                raise InvalidInputError(f"message {index}: role is required")
            rows.append(self._message_values(session_id, **message))
            tool_call_total += _tool_call_increment(message["role"], message.get("tool_calls"))
        if not rows:
            return []
        return self._statements.append_messages(self.uow, session_id, rows, tool_call_total)

    def _message_values(
        self,
        session_id: str,
        role: str,
        content: str | None = None,
        tool_name: str | None = None,
        tool_calls: Any = None,
        tool_call_id: str | None = None,
        token_count: int | None = None,
        finish_reason: str | None = None,
        reasoning: str | None = None,
        reasoning_details: Any = None,
        codex_reasoning_items: Any = None,
        timestamp: float | None = None,
    ) -> dict[str, Any]:
        """Validate and serialise one message before any transaction starts. Every call makes
        this pass, so an argument that is None (most are) costs no call."""
        if token_count is not None or timestamp is not None:
            validate.message_numbers(token_count, timestamp)
        nul_ok = self._nul_ok
        # The usual call: plain ASCII strings (isascii() is O(1) in CPython) on a backend that
        # holds NUL, which _check_text would pass unchanged: settled here without a call.
        if not (
            nul_ok
            and type(session_id) is str
            and session_id.isascii()
            and type(role) is str
            and role.isascii()
            and (content is None or (type(content) is str and content.isascii()))
        ):
            _check_text("session_id", session_id, required=True, nul_ok=nul_ok)
            _check_text("role", role, required=True, nul_ok=nul_ok)
            if content is not None:
                _check_text("content", content, nul_ok=nul_ok)
        plain = (tool_name is None and tool_call_id is None and finish_reason is None
                 and reasoning is None)  # fmt: skip
        if not plain:
            for name, value in (
                ("tool_name", tool_name),
                ("tool_call_id", tool_call_id),
                ("finish_reason", finish_reason),
                ("reasoning", reasoning),
            ):
                if value is not None:
                    _check_text(name, value, nul_ok=nul_ok)
        # JSON text when truthy, NULL when falsy (the original store's rule, in _to_json: a
        # value without a truth value is refused there, not met here as a raw error).
        calls_json = None if tool_calls is None else _to_json("tool_calls", tool_calls)
        details_json = (
            None if reasoning_details is None else _to_json("reasoning_details", reasoning_details)
        )
        codex_json = (
            None
            if codex_reasoning_items is None
            else _to_json("codex_reasoning_items", codex_reasoning_items)
        )
        no_json = calls_json is None and details_json is None and codex_json is None
        if not no_json:
            for name, value in (
                ("tool_calls", calls_json),
                ("reasoning_details", details_json),
                ("codex_reasoning_items", codex_json),
            ):
                if value is not None:
                    _check_text(name, value, nul_ok=nul_ok)
        row = {
            "session_id": session_id,
            "role": role,
            "content": content,
            "tool_name": tool_name,
            "tool_call_id": tool_call_id,
            "token_count": token_count,
            "finish_reason": finish_reason,
            "reasoning": reasoning,
            "timestamp": self.clock() if timestamp is None else timestamp,
            "tool_calls": calls_json,
            "reasoning_details": details_json,
            "codex_reasoning_items": codex_json,
        }
        limit = self.max_message_bytes
        if limit is not None:  # counted from the arguments: no lookups in the row
            chars = 0 if content is None else len(content)
            if not (plain and no_json):
                for value in (tool_name, tool_call_id, finish_reason, reasoning, calls_json,
                              details_json, codex_json):  # fmt: skip
                    if value is not None:
                        chars += len(value)
            if chars * 4 > limit:  # a UTF-8 character is at most 4 bytes: perhaps too big
                validate.message_size(row, limit)
        return row

    def get_messages(
        self, session_id: str, *, limit: int | None = None, after_id: int | None = None
    ) -> list[MessageRow]:
        """Row dicts by ``(timestamp, id)``, ``tool_calls`` decoded (bad JSON gives ``[]``).

        ``limit`` and ``after_id`` page through very long sessions by keyset: pass the last
        id of one page as ``after_id`` of the next.
        """
        validate.text("session_id", session_id)
        limit = validate.integer("limit", limit, optional=True, minimum=0)
        after_id = validate.integer("after_id", after_id, optional=True)
        statement = messages_statement(after_id is not None, limit is not None)
        params = messages_params(session_id, limit=limit, after_id=after_id)
        return cast(list[MessageRow], decode_tool_calls(self.uow.read_rows(statement, params)))

    def iter_messages(self, session_id: str, *, page_size: int = 1000) -> Iterator[MessageRow]:
        """Every message of a session, fetched ``page_size`` at a time (flat memory)."""
        validate.text("session_id", session_id)
        page_size = validate.integer("page_size", page_size, minimum=1)
        after: int | None = None
        while True:
            page = self.get_messages(session_id, limit=page_size, after_id=after)
            yield from page
            if len(page) < page_size:
                return
            after = page[-1]["id"]

    def get_messages_as_conversation(self, session_id: str) -> list[ConversationTurn]:
        """The session in OpenAI chat format (role, content and the tool/reasoning extras)."""
        validate.text("session_id", session_id)
        conversation: list[RowDict] = []
        for row in cast(list[RowDict], self.get_messages(session_id)):
            message: RowDict = {"role": row["role"], "content": row["content"]}
            for key in ("tool_call_id", "tool_name", "tool_calls"):
                if row[key]:
                    message[key] = row[key]
            if row["role"] == "assistant":
                if row["reasoning"]:
                    message["reasoning"] = row["reasoning"]
                for key in ("reasoning_details", "codex_reasoning_items"):
                    if row[key]:
                        message[key] = from_json(row[key], None, key, row["id"])
            conversation.append(message)
        return cast(list[ConversationTurn], conversation)

    def clear_messages(self, session_id: str) -> None:
        """Delete the session's messages and reset its counters; token figures stay."""
        validate.text("session_id", session_id)

        def unit(conn: Connection) -> None:
            # The session's row first (PostgreSQL; SQLite's write lock covers it): an append
            # inserts its message, then bumps this row, in one statement. Locked before the
            # DELETE, an append either commits first (its message is deleted, its bump reset)
            # or waits and bumps the reset row; without it the DELETE missed the append's
            # message while the reset erased its bump, for good.
            conn.execute(select(S.c.id).where(S.c.id == session_id).with_for_update())
            conn.execute(delete(M).where(M.c.session_id == session_id))
            conn.execute(
                update(S).where(S.c.id == session_id).values(message_count=0, tool_call_count=0)
            )

        self.uow.run(unit)

    def message_count(self, session_id: str | None = None) -> int:
        validate.text("session_id", session_id, optional=True)
        if session_id is None:
            return int(self.uow.read_scalar(_COUNT_ALL_MESSAGES) or 0)
        return int(self.uow.read_scalar(_COUNT_MESSAGES, {"sid": session_id}) or 0)

    def session_count(self, source: str | None = None) -> int:
        validate.text("source", source, optional=True)
        statement = select(func.count()).select_from(S)
        if source is not None:
            statement = statement.where(S.c.source == source)
        with self._read() as conn:
            return int(conn.scalar(statement) or 0)

    def count_sessions(
        self,
        sources: Sequence[str] | None = None,
        exclude_sources: Sequence[str] | None = None,
        include_children: bool = False,
    ) -> int:
        """How many sessions :meth:`list_sessions_rich` would list with these filters, paged
        through to the end (``sources``: any of them; None or empty: every source)."""
        sources = validate.names("sources", sources)
        exclude_sources = validate.names("exclude_sources", exclude_sources)
        validate.flag("include_children", include_children)
        return self.uow.read(
            lambda conn: listing.count_sessions(
                conn,
                sources=sources or (),
                exclude_sources=exclude_sources or (),
                include_children=include_children,
            )
        )

    # -- listing and search -----------------------------------------------------------------

    def search_sessions(
        self, source: str | None = None, limit: int = 20, offset: int = 0
    ) -> list[SessionRow]:
        """Row dicts, newest first, children included, no preview."""
        validate.text("source", source, optional=True)
        limit, offset = validate.page(limit, offset)
        statement = (
            select(S).order_by(S.c.started_at.desc(), S.c.id.desc()).limit(limit).offset(offset)
        )
        if source is not None:
            statement = statement.where(S.c.source == source)
        return self.uow.read(
            lambda conn: [cast(SessionRow, _row_dict(row)) for row in conn.execute(statement)]
        )

    def list_sessions_rich(
        self,
        source: str | None = None,
        exclude_sources: Sequence[str] | None = None,
        limit: int = 20,
        offset: int = 0,
        include_children: bool = False,
        project_compression_tips: bool = True,
    ) -> list[SessionListRow]:
        """Sessions with ``preview`` and ``last_active``, newest first, in one query."""
        validate.text("source", source, optional=True)
        exclude_sources = validate.names("exclude_sources", exclude_sources)
        limit, offset = validate.lenient_page(limit, offset)
        validate.flag("include_children", include_children)
        validate.flag("project_compression_tips", project_compression_tips)
        return self.uow.read(
            lambda conn: cast(
                list[SessionListRow],
                self._statements.list_sessions_rich(
                    conn,
                    source=source,
                    exclude_sources=exclude_sources,
                    limit=limit,
                    offset=offset,
                    include_children=include_children,
                    project_compression_tips=project_compression_tips,
                ),
            )
        )

    def search_messages(
        self,
        query: str,
        source_filter: Sequence[str] | None = None,
        exclude_sources: Sequence[str] | None = None,
        role_filter: Sequence[str] | None = None,
        limit: int = 20,
        offset: int = 0,
        sort: str = "rank",
    ) -> list[SearchHit]:
        """Full-text search with snippets and same-session context; never raises on syntax.

        ``sort``: ``"rank"`` (best first, the contract's order), ``"newest"`` or ``"oldest"``.
        """
        validate.text("query", query, optional=True)
        source_filter = validate.names("source_filter", source_filter)
        exclude_sources = validate.names("exclude_sources", exclude_sources)
        role_filter = validate.names("role_filter", role_filter)
        limit, offset = validate.lenient_page(limit, offset)
        return self.uow.read(
            lambda conn: cast(
                list[SearchHit],
                self._searcher.search_messages(
                    conn,
                    query,
                    source_filter=source_filter,
                    exclude_sources=exclude_sources,
                    role_filter=role_filter,
                    limit=limit,
                    offset=offset,
                    sort=sort,
                ),
            )
        )

    @staticmethod
    def _sanitize_fts5_query(query: str) -> str:
        validate.text("query", query)
        return search.sanitize_fts5_query(query)

    @staticmethod
    def _contains_cjk(text: str) -> bool:
        validate.text("text", text)
        return search.contains_cjk(text)

    # -- full-text index maintenance --------------------------------------------------------

    def rebuild_search_index(self) -> None:
        """Rebuild the full-text index from ``messages`` (recreating missing FTS objects)."""
        self.uow.run(self._searcher.rebuild_index)

    def optimize_search_index(self) -> None:
        """Merge the full-text index into its most compact form (FTS5 'optimize')."""
        self.uow.run(self._searcher.optimize_index)

    def check_search_index(self) -> bool:
        """True when the full-text index is complete and in step with ``messages``.

        A write unit on SQLite: FTS5's 'integrity-check' is issued as an INSERT (it changes
        nothing, and the unit is rolled back rather than committed).
        """

        def unit(conn: Connection) -> bool:
            savepoint = conn.begin_nested()  # so a joined transaction() keeps its own work
            try:
                return self._searcher.check_index(conn)
            finally:
                savepoint.rollback()

        return self.uow.run(unit)

    # -- operations -------------------------------------------------------------------------

    def backup(self, destination: str | os.PathLike[str], **options: Any) -> BackupReport:
        """A consistent online snapshot of this SQLite database (see :func:`backup.backup`).
        Through the Unit of Work's engine: a closed store's refuses (its disposed engine would
        quietly open new connections)."""
        from hermes_store.ops import backup

        return backup.backup(self.uow.engine, destination, **options)

    # -- export -----------------------------------------------------------------------------

    def export_session(self, session_id: str) -> ExportRecord | None:
        validate.text("session_id", session_id)
        session = self.get_session(session_id)
        if session is None:
            return None
        return {**session, "messages": self.get_messages(session_id)}

    def export_all(self, source: str | None = None) -> list[ExportRecord]:
        """Every session (children included), newest first, each with its messages."""
        validate.text("source", source, optional=True)
        return list(self.iter_export(source))

    def iter_export(
        self, source: str | None = None, *, page_size: int = 200
    ) -> Iterator[ExportRecord]:
        """:meth:`export_all` as a stream: one session (and its messages) in memory at a time.

        Each page of ``page_size`` sessions is read in one transaction (a consistent snapshot
        of the page); stop iterating early and the generator's close releases it.
        """
        validate.text("source", source, optional=True)
        page_size = validate.integer("page_size", page_size, minimum=1)
        yield from self._statements.iter_export(self.uow, source, page_size)


_MESSAGE_ARGUMENTS = frozenset(
    {
        "role",
        "content",
        "tool_name",
        "tool_calls",
        "tool_call_id",
        "token_count",
        "finish_reason",
        "reasoning",
        "reasoning_details",
        "codex_reasoning_items",
        "timestamp",
    }
)


_SESSION_BY_ID = select(S).where(S.c.id == sa.bindparam("sid"))
_TITLE_BY_ID = select(S.c.title).where(S.c.id == sa.bindparam("sid"))
_COUNT_ALL_MESSAGES = select(func.count().label("n")).select_from(M)
_COUNT_MESSAGES = _COUNT_ALL_MESSAGES.where(M.c.session_id == sa.bindparam("sid"))


def _tool_call_increment(role: str, tool_calls: Any) -> int:
    """The original store's counting: a list counts its length, another value 1; tool replies
    count 0."""
    if role == "tool" or tool_calls is None:
        return 0
    return len(tool_calls) if isinstance(tool_calls, list) else 1


def _chunks(items: list[str], size: int) -> Iterator[list[str]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def open_store(target: Target | None = None, **kwargs: Any) -> SessionDB:
    """``SessionDB`` on ``target``, else ``HERMES_STORE_URL``, else the default file."""
    if target is None and os.environ.get("HERMES_STORE_URL"):
        target = os.environ["HERMES_STORE_URL"]
    return SessionDB(target, **kwargs)
