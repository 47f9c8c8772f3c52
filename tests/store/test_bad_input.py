"""Bad input: property tests over every text parameter of the public API, a 10 MB message, SQL and
LIKE metacharacters, NUL bytes, lone surrogates; and the security rules (owner-only files, no SQL
built by string formatting from input).

The rule under test: a call either succeeds and its text round-trips exactly, or it raises an
error of the package's hierarchy (``HermesStoreError``) and writes nothing. Lone surrogates are
never storable (not Unicode text); NUL is stored on SQLite and refused on PostgreSQL, whose text
type cannot hold it. Afterwards the schema and every earlier row are intact.
"""

from __future__ import annotations

import ast
import itertools
import math
import os
import re
import sqlite3
import stat
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import hermes_store
from hermes_store import (
    HermesStoreError,
    InvalidInputError,
    SessionDB,
    TitleInUseError,
    TitleTooLongError,
)
from hermes_store.engine.factory import sqlite_file

SPECIALS = [
    "'; DROP TABLE sessions; --",
    "Robert'); DROP TABLE messages;--",
    "' OR '1'='1",
    "%", "_", "%_", "\\", "\\%", "a%b_c", "100%", "x_y", "[a-z]", "*", "?",
    '"', "'", "''", '""', "`", ";", "--", "/*", "*/",
    "NULL", "null", "AND", "OR", "NOT", "NEAR", "(", ")", "^", ":", "{", "}", "+", "-",
    "\x00", "a\x00b", "\ud800", "x\udfffy", "\udc80\ud834",
    "\u202e", "\u200b", "\ufeff", "\u2028", "\x1a", "\x7f", "\x1b[31m",
    "🙂", "👩‍💻", "数据库", "Agent通信", "こんにちは", "안녕", "e\u0301", "ＡＢＣ", "\U0010ffff",
    "", " ", "\t", "\n", "\r\n", "title #2", "x #3",
]  # fmt: skip
ANY_CHAR = st.characters(exclude_categories=())  # every code point: NUL and surrogates too
NASTY = st.one_of(
    st.sampled_from(SPECIALS),
    st.text(max_size=30),
    st.text(alphabet=ANY_CHAR, max_size=20),
    st.lists(st.one_of(st.sampled_from(SPECIALS), st.text(max_size=4)), max_size=5).map("".join),
)
PROPERTY = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
_ids = itertools.count()


def unique(prefix: str) -> str:
    """An id prefix no other example shares ("u12:" is never a prefix of "u123:")."""
    return f"{prefix}{next(_ids)}:"


def has_surrogate(text: str) -> bool:
    return any(0xD800 <= ord(ch) <= 0xDFFF for ch in text)


def storable(store: SessionDB, *texts: str | None) -> bool:
    """Whether the backend can hold these texts exactly (the rule the store must follow)."""
    for text in texts:
        if text is None:
            continue
        if has_surrogate(text) or (not store.is_sqlite and "\x00" in text):
            return False
    return True


def counts(store: SessionDB) -> tuple[int, int]:
    return store.session_count(), store.message_count()


# -- the baseline: rows written before the abuse must come out of it unchanged ------------------


@pytest.fixture
def baseline(store: SessionDB) -> Iterator[SessionDB]:
    store.create_session("base", "cli", model="m", system_prompt="p")
    store.set_session_title("base", "Baseline title")
    store.append_message("base", "user", "baseline hello")
    store.append_message("base", "assistant", "baseline reply", tool_calls=[{"id": "c1"}])
    store.update_token_counts("base", input_tokens=10, output_tokens=20)
    before = store.export_session("base")
    tables = _tables(store)
    yield store
    assert store.export_session("base") == before
    assert _tables(store) == tables
    assert store.search_messages("baseline")  # the index still serves the old rows
    path = sqlite_file(store.engine.url)
    if path is not None:
        raw = sqlite3.connect(path)
        try:
            assert raw.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
            raw.execute(
                "INSERT INTO messages_fts(messages_fts, rank) VALUES ('integrity-check', 1)"
            )
        finally:
            raw.close()


