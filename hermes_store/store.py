"""``SessionDB``: the seed's store (chapter 7) as a repository over the Unit of Work.

Same method names, keywords, defaults, return shapes and ``ValueError`` messages as the
contract; every write is one unit (``BEGIN IMMEDIATE`` + jittered retry), every read a deferred
transaction. Hot paths use Core statements (SQLAlchemy caches their compiled form); the ORM
models in :mod:`hermes_store.models` remain the query surface for applications.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import sqlalchemy as sa
from sqlalchemy import and_, delete, func, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine, Row
from sqlalchemy.sql import Select
from sqlalchemy.sql.compiler import SQLCompiler

from hermes_store import fastpath, listing, search, titles
from hermes_store.engine import Target, create_engine, default_db_path
from hermes_store.errors import (
    InvalidInputError,
    TitleInUseError,
    UnknownSessionError,
)
from hermes_store.migrate import ensure_head
from hermes_store.models import messages_table as M
from hermes_store.models import sessions_table as S
from hermes_store.uow import RetryPolicy, UnitOfWork

log = logging.getLogger(__name__)

RowDict = dict[str, Any]
_COUNTERS = (
    "input_tokens",
    "output_tokens",
    "cache_read_tokens",
    "cache_write_tokens",
    "reasoning_tokens",
)
_MESSAGE_ORDER = (M.c.timestamp, M.c.id)


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


def _check_number(name: str, value: object, kind: type) -> None:
    ok = isinstance(value, kind | int) and not isinstance(value, bool)
    if value is not None and not ok:
        raise InvalidInputError(f"{name} must be a number, not {type(value).__name__}")


def _to_json(name: str, value: Any) -> str | None:
    """JSON text when truthy, NULL when falsy, as the seed stores it; fails before writing."""
    if not value:
        return None
    try:
        return json.dumps(value)
    except (TypeError, ValueError) as error:
        raise InvalidInputError(f"{name} cannot be stored as JSON: {error}") from error


def _from_json(value: str | None, fallback: Any, what: str, message_id: object) -> Any:
    try:
        return json.loads(value) if value else fallback
    except (TypeError, ValueError):
        log.warning("message %s: %s is not valid JSON; using %r", message_id, what, fallback)
        return fallback


def _row_dict(row: Row[Any]) -> RowDict:
    return dict(row._mapping)


class SessionDB:
    """Drop-in for the seed's ``SessionDB``, on a SQLite file or any SQLAlchemy URL.

    ``db_path`` is a file path (``None``: ``$HERMES_HOME/state.db``), a URL such as
    ``postgresql+psycopg://host/db``, or an Engine. Opening brings the schema to head,
    adopting files written by the original store; it takes no lock when already at head.
    """

    MAX_TITLE_LENGTH = titles.MAX_TITLE_LENGTH

    def __init__(
        self,
        db_path: Target | None = None,
        *,
        retry: RetryPolicy | None = None,
        checkpoint_every: int = 50,
        writer_busy_timeout: float | None = None,
    ) -> None:
        target: Target = default_db_path() if db_path is None else db_path
        extra: dict[str, Any] = {}
        if writer_busy_timeout is not None:
            extra["writer_busy_timeout"] = writer_busy_timeout
        self.engine: Engine = create_engine(target, **extra)
        self._owns_engine = not isinstance(target, Engine)
        self.db_path = target if not isinstance(target, Engine) else None
        self.is_sqlite = self.engine.dialect.name == "sqlite"
        try:
            ensure_head(self.engine)
        except BaseException:
            self.engine.dispose()
            raise
        self.uow = UnitOfWork(self.engine, retry=retry, checkpoint_every=checkpoint_every)
        dialect_insert = sqlite.insert if self.is_sqlite else postgresql.insert
        self._insert_session = dialect_insert(S).on_conflict_do_nothing(index_elements=["id"])
        self._closed = False

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> SessionDB:
        """The same store on any SQLAlchemy URL (``postgresql+psycopg://...``, ``sqlite:///...``)."""
        return cls(url, **kwargs)

    # -- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        """Best-effort WAL checkpoint, then release every connection. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self.uow.checkpoint()
        self.uow.release_driver()
        if self._owns_engine:
            self.engine.dispose()

    def __enter__(self) -> SessionDB:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _text(self, name: str, value: object, *, required: bool = False) -> None:
        _check_text(name, value, required=required, nul_ok=self.is_sqlite)

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
            "started_at": time.time(),
        }

        def unit(conn: Connection) -> None:
            if parent_session_id is not None and not self._exists(conn, parent_session_id):
                raise UnknownSessionError(f"parent session {parent_session_id!r} does not exist")
            conn.execute(self._insert_session, values)

        self.uow.run(unit)
        return session_id

    def ensure_session(
        self, session_id: str, source: str = "unknown", model: str | None = None
    ) -> None:
        """Insert-or-ignore of (id, source, model, started_at); never overwrites."""
        self._text("session_id", session_id, required=True)
        self._text("source", source, required=True)
        self._text("model", model)
        values = {"id": session_id, "source": source, "model": model, "started_at": time.time()}
        self.uow.run(lambda conn: conn.execute(self._insert_session, values))

    def end_session(self, session_id: str, end_reason: str) -> None:
        """Mark the session ended; the first end wins until it is reopened."""
        self._text("end_reason", end_reason)
        statement = (
            update(S)
            .where(S.c.id == session_id, S.c.ended_at.is_(None))
            .values(ended_at=time.time(), end_reason=end_reason)
        )
        self.uow.run(lambda conn: conn.execute(statement))

    def reopen_session(self, session_id: str) -> None:
        statement = update(S).where(S.c.id == session_id).values(ended_at=None, end_reason=None)
        self.uow.run(lambda conn: conn.execute(statement))

    def update_system_prompt(self, session_id: str, system_prompt: str | None) -> None:
        self._text("system_prompt", system_prompt)
        statement = update(S).where(S.c.id == session_id).values(system_prompt=system_prompt)
        self.uow.run(lambda conn: conn.execute(statement))

    def get_session(self, session_id: str) -> RowDict | None:
        with self._read() as conn:
            row = conn.execute(select(S).where(S.c.id == session_id)).first()
        return _row_dict(row) if row else None

    def resolve_session_id(self, session_id_or_prefix: str) -> str | None:
        """The exact id, else the one session whose id starts with the prefix (else None)."""
        with self._read() as conn:
            if self._exists(conn, session_id_or_prefix):
                return session_id_or_prefix
            pattern = titles.escape_like(session_id_or_prefix) + "%"
            ids = conn.scalars(
                select(S.c.id)
                .where(S.c.id.like(pattern, escape="\\"))
                .order_by(S.c.started_at.desc())
                .limit(2)
            ).all()
        return ids[0] if len(ids) == 1 else None

    def delete_session(self, session_id: str) -> bool:
        """Delete a session and its messages; its children are orphaned, never deleted."""

        def unit(conn: Connection) -> bool:
            if not self._exists(conn, session_id):
                return False
            conn.execute(
                update(S).where(S.c.parent_session_id == session_id).values(parent_session_id=None)
            )
            conn.execute(delete(M).where(M.c.session_id == session_id))
            conn.execute(delete(S).where(S.c.id == session_id))
            return True

        return self.uow.run(unit)

    def prune_sessions(self, older_than_days: float = 90, source: str | None = None) -> int:
        """Delete ended sessions started before the cutoff; active sessions are never pruned."""
        _check_number("older_than_days", older_than_days, float)
        cutoff = time.time() - older_than_days * 86400
        criteria = [S.c.started_at < cutoff, S.c.ended_at.is_not(None)]
        if source is not None:
            criteria.append(S.c.source == source)

        def unit(conn: Connection) -> int:
            doomed = list(conn.scalars(select(S.c.id).where(*criteria)))
            for chunk in _chunks(doomed, 500):
                conn.execute(
                    update(S).where(S.c.parent_session_id.in_(chunk)).values(parent_session_id=None)
                )
                conn.execute(delete(M).where(M.c.session_id.in_(chunk)))
                conn.execute(delete(S).where(S.c.id.in_(chunk)))
            return len(doomed)

        return self.uow.run(unit)

    def get_compression_tip(self, session_id: str) -> str | None:
        """Follow the compression chain forward (at most 100 hops) to its newest continuation."""
        with self._read() as conn:
            return listing.compression_tip(conn, session_id)

    @staticmethod
    def _exists(conn: Connection, session_id: str) -> bool:
        return conn.execute(select(S.c.id).where(S.c.id == session_id)).first() is not None

    # -- titles -----------------------------------------------------------------------------

    @staticmethod
    def sanitize_title(title: str | None) -> str | None:
        return titles.sanitize_title(title)

    def set_session_title(self, session_id: str, title: str | None) -> bool:
        """Set (or with an empty title, clear) the title; a title held elsewhere raises."""
        clean = titles.sanitize_title(title)
        self._text("title", clean)

        def unit(conn: Connection) -> bool:
            if not self._exists(conn, session_id):
                return False
            if clean is not None:
                holder = conn.scalar(
                    select(S.c.id).where(S.c.title == clean, S.c.id != session_id).limit(1)
                )
                if holder is not None:
                    raise TitleInUseError(f"Title '{clean}' is already in use by session {holder}")
            try:
                with conn.begin_nested():
                    conn.execute(update(S).where(S.c.id == session_id).values(title=clean))
            except sa.exc.IntegrityError as error:  # a concurrent writer took it (PostgreSQL)
                raise TitleInUseError(f"Title '{clean}' is already in use") from error
            return True

        return self.uow.run(unit)

    def get_session_title(self, session_id: str) -> str | None:
        with self._read() as conn:
            title: str | None = conn.scalar(select(S.c.title).where(S.c.id == session_id))
        return title

    def get_session_by_title(self, title: str) -> RowDict | None:
        with self._read() as conn:
            row = conn.execute(select(S).where(S.c.title == title)).first()
        return _row_dict(row) if row else None

    def resolve_session_by_title(self, title: str) -> str | None:
        """The newest "title #N" variant when any exists, else the exact title, else None."""
        with self._read() as conn:
            candidates = conn.execute(
                select(S.c.id, S.c.title)
                .where(S.c.title.like(titles.escape_like(title) + " #%", escape="\\"))
                .order_by(S.c.started_at.desc())
            ).all()
            for session_id, held in candidates:
                if titles.lineage_number(title, held) is not None:
                    return str(session_id)
            exact: str | None = conn.scalar(select(S.c.id).where(S.c.title == title))
        return exact

    def get_next_title_in_lineage(self, base_title: str) -> str:
        """``"x"`` -> ``"x #2"``; with ``"x #3"`` present -> ``"x #4"``."""
        base = titles.lineage_base(base_title)
        with self._read() as conn:
            held = conn.scalars(
                select(S.c.title).where(
                    or_(
                        S.c.title == base,
                        S.c.title.like(titles.escape_like(base) + " #%", escape="\\"),
                    )
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
    ) -> None:
        """Add to (or with ``absolute``, set) the counters and costs in one atomic statement."""
        counts = dict(
            zip(
                _COUNTERS,
                (
                    input_tokens,
                    output_tokens,
                    cache_read_tokens,
                    cache_write_tokens,
                    reasoning_tokens,
                ),
                strict=True,
            )
        )
        for name, value in counts.items():
            _check_number(name, value, int)
        _check_number("estimated_cost_usd", estimated_cost_usd, float)
        _check_number("actual_cost_usd", actual_cost_usd, float)
        overwrite = {
            "cost_status": cost_status,
            "cost_source": cost_source,
            "pricing_version": pricing_version,
        }
        fill = {
            "billing_provider": billing_provider,
            "billing_base_url": billing_base_url,
            "billing_mode": billing_mode,
            "model": model,
        }
        for name, text_value in (overwrite | fill).items():
            self._text(name, text_value)

        params: dict[str, Any] = {
            f"p_{name}": value for name, value in (counts | overwrite | fill).items()
        }
        params.update(p_sid=session_id, p_est=estimated_cost_usd, p_act=actual_cost_usd)
        if self.is_sqlite:  # the hot path: the statement compiled once, run on the driver
            sql, keys = _sqlite_sql("tokens_absolute" if absolute else "tokens")
            bound = tuple(params[key] for key in keys)
            self.uow.run_driver(lambda cursor: cursor.execute(sql, bound))
            return
        statement = _token_statement(bool(absolute))
        self.uow.run(lambda conn: conn.execute(statement, params))

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
    ) -> int:
        """Append one message and bump the session's counters in the same transaction."""
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
        bump = {
            "sid": session_id,
            "messages": 1,
            "tool_calls": _tool_call_increment(role, tool_calls),
        }

        if self.is_sqlite:
            bump_sql, bump_keys = _sqlite_sql("bump")
            insert_sql, insert_keys = _sqlite_sql("insert")
            bump_params = tuple(bump[key] for key in bump_keys)
            insert_params = tuple(values[key] for key in insert_keys)

            def driver_unit(cursor: Any) -> int:
                cursor.execute(bump_sql, bump_params)
                if cursor.rowcount != 1:
                    raise UnknownSessionError(f"session {session_id!r} does not exist")
                cursor.execute(insert_sql, insert_params)
                return int(cursor.lastrowid)

            return self.uow.run_driver(driver_unit)

        def unit(conn: Connection) -> int:
            if conn.execute(_BUMP_COUNTERS, bump).rowcount != 1:
                raise UnknownSessionError(f"session {session_id!r} does not exist")
            return int(conn.execute(_INSERT_MESSAGE, values).scalar_one())

        return self.uow.run(unit)

    def append_messages(self, session_id: str, messages: Iterable[Mapping[str, Any]]) -> list[int]:
        """Append many messages in one transaction (imports); all or nothing. Returns the ids.

        Each mapping takes the keyword arguments of :meth:`append_message` (``role`` required).
        """
        rows: list[dict[str, Any]] = []
        tool_call_total = 0
        for index, message in enumerate(messages):
            unknown = set(message) - _MESSAGE_ARGUMENTS
            if unknown:
                raise InvalidInputError(f"message {index}: unknown keys {sorted(unknown)}")
            if "role" not in message:
                raise InvalidInputError(f"message {index}: role is required")
            rows.append(self._message_values(session_id, **message))
            tool_call_total += _tool_call_increment(message["role"], message.get("tool_calls"))
        if not rows:
            return []

        bump = {"sid": session_id, "messages": len(rows), "tool_calls": tool_call_total}

        if self.is_sqlite:  # the hot path: one executemany of the compiled INSERT
            bump_sql, bump_keys = _sqlite_sql("bump")
            insert_sql, insert_keys = _sqlite_sql("insert")
            bump_params = tuple(bump[key] for key in bump_keys)
            insert_rows = [tuple(row[key] for key in insert_keys) for row in rows]

            def driver_unit(cursor: Any) -> list[int]:
                cursor.execute(bump_sql, bump_params)
                if cursor.rowcount != 1:
                    raise UnknownSessionError(f"session {session_id!r} does not exist")
                cursor.executemany(insert_sql, insert_rows)
                last = int(cursor.execute("SELECT last_insert_rowid()").fetchone()[0])
                # One transaction holding the write lock: AUTOINCREMENT ids are consecutive.
                return list(range(last - len(insert_rows) + 1, last + 1))

            return self.uow.run_driver(driver_unit)

        def unit(conn: Connection) -> list[int]:
            if conn.execute(_BUMP_COUNTERS, bump).rowcount != 1:
                raise UnknownSessionError(f"session {session_id!r} does not exist")
            statement = M.insert().returning(M.c.id, sort_by_parameter_order=True)
            return list(conn.scalars(statement, rows))

        return self.uow.run(unit)

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
        """Validate and serialise one message before any transaction starts."""
        self._text("session_id", session_id, required=True)
        self._text("role", role, required=True)
        for name, value in (
            ("content", content),
            ("tool_name", tool_name),
            ("tool_call_id", tool_call_id),
            ("finish_reason", finish_reason),
            ("reasoning", reasoning),
        ):
            self._text(name, value)
        _check_number("token_count", token_count, int)
        _check_number("timestamp", timestamp, float)
        encoded = {
            "tool_calls": _to_json("tool_calls", tool_calls),
            "reasoning_details": _to_json("reasoning_details", reasoning_details),
            "codex_reasoning_items": _to_json("codex_reasoning_items", codex_reasoning_items),
        }
        for name, value in encoded.items():
            self._text(name, value)
        return {
            "session_id": session_id,
            "role": role,
            "content": content,
            "tool_name": tool_name,
            "tool_call_id": tool_call_id,
            "token_count": token_count,
            "finish_reason": finish_reason,
            "reasoning": reasoning,
            "timestamp": time.time() if timestamp is None else timestamp,
            **encoded,
        }

    def get_messages(
        self, session_id: str, *, limit: int | None = None, after_id: int | None = None
    ) -> list[RowDict]:
        """Row dicts by ``(timestamp, id)``, ``tool_calls`` decoded (bad JSON gives ``[]``).

        ``limit`` and ``after_id`` page through very long sessions by keyset: pass the last
        id of one page as ``after_id`` of the next.
        """
        with self._read() as conn:
            return _fetch_messages(conn, session_id, limit=limit, after_id=after_id)

    def iter_messages(self, session_id: str, *, page_size: int = 1000) -> Iterator[RowDict]:
        """Every message of a session, fetched ``page_size`` at a time (flat memory)."""
        after: int | None = None
        while True:
            page = self.get_messages(session_id, limit=page_size, after_id=after)
            yield from page
            if len(page) < page_size:
                return
            after = page[-1]["id"]

    def get_messages_as_conversation(self, session_id: str) -> list[RowDict]:
        """The session in OpenAI chat format (role, content and the tool/reasoning extras)."""
        conversation = []
        for row in self.get_messages(session_id):
            message: RowDict = {"role": row["role"], "content": row["content"]}
            for key in ("tool_call_id", "tool_name", "tool_calls"):
                if row[key]:
                    message[key] = row[key]
            if row["role"] == "assistant":
                if row["reasoning"]:
                    message["reasoning"] = row["reasoning"]
                for key in ("reasoning_details", "codex_reasoning_items"):
                    if row[key]:
                        message[key] = _from_json(row[key], None, key, row["id"])
            conversation.append(message)
        return conversation

    def clear_messages(self, session_id: str) -> None:
        """Delete the session's messages and reset its counters; token figures stay."""

        def unit(conn: Connection) -> None:
            conn.execute(delete(M).where(M.c.session_id == session_id))
            conn.execute(
                update(S).where(S.c.id == session_id).values(message_count=0, tool_call_count=0)
            )

        self.uow.run(unit)

    def message_count(self, session_id: str | None = None) -> int:
        statement = select(func.count()).select_from(M)
        if session_id is not None:
            statement = statement.where(M.c.session_id == session_id)
        with self._read() as conn:
            return int(conn.scalar(statement) or 0)

    def session_count(self, source: str | None = None) -> int:
        statement = select(func.count()).select_from(S)
        if source is not None:
            statement = statement.where(S.c.source == source)
        with self._read() as conn:
            return int(conn.scalar(statement) or 0)

    # -- listing and search -----------------------------------------------------------------

    def search_sessions(
        self, source: str | None = None, limit: int = 20, offset: int = 0
    ) -> list[RowDict]:
        """Row dicts, newest first, children included, no preview."""
        statement = (
            select(S).order_by(S.c.started_at.desc(), S.c.id.desc()).limit(limit).offset(offset)
        )
        if source is not None:
            statement = statement.where(S.c.source == source)
        with self._read() as conn:
            return [_row_dict(row) for row in conn.execute(statement)]

    def list_sessions_rich(
        self,
        source: str | None = None,
        exclude_sources: Sequence[str] | None = None,
        limit: int = 20,
        offset: int = 0,
        include_children: bool = False,
        project_compression_tips: bool = True,
    ) -> list[RowDict]:
        """Sessions with ``preview`` and ``last_active``, newest first, in one query."""
        with self._read() as conn:
            return listing.list_sessions_rich(
                conn,
                source=source,
                exclude_sources=exclude_sources,
                limit=limit,
                offset=offset,
                include_children=include_children,
                project_compression_tips=project_compression_tips,
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
    ) -> list[RowDict]:
        """Full-text search with snippets and same-session context; never raises on syntax.

        ``sort``: ``"rank"`` (best first, the contract's order), ``"newest"`` or ``"oldest"``.
        """
        with self._read() as conn:
            return search.search_messages(
                conn,
                query,
                source_filter=source_filter,
                exclude_sources=exclude_sources,
                role_filter=role_filter,
                limit=limit,
                offset=offset,
                sort=sort,
            )

    @staticmethod
    def _sanitize_fts5_query(query: str) -> str:
        return search.sanitize_fts5_query(query)

    @staticmethod
    def _contains_cjk(text: str) -> bool:
        return search.contains_cjk(text)

    # -- full-text index maintenance --------------------------------------------------------

    def rebuild_search_index(self) -> None:
        """Rebuild the full-text index from ``messages`` (recreating missing FTS objects)."""
        self.uow.run(search.rebuild_index)

    def optimize_search_index(self) -> None:
        """Merge the full-text index into its most compact form (FTS5 'optimize')."""
        self.uow.run(search.optimize_index)

    def check_search_index(self) -> bool:
        """True when the full-text index is complete and in step with ``messages``.

        A write unit on SQLite: FTS5's 'integrity-check' is issued as an INSERT (it changes
        nothing, and the unit is rolled back rather than committed).
        """

        def unit(conn: Connection) -> bool:
            ok = search.check_index(conn)
            conn.rollback()
            return ok

        return self.uow.run(unit)

    # -- export -----------------------------------------------------------------------------

    def export_session(self, session_id: str) -> RowDict | None:
        session = self.get_session(session_id)
        if session is None:
            return None
        return {**session, "messages": self.get_messages(session_id)}

    def export_all(self, source: str | None = None) -> list[RowDict]:
        """Every session (children included), newest first, each with its messages."""
        return list(self.iter_export(source))

    def iter_export(self, source: str | None = None, *, page_size: int = 200) -> Iterator[RowDict]:
        """:meth:`export_all` as a stream: one session (and its messages) in memory at a time.

        Each page of ``page_size`` sessions is read in one transaction (a consistent snapshot
        of the page); stop iterating early and the generator's close releases it.
        """
        order = (S.c.started_at.desc(), S.c.id.desc())
        last: tuple[float, str] | None = None
        while True:
            statement = select(S).order_by(*order).limit(page_size)
            if source is not None:
                statement = statement.where(S.c.source == source)
            if last is not None:
                statement = statement.where(
                    or_(S.c.started_at < last[0], and_(S.c.started_at == last[0], S.c.id < last[1]))
                )
            # One read unit per page: a round trip per session, not a transaction per session
            # (on PostgreSQL each checkout also pings the server).
            with self._read() as conn:
                page = [_row_dict(row) for row in conn.execute(statement)]
                for session in page:
                    yield {**session, "messages": _fetch_messages(conn, session["id"])}
            if len(page) < page_size:
                return
            last = (page[-1]["started_at"], page[-1]["id"])


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