def _tables(store: SessionDB) -> set[str]:
    import sqlalchemy as sa

    return set(sa.inspect(store.engine).get_table_names())


def refused_cleanly(
    store: SessionDB, call: Callable[[], Any], *, expect: type[HermesStoreError] = InvalidInputError
) -> None:
    """``call`` must raise ``expect`` (a HermesStoreError) and leave the counts as they were."""
    before = counts(store)
    with pytest.raises(expect):
        call()
    assert counts(store) == before


# -- sessions -----------------------------------------------------------------------------------


@PROPERTY
@given(sid=NASTY, source=NASTY, model=NASTY, prompt=NASTY, user=NASTY, config=NASTY, reason=NASTY)
def test_session_text_round_trips_or_is_refused(
    baseline: SessionDB,
    sid: str,
    source: str,
    model: str,
    prompt: str,
    user: str,
    config: str,
    reason: str,
) -> None:
    store = baseline
    session_id = unique("s") + sid
    texts = (session_id, source, model, prompt, user)
    call = lambda: store.create_session(  # noqa: E731
        session_id, source, model=model, model_config={"k": config, config: [1]},
        system_prompt=prompt, user_id=user,
    )  # fmt: skip
    # JSON fields escape NUL, so only a lone surrogate makes model_config unstorable
    # (escaped, two of them read back as one character beyond the BMP: another string).
    if not storable(store, *texts) or has_surrogate(config):
        refused_cleanly(store, call)
        return
    assert call() == session_id
    row = store.get_session(session_id)
    assert row is not None
    assert (row["id"], row["source"], row["model"], row["system_prompt"], row["user_id"]) == texts
    # JSON escapes NUL and surrogates, so any config text is storable and comes back as JSON
    # reads it (an escaped surrogate pair is the character it encodes, as JSON defines it).
    import json

    given = {"k": config, config: [1]}
    assert json.loads(row["model_config"]) == json.loads(json.dumps(given))
    # Prefix resolution escapes LIKE metacharacters: only this session starts with this prefix.
    assert store.resolve_session_id(session_id) == session_id
    assert store.resolve_session_id(session_id[: len(session_id) - len(sid) // 2]) == session_id
    assert store.session_count(source) >= 1
    if storable(store, reason):
        store.end_session(session_id, reason)
        ended = store.get_session(session_id)
        assert ended is not None and ended["end_reason"] == reason
    else:
        refused_cleanly(store, lambda: store.end_session(session_id, reason))
        still = store.get_session(session_id)
        assert still is not None and still["ended_at"] is None
    store.update_system_prompt(session_id, None)
    if storable(store, prompt + reason):
        store.update_system_prompt(session_id, prompt + reason)
        again = store.get_session(session_id)
        assert again is not None and again["system_prompt"] == prompt + reason


# -- messages -----------------------------------------------------------------------------------


@PROPERTY
@given(
    role=NASTY, content=NASTY, tool_name=NASTY, call_id=NASTY, finish=NASTY, reasoning=NASTY,
    payload=NASTY,
)  # fmt: skip
def test_message_text_round_trips_or_is_refused(
    baseline: SessionDB,
    role: str,
    content: str,
    tool_name: str,
    call_id: str,
    finish: str,
    reasoning: str,
    payload: str,
) -> None:
    store = baseline
    session_id = unique("m")
    store.create_session(session_id, "cli")
    texts = (role, content, tool_name, call_id, finish, reasoning)
    tool_calls = [{"id": payload, "function": {"name": payload, "arguments": payload}}]

    def call() -> int:
        return store.append_message(
            session_id, role, content, tool_name=tool_name, tool_calls=tool_calls,
            tool_call_id=call_id, finish_reason=finish, reasoning=reasoning,
            reasoning_details=[payload], codex_reasoning_items={"x": payload},
        )  # fmt: skip

    # JSON fields escape NUL, so only a lone surrogate makes the payload unstorable (escaped,
    # two of them read back as one character beyond the BMP: another string).
    if not storable(store, *texts) or has_surrogate(payload):
        refused_cleanly(store, call)
        session = store.get_session(session_id)
        assert session is not None
        assert session["message_count"] == 0 and session["tool_call_count"] == 0
        return
    message_id = call()
    (message,) = store.get_messages(session_id)
    assert message["id"] == message_id
    assert (
        message["role"], message["content"], message["tool_name"], message["tool_call_id"],
        message["finish_reason"], message["reasoning"],
    ) == texts  # fmt: skip
    assert message["tool_calls"] == tool_calls
    session = store.get_session(session_id)
    assert session is not None and session["message_count"] == 1
    assert session["tool_call_count"] == (0 if role == "tool" else 1)
    # The bulk path follows the same rule, all or nothing.
    rows = [{"role": role, "content": content}, {"role": "user", "content": payload}]
    if storable(store, payload):
        assert len(store.append_messages(session_id, rows)) == 2
        assert [m["content"] for m in store.get_messages(session_id)][1:] == [content, payload]
    else:
        refused_cleanly(store, lambda: store.append_messages(session_id, rows))
        assert store.message_count(session_id) == 1


# -- titles -------------------------------------------------------------------------------------


@PROPERTY
@given(raw=NASTY)
def test_titles_are_sanitised_and_round_trip_or_are_refused(baseline: SessionDB, raw: str) -> None:
    store = baseline
    session_id = unique("t")
    store.create_session(session_id, "cli")
    title = f"{raw} {session_id}"  # unique per example; the marker keeps " #N" off the end
    try:
        clean = SessionDB.sanitize_title(title)
    except TitleTooLongError:
        refused_cleanly(
            store, lambda: store.set_session_title(session_id, title), expect=TitleTooLongError
        )
        assert store.get_session_title(session_id) is None
        return
    if clean is None or not storable(store, clean):
        if clean is not None:
            refused_cleanly(store, lambda: store.set_session_title(session_id, title))
            assert store.get_session_title(session_id) is None
        return
    assert store.set_session_title(session_id, title) is True
    assert store.get_session_title(session_id) == clean
    found = store.get_session_by_title(clean)
    assert found is not None and found["id"] == session_id
    assert store.resolve_session_by_title(clean) == session_id
    assert store.get_next_title_in_lineage(clean) == f"{clean} #2"
    other = unique("t")
    store.create_session(other, "cli")
    refused_cleanly(store, lambda: store.set_session_title(other, title), expect=TitleInUseError)
    assert store.get_session_title(other) is None


# -- tokens and billing -------------------------------------------------------------------------


@PROPERTY
@given(model=NASTY, status=NASTY, source=NASTY, version=NASTY, provider=NASTY, url=NASTY)
def test_billing_text_round_trips_or_is_refused(
    baseline: SessionDB,
    model: str,
    status: str,
    source: str,
    version: str,
    provider: str,
    url: str,
) -> None:
    store = baseline
    session_id = unique("b")
    store.create_session(session_id, "cli")
    texts = {
        "model": model, "cost_status": status, "cost_source": source, "pricing_version": version,
        "billing_provider": provider, "billing_base_url": url, "billing_mode": status,
    }  # fmt: skip
    call = lambda: store.update_token_counts(session_id, input_tokens=3, **texts)  # noqa: E731
    if not storable(store, *texts.values()):
        before = store.get_session(session_id)
        refused_cleanly(store, call)
        assert store.get_session(session_id) == before
        return
    call()
    row = store.get_session(session_id)
    assert row is not None
    assert {key: row[key] for key in texts} == texts
    assert row["input_tokens"] == 3


# -- reads and searches never leak a driver error -----------------------------------------------


@PROPERTY
@given(text=NASTY, other=NASTY)
def test_reads_and_searches_answer_or_refuse_cleanly(
    baseline: SessionDB, text: str, other: str
) -> None:
    store = baseline
    assume("base" not in (text, other))  # the baseline session must survive delete/clear
    before = counts(store)
    reads: list[Callable[[], Any]] = [
        lambda: store.get_session(text),
        lambda: store.resolve_session_id(text),
        lambda: store.get_session_title(text),
        lambda: store.get_session_by_title(text),
        lambda: store.resolve_session_by_title(text),
        lambda: store.get_next_title_in_lineage(text),
        lambda: store.get_messages(text),
        lambda: store.get_messages_as_conversation(text),
        lambda: store.message_count(text),
        lambda: store.session_count(text),
        lambda: store.search_sessions(text),
        lambda: store.list_sessions_rich(source=text, exclude_sources=[other]),
        lambda: store.export_session(text),
        lambda: store.get_compression_tip(text),
        lambda: store.search_messages(text),
        lambda: store.search_messages(f"{text} {other}", source_filter=[other, "cli"]),
        lambda: store.search_messages(text, exclude_sources=[other], role_filter=[other]),
        lambda: store.delete_session(text),  # no such session: False, nothing deleted
        lambda: store.clear_messages(text),
        lambda: store.reopen_session(text),
        lambda: store.update_token_counts(text, input_tokens=1),
        lambda: store.prune_sessions(0, source=text),  # "base" is active: never pruned
    ]
    for read in reads:
        try:
            result = read()
        except HermesStoreError:
            assert not storable(store, text, other), (read, text, other)
            continue
        if isinstance(result, list) and result and "snippet" in result[0]:
            for hit in result:
                assert set(hit) == {
                    "id", "session_id", "role", "snippet", "timestamp", "tool_name", "source",
                    "model", "session_started", "context",
                }  # fmt: skip
    assert counts(store) == before


# -- large and exact ----------------------------------------------------------------------------


def test_ten_megabyte_message_round_trips(baseline: SessionDB) -> None:
    store = baseline
    store.create_session("big", "cli")
    words = " ".join(f"w{index % 5000}" for index in range(1_000_000))  # ~6.9 MB of text
    content = (words + " needle 🙂 数据库 \\%_' " + words)[: 10 * 1024 * 1024]
    assert len(content) == 10 * 1024 * 1024
    message_id = store.append_message("big", "tool", content, tool_name="cat")
    (message,) = store.get_messages("big")
    assert message["id"] == message_id and message["content"] == content
    assert [hit["id"] for hit in store.search_messages("needle")] == [message_id]
    exported = store.export_session("big")
    assert exported is not None and exported["messages"][0]["content"] == content


def test_message_too_large_for_a_tsvector_is_stored_and_found(baseline: SessionDB) -> None:
    """~3 MB of distinct words: FTS5 indexes it all; PostgreSQL's tsvector is capped at 1 MB,
    so only the head is indexed there and the substring fallback finds words past it."""
    store = baseline
    store.create_session("blob", "cli")
    blob = " ".join(f"k{i:x}q{(i * 7919) % 1_000_003:x}" for i in range(250_000))
    message_id = store.append_message("blob", "tool", blob)
    (message,) = store.get_messages("blob")
    assert message["id"] == message_id and message["content"] == blob
    head_word, tail_word = blob.split(" ", 1)[0], blob.rsplit(" ", 1)[-1]
    assert [hit["id"] for hit in store.search_messages(head_word)] == [message_id]
    assert [hit["id"] for hit in store.search_messages(tail_word)] == [message_id]


def test_nul_is_stored_on_sqlite_and_refused_on_postgresql(baseline: SessionDB) -> None:
    store = baseline
    store.create_session("nul", "cli")
    content = "before\x00after"
    if store.is_sqlite:
        store.append_message("nul", "user", content)
        assert [m["content"] for m in store.get_messages("nul")] == [content]
        store.create_session("id\x00with-nul", "cli")
        assert store.get_session("id\x00with-nul") is not None
        return
    with pytest.raises(InvalidInputError, match="NUL"):
        store.append_message("nul", "user", content)
    with pytest.raises(InvalidInputError, match="NUL"):
        store.create_session("id\x00with-nul", "cli")
    with pytest.raises(InvalidInputError):
        store.get_session("id\x00with-nul")
    assert store.message_count("nul") == 0
    session = store.get_session("nul")
    assert session is not None and session["message_count"] == 0


@pytest.mark.parametrize("number", [math.nan, math.inf, -math.inf])
def test_nan_or_an_infinity_in_a_json_field_is_refused(baseline: SessionDB, number: float) -> None:
    """Python writes them as ``NaN``/``Infinity``, which is not JSON: a reader of the column
    (jq, a PostgreSQL cast, another language) would refuse the whole text."""
    store = baseline
    store.create_session("nan", "cli")
    calls: list[Callable[[], object]] = [
        lambda: store.append_message("nan", "assistant", "x", tool_calls=[{"n": number}]),
        lambda: store.append_message("nan", "assistant", "x", reasoning_details=[number]),
        lambda: store.append_messages("nan", [{"role": "user", "codex_reasoning_items": [number]}]),
        lambda: store.create_session("nan2", "cli", model_config={"temperature": number}),
    ]
    for call in calls:
        with pytest.raises(InvalidInputError, match="NaN or an infinity"):
            call()
    assert store.message_count("nan") == 0 and store.get_session("nan2") is None


def test_sql_in_every_field_is_just_text(baseline: SessionDB) -> None:
    store = baseline
    attack = "'; DROP TABLE sessions; --"
    store.create_session(attack, attack, model=attack, system_prompt=attack, user_id=attack)
    store.append_message(attack, attack, attack, tool_name=attack, tool_call_id=attack)
    store.set_session_title(attack, attack)
    assert store.get_session(attack) is not None
    assert store.get_session_by_title(attack) is not None
    assert [m["content"] for m in store.get_messages(attack)] == [attack]
    assert any(hit["session_id"] == attack for hit in store.search_messages("DROP TABLE"))
    assert {"sessions", "messages"} <= _tables(store)


def test_like_metacharacters_match_literally(baseline: SessionDB) -> None:
    store = baseline
    for session_id in ("a%b", "a_c", "a\\d", "axb-1", "ayc-2"):
        store.create_session(session_id, "cli")
    assert store.resolve_session_id("a%") == "a%b"
    assert store.resolve_session_id("a_") == "a_c"
    assert store.resolve_session_id("a\\") == "a\\d"
    assert store.resolve_session_id("a") is None  # ambiguous
    store.set_session_title("a%b", "100% _done_")
    store.set_session_title("a_c", "100x xdonex #2")
    assert store.resolve_session_by_title("100% _done_") == "a%b"
    assert store.get_next_title_in_lineage("100% _done_") == "100% _done_ #2"


# -- security -----------------------------------------------------------------------------------


def test_new_database_and_its_wal_and_shm_are_owner_only(tmp_path: Path) -> None:
    previous = os.umask(0)  # the most permissive umask: the store must not rely on it
    try:
        path = tmp_path / "deep" / "folder" / "state.db"
        store = SessionDB(path)
        try:
            store.create_session("s", "cli")
            store.append_message("s", "user", "private")
            files = [path, Path(f"{path}-wal"), Path(f"{path}-shm")]
            assert all(f.exists() for f in files), [f.name for f in files if not f.exists()]
            for f in files:
                assert stat.S_IMODE(f.stat().st_mode) == 0o600, (f.name, oct(f.stat().st_mode))
        finally:
            store.close()
    finally:
        os.umask(previous)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


PACKAGE = Path(hermes_store.__file__).parent
SQL_TEXT = re.compile(
    r"\b(SELECT|INSERT\s+INTO|UPDATE\s+\w+\s+SET|DELETE\s+FROM|PRAGMA|CREATE\s+"
    r"(?:TABLE|INDEX|UNIQUE|TRIGGER|VIRTUAL)|DROP\s+(?:TABLE|INDEX|TRIGGER)|ALTER\s+TABLE|"
    r"REINDEX|VACUUM|ANALYZE|BEGIN|WHERE|VALUES)\b"
)
#: Module constants (``FTS_TABLE``, ``ddl.PG_FTS_INDEX``) are reviewed code, never input.
CONSTANT = re.compile(r"(?:[a-z_]+\.)?[A-Z][A-Z0-9_]*")
#: Every other value interpolated into SQL text in the package, and why it is not user input.
SQL_INTERPOLATION_ALLOWED = {
    (
        "schema/ddl.py",
        "PG_CHUNK_TRIGGERS[0]",
    ): "a trigger name of the package's own (a constant tuple)",
    (
        "schema/ddl.py",
        "PG_CHUNK_TRIGGERS[1]",
    ): "a trigger name of the package's own (a constant tuple)",
    (
        "schema/ddl.py",
        "PG_CHUNK_TRIGGERS[2]",
    ): "a trigger name of the package's own (a constant tuple)",
    ("engine/factory.py", "'ON' if foreign_keys else 'OFF'"): "a bool chosen in code",
    ("engine/factory.py", "reader_ms"): "int computed from a float setting",
    ("engine/factory.py", "wanted"): "int computed from a float setting",
    ("engine/factory.py", "int(wanted)"): "int",
    (
        "engine/factory.py",
        "wal_limit",
    ): "int from a setting (int() of the env value or the argument)",
    (
        "engine/factory.py",
        "int(settings.wal_limit)",
    ): "int from a setting (the env value or the argument)",
    ("ops/maintenance.py", "SECURE_DELETE_VALUES[previous]"): "a value of a constant table",
    ("ops/maintenance.py", "table"): "an FTS table name: one of FTS_TABLES (ddl constants)",
    ("schema/ddl.py", "name"): "loop over the constant FTS_TRIGGERS",
    ("schema/ddl.py", "cjk_matches('?2')"): "the CJK condition over a literal placeholder",
    ("schema/ddl.py", "cjk_matches('content')"): "the CJK condition over a column (rebuild)",
    ("schema/fulltext.py", "matches"): "ddl.cjk_matches('content'): the CJK condition, a column",
    ("schema/fulltext.py", "ddl.FTS_TRIGGERS[0]"): "a trigger name: a ddl constant",
    ("schema/fulltext.py", "ddl.CJK_TRIGGERS[0]"): "a trigger name: a ddl constant",
    ("schema/fulltext.py", "ddl.cjk_matches('m.content')"): "the CJK condition over a column",
    ("schema/fulltext.py", "_LOADED"): "a constant: a bulk load's FROM clause, ids bound",
    ("schema/steps.py", "name"): "index name read from sqlite_master, quoted",
    ("transfer.py", "sequence"): "pg_get_serial_sequence('messages', 'id'): a quoted catalog name",
    (
        "schema/fulltext.py",
        "table",
    ): "ddl.FTS_TABLE or ddl.CJK_TABLE, from the callers in the package",
    ("schema/fulltext.py", "name"): "to_regclass() of the constant index names, or a constant",
    (
        "schema/fulltext.py",
        "version_table",
    ): "Placement.version_table: checked as a plain identifier",
    (
        "schema/migrate.py",
        "where.table(where.version_table)",
    ): "Placement.table(): checked identifiers",
    ("engine/placement.py", "placement.schema"): "Placement.schema: checked as a plain identifier",
    ("engine/placement.py", "self.schema"): "Placement.schema: checked as a plain identifier",
}


def _interpolations() -> Iterator[tuple[str, int, str, str]]:
    """(file, line, interpolated expression, SQL text) for every SQL string built from values
    by an f-string, ``%`` formatting, ``.format()`` or ``+`` concatenation."""
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.JoinedStr):
                text = "".join(v.value for v in node.values if isinstance(v, ast.Constant))
                if SQL_TEXT.search(text):
                    for value in node.values:
                        if isinstance(value, ast.FormattedValue):
                            yield (
                                path.relative_to(PACKAGE).as_posix(),
                                node.lineno,
                                ast.unparse(value.value),
                                text,
                            )
            elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod | ast.Add):
                sides = (node.left, node.right)
                texts = [s.value for s in sides if isinstance(s, ast.Constant)]
                if any(isinstance(t, str) and SQL_TEXT.search(t) for t in texts):
                    for side in sides:
                        if not isinstance(side, ast.Constant):
                            yield (
                                path.relative_to(PACKAGE).as_posix(),
                                node.lineno,
                                ast.unparse(side),
                                str(texts),
                            )
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "format"
                and isinstance(node.func.value, ast.Constant)
                and isinstance(node.func.value.value, str)
                and SQL_TEXT.search(node.func.value.value)
            ):
                for arg in [*node.args, *(k.value for k in node.keywords)]:
                    yield (
                        path.relative_to(PACKAGE).as_posix(),
                        node.lineno,
                        ast.unparse(arg),
                        node.func.value.value,
                    )


def test_no_sql_is_built_by_string_formatting_from_input() -> None:
    found = list(_interpolations())
    assert found, "the scan found nothing at all: it is broken"
    unknown = [
        f"{file}:{line}: {expr!r} in {text[:60]!r}"
        for file, line, expr, text in found
        if (file, expr) not in SQL_INTERPOLATION_ALLOWED and not CONSTANT.fullmatch(expr)
    ]
    assert unknown == [], "SQL built from a value that is not on the reviewed allow-list"


def test_the_sql_scan_catches_what_it_should(tmp_path: Path) -> None:
    """The scanner itself: it flags each way of building SQL from a variable."""
    sample = (
        "def bad(conn, user):\n"
        "    conn.exec_driver_sql(f\"SELECT * FROM sessions WHERE id = '{user}'\")\n"
        '    conn.exec_driver_sql("DELETE FROM messages WHERE id = %s" % user)\n'
        "    conn.exec_driver_sql(\"UPDATE sessions SET title = '{}'\".format(user))\n"
        '    conn.exec_driver_sql("SELECT * FROM sessions WHERE id = " + user)\n'
        "    conn.execute(text('SELECT 1'), {'id': user})\n"
        "    conn.exec_driver_sql(f'DROP INDEX IF EXISTS {ddl.PG_FTS_INDEX}')\n"
    )
    global PACKAGE
    saved = PACKAGE
    (tmp_path / "bad.py").write_text(sample)
    PACKAGE = tmp_path
    try:
        flagged = [(line, expr) for _file, line, expr, _text in _interpolations()]
    finally:
        PACKAGE = saved
    assert flagged == [(2, "user"), (3, "user"), (4, "user"), (5, "user"), (7, "ddl.PG_FTS_INDEX")]
    assert CONSTANT.fullmatch("ddl.PG_FTS_INDEX") and not CONSTANT.fullmatch("user")