_INSERT_MESSAGE = M.insert().returning(M.c.id)
_BUMP_COUNTERS = (
    update(S)
    .where(S.c.id == sa.bindparam("sid"))
    .values(
        message_count=S.c.message_count + sa.bindparam("messages", type_=sa.Integer),
        tool_call_count=S.c.tool_call_count + sa.bindparam("tool_calls", type_=sa.Integer),
    )
)


@functools.cache
def _sqlite_sql(name: str) -> tuple[str, tuple[str, ...]]:
    """SQL text and positional parameter names of a hot-path Core statement, compiled for
    SQLite once per process (the driver-level units run it on the cursor)."""
    statements: dict[str, tuple[sa.ClauseElement, list[str] | None]] = {
        "bump": (_BUMP_COUNTERS, None),
        "insert": (M.insert(), [c.name for c in M.columns if c.name != "id"]),
        "tokens": (_token_statement(False), None),
        "tokens_absolute": (_token_statement(True), None),
    }
    statement, column_keys = statements[name]
    compiled = statement.compile(dialect=sqlite.dialect(), column_keys=column_keys)
    assert isinstance(compiled, SQLCompiler)
    return compiled.string, tuple(compiled.positiontup or ())


@functools.cache
def _token_statement(absolute: bool) -> sa.Update:
    """The one atomic UPDATE of ``update_token_counts`` for a mode, every value bound: None
    leaves ``actual_cost_usd`` and the overwrite-only fields as they are (``COALESCE``) and the
    fill-once fields keep their first value. Built once: constructing it per call cost 25x the
    SQL, and the write lock is held while it compiles."""
    zero: sa.ColumnElement[Any] = sa.literal_column("0")  # inline: binds only the call's values
    est = sa.cast(sa.bindparam("p_est", type_=sa.Float), sa.Float)
    act = sa.cast(sa.bindparam("p_act", type_=sa.Float), sa.Float)
    values: dict[str, Any] = {}
    for name in _COUNTERS:
        given = sa.bindparam(f"p_{name}", type_=sa.Integer)
        values[name] = given if absolute else func.coalesce(S.c[name], zero) + given
    if absolute:
        values["estimated_cost_usd"] = func.coalesce(est, zero)
        values["actual_cost_usd"] = func.coalesce(act, S.c.actual_cost_usd)
    else:
        values["estimated_cost_usd"] = func.coalesce(S.c.estimated_cost_usd, zero) + func.coalesce(
            est, zero
        )
        values["actual_cost_usd"] = sa.case(
            (act.is_(None), S.c.actual_cost_usd),
            else_=func.coalesce(S.c.actual_cost_usd, zero) + act,
        )
    for name in ("cost_status", "cost_source", "pricing_version"):  # overwritten by non-None
        values[name] = func.coalesce(sa.bindparam(f"p_{name}", type_=sa.Text), S.c[name])
    for name in ("billing_provider", "billing_base_url", "billing_mode", "model"):  # first wins
        values[name] = func.coalesce(S.c[name], sa.bindparam(f"p_{name}", type_=sa.Text))
    return update(S).where(S.c.id == sa.bindparam("p_sid")).values(values)