def test_a_backup_to_a_name_no_file_can_have_is_refused(tmp_path: Path) -> None:
    with (
        SessionDB(tmp_path / "state.db") as db,
        pytest.raises(InvalidInputError, match="not a valid file name"),
    ):
        db.backup("\ud800")


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///:memory:"])
def test_an_in_memory_sqlite_database_is_refused_clearly(url: str) -> None:
    """Each connection to an in-memory database sees a database of its own: the store would
    open at head on one and fail with a raw "no such table" on the next (once, a standby
    check meant for servers failed on it first). Refused at open, naming the fix."""
    with pytest.raises(hermes_store.StoreConfigError, match="in-memory SQLite database"):
        hermes_store.SessionDB(url)


def test_a_mapping_whose_keys_differ_from_its_iteration_is_read_once(baseline: SessionDB) -> None:
    """``append_messages`` checked a Mapping's keys by iterating it and then unpacked it with
    ``**``, which reads ``keys()``: one whose two differ got a key past the check and raised a
    raw TypeError. It is read once, as ``**`` reads it."""

    class TwoFaced(Mapping[str, Any]):
        def __init__(self) -> None:
            self.items_ = {"role": "user", "session_id": "elsewhere"}

        def __getitem__(self, key: str) -> Any:
            return self.items_[key]

        def __len__(self) -> int:
            return 1

        def __iter__(self) -> Iterator[str]:
            return iter(["role"])

        def keys(self) -> Any:
            return ["role", "session_id"]

    baseline.create_session("two", "cli")
    with pytest.raises(InvalidInputError, match="unknown keys \\['session_id'\\]"):
        baseline.append_messages("two", [TwoFaced()])
    assert baseline.message_count("two") == 0