def _fetch_messages(
    conn: Connection, session_id: str, *, limit: int | None = None, after_id: int | None = None
) -> list[RowDict]:
    """One session's messages on ``conn``, ``tool_calls`` decoded (bad JSON gives ``[]``)."""
    statement = _messages_statement(after_id is not None, limit is not None)
    params = {"sid": session_id, "after": after_id, "lim": limit}
    rows = fastpath.rows(conn, statement, params)
    for message in rows:
        if message.get("tool_calls"):
            message["tool_calls"] = _from_json(
                message["tool_calls"], [], "tool_calls", message["id"]
            )
    return rows


@functools.cache
def _messages_statement(after: bool, limited: bool) -> Select[Any]:
    """One session's messages by ``(timestamp, id)``; optionally after the message ``:after``
    (keyset) and at most ``:lim`` of them. Built once per shape (the hot read of export)."""
    statement = select(M).where(M.c.session_id == sa.bindparam("sid")).order_by(*_MESSAGE_ORDER)
    if after:
        after_id = sa.bindparam("after", type_=sa.Integer)
        anchor = select(M.c.timestamp).where(M.c.id == after_id).scalar_subquery()
        statement = statement.where(
            M.c.timestamp >= anchor,  # redundant, but it lets the index seek instead of scan
            or_(M.c.timestamp > anchor, and_(M.c.timestamp == anchor, M.c.id > after_id)),
        )
    if limited:
        statement = statement.limit(sa.bindparam("lim", type_=sa.Integer))
    return statement


def _tool_call_increment(role: str, tool_calls: Any) -> int:
    """The seed's counting: a list counts its length, another value 1; tool replies count 0."""
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
