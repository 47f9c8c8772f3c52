"""The contract's "Search" section, the sanitizer, CJK and the hardening beyond the original store.

Every test that takes ``store`` runs on SQLite (FTS5) and on PostgreSQL (tsvector + trigram).
"""

from __future__ import annotations

import itertools
import logging
import random
import sqlite3
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from hermes_store import SessionDB, UnrecognizedSchemaError
from hermes_store.models import messages_table as M
from hermes_store.models import sessions_table as S
from hermes_store.schema import ddl
from hermes_store.search import fts5, pipeline, snippets
from hermes_store.search import query as query_module
from hermes_store.search.fts5 import fts5_query
from hermes_store.search.hits import SORTS
from hermes_store.search.query import (
    contains_cjk,
    parse_query,
    positive_pieces,
    sanitize_fts5_query,
    well_formed,
)
from hermes_store.search.tsvector import tsquery
from tests.support.backends import FLAVORS, NO_CJK_INDEX, SEARCH_BACKENDS
from tests.support.clock import FakeClock
from tests.support.query_plans import captured_selects, explain
from tests.support.search_corpus import CORPUS
from tests.support.search_rows import T0, add, ids


@pytest.fixture(params=FLAVORS)
def flavor(request: pytest.FixtureRequest) -> str:
    """Through ``SessionDB`` and through ``AsyncSessionDB`` (tests/support/aio_driver.py)."""
    return str(request.param)


@pytest.fixture(params=SEARCH_BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """The search contract runs on SQLite (with and without the CJK trigram index),
    PostgreSQL and PostgreSQL behind PgBouncer."""
    return str(request.param)


RESULT_KEYS = {
    "id", "session_id", "role", "snippet", "timestamp", "tool_name", "source", "model",
    "session_started", "context",
}  # fmt: skip


# -- the sanitizer and the CJK test --------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "clean"),
    [
        ("hello world", "hello world"),
        ("hello AND", "hello"),
        ("OR world", "world"),
        ("***", ""),
        ("deploy*", "deploy*"),
        ("chat-send", '"chat-send"'),
        ("P2.2", '"P2.2"'),
        ("my-app.config.ts", '"my-app.config.ts"'),
        ('"chat-send"', '"chat-send"'),
        ('"my chat-send thing"', '"my chat-send thing"'),
    ],
)
def test_sanitizer_pinned_cases(raw: str, clean: str) -> None:
    assert sanitize_fts5_query(raw) == clean
    assert SessionDB._sanitize_fts5_query(raw) == clean


@pytest.mark.parametrize(
    ("raw", "clean"),
    [
        ("hello AND OR", "hello"),  # dangling operators go until none is left
        ("NOT hello", "hello"),
        ("AND", ""),
        ("hello and", "hello and"),  # lowercase is a word, not an operator
        ("ANDROID phone", "ANDROID phone"),
        ("a**b", "a*b"),
        ("*abc", "abc"),
        ("foo(bar) {x} ^y +z", "foo bar   x   y  z"),
        ('say "hi', "say  hi"),  # an unmatched quote is removed
        ('"a b" AND', '"a b"'),
        ("a\x00b", "a b"),
    ],
)
def test_sanitizer_further_cases(raw: str, clean: str) -> None:
    assert sanitize_fts5_query(raw) == clean


@pytest.mark.parametrize(
    "text",
    [
        "中",
        "\u3400",
        "\U00020000",
        "\U0002a6df",
        "。",
        "ひらがな",
        "カタカナ",
        "한국어",
        "mixed 通信 text",
    ],
)
def test_contains_cjk_true(text: str) -> None:
    assert SessionDB._contains_cjk(text)


@pytest.mark.parametrize("text", ["", "hello", "Zürich", "привет", "สวัสดี", "😀", "\u4dc0", "ｱ"])
def test_contains_cjk_false(text: str) -> None:
    assert not contains_cjk(text)


@pytest.mark.parametrize(
    ("test", "ranges"),
    [(contains_cjk, query_module._CJK_RANGES), (query_module.unsegmented, ddl.UNSEGMENTED_RANGES)],
    ids=["contains_cjk", "unsegmented"],
)
def test_script_tests_hold_exactly_at_the_edges_of_their_ranges(
    test: Any, ranges: tuple[tuple[int, int], ...]
) -> None:
    """Each range's first and last code point count, anywhere in a text; the code points just
    outside count only when another range holds them."""

    def inside(point: int) -> bool:
        return any(lo <= point <= hi for lo, hi in ranges)

    for lo, hi in ranges:
        for point in (lo - 1, lo, hi, hi + 1):
            for text in (chr(point), f"plain {chr(point)} text"):
                assert test(text) is inside(point), (hex(point), text)


def test_one_parse_renders_for_fts5_tsquery_and_substring() -> None:
    items = well_formed(parse_query('deploy* "a b" NOT c:d OR it\'s'))
    assert fts5_query(items) == '"deploy"* "a b" NOT "c:d" OR "it\'s"'
    assert tsquery(items) == "(('deploy':* & ('a b' & !'c:d')) | 'it''s')"
    assert positive_pieces(items) == ["deploy", "a b", "it's"]
    assert tsquery(parse_query("back\\slash")) == "'back\\\\slash'"
    assert positive_pieces(parse_query("a NOT b c OR d")) == ["a", "c", "d"]


def test_well_formed_drops_dangling_and_doubled_operators() -> None:
    items = parse_query("OR a AND NOT b OR")
    assert fts5_query(well_formed(items)) == '"a" NOT "b"'


def test_substring_snippet_is_centred_and_marked() -> None:
    content = "x" * 300 + "数据库迁移" + "y" * 300
    snippet = snippets.substring_snippet(content, ["数据库迁移"])
    assert snippet.startswith("...") and snippet.endswith("...")
    assert ">>>数据库迁移<<<" in snippet
    body = snippet.removeprefix("...").removesuffix("...").replace(">>>", "").replace("<<<", "")
    assert len(body) == snippets.SUBSTRING_SNIPPET_CHARS
    left, right = body.split("数据库迁移")
    assert abs(len(left) - len(right)) <= 1
    assert snippets.substring_snippet("short 通信 text", ["通信"]) == "short >>>通信<<< text"
    near_start = snippets.substring_snippet("ab 通信 " + "z" * 500, ["通信"])
    assert near_start.startswith("ab >>>通信<<<") and near_start.endswith("...")


# -- the full-text path ------------------------------------------------------------------------


def test_blank_or_empty_after_sanitizing_gives_nothing(store: SessionDB) -> None:
    store.create_session("s", "cli")
    add(store, "s", ("user", "AND or NOT and *** () + ^ quotes here"), t=T0)
    assert store.search_messages("quotes")  # the message is findable at all
    for query in ("", "   ", "***", "AND", "OR NOT", "()", '""', "+^"):
        assert store.search_messages(query) == [], query


def test_result_has_exactly_the_contract_keys(store: SessionDB) -> None:
    store.create_session("s", "telegram", model="gpt-x")
    add(store, "s", ("user", "hello there"), t=T0)
    message_id = store.append_message("s", "tool", "ran the kettle tool", tool_name="kettle")
    [row] = store.search_messages("kettle")
    session = store.get_session("s")
    assert session is not None
    assert set(row) == RESULT_KEYS
    assert row["id"] == message_id and row["session_id"] == "s" and row["role"] == "tool"
    assert row["tool_name"] == "kettle" and row["source"] == "telegram" and row["model"] == "gpt-x"
    assert row["session_started"] == session["started_at"]
    assert row["timestamp"] == store.get_messages("s")[-1]["timestamp"]
    assert ">>>kettle<<<" in row["snippet"]


def test_snippet_cuts_long_content_with_ellipses(store: SessionDB) -> None:
    words = [f"w{i}" for i in range(300)]
    words[150] = "needle"
    store.create_session("s", "cli")
    add(store, "s", ("user", " ".join(words)), t=T0)
    [row] = store.search_messages("needle")
    snippet = row["snippet"]
    assert ">>>needle<<<" in snippet
    assert snippet.startswith("...") and snippet.endswith("...")
    assert 10 < len(snippet.split()) <= 45


def test_best_rank_comes_first(store: SessionDB) -> None:
    store.create_session("s", "cli")
    filler = " ".join(f"filler{i}" for i in range(60))
    ids_ = add(
        store,
        "s",
        ("user", f"one kernel mention in a long message {filler}"),
        ("user", "kernel kernel kernel panic"),
        ("user", f"another long one about the kernel {filler}"),
        t=T0,
    )
    assert ids(store.search_messages("kernel"))[0] == ids_[1]


def test_filters_on_source_and_role(store: SessionDB) -> None:
    found: dict[tuple[str, str], int] = {}
    for source in ("cli", "telegram", "discord"):
        store.create_session(source, source)
        for role in ("user", "assistant"):
            [found[source, role]] = add(store, source, (role, f"widget report 通信 {role}"), t=T0)

    def select(**kwargs: Any) -> set[tuple[str, str]]:
        by_id = {v: k for k, v in found.items()}
        return {by_id[i] for i in ids(store.search_messages("widget", **kwargs))}

    everything = set(found)
    assert select() == everything
    assert select(source_filter=["cli"]) == {("cli", "user"), ("cli", "assistant")}
    assert select(source_filter=["cli", "discord"]) == {k for k in found if k[0] != "telegram"}
    assert select(source_filter=[]) == set()
    assert select(exclude_sources=["cli"]) == {k for k in found if k[0] != "cli"}
    assert select(exclude_sources=[]) == everything
    assert select(role_filter=["assistant"]) == {k for k in found if k[1] == "assistant"}
    assert select(role_filter=[]) == everything
    assert select(role_filter="assistant") == select(role_filter=["assistant"])  # not 9 letters
    assert select(source_filter=["telegram"], role_filter=["user"]) == {("telegram", "user")}
    # the substring (CJK) path applies the same filters
    cjk = {found[k] for k in found if k[0] == "discord" and k[1] == "user"}
    hits = store.search_messages("通信", source_filter=["discord"], role_filter=["user"])
    assert set(ids(hits)) == cjk
    assert store.search_messages("通信", source_filter=[]) == []


def test_paging_with_limit_and_offset(store: SessionDB) -> None:
    store.create_session("s", "cli")
    planted = add(store, "s", *[("user", f"paging marker {i}") for i in range(7)], t=T0)
    pages = [ids(store.search_messages("marker", limit=3, offset=o)) for o in (0, 3, 6, 9)]
    assert [len(p) for p in pages] == [3, 3, 1, 0]
    assert sorted(itertools.chain(*pages)) == sorted(planted)
    assert store.search_messages("marker", limit=0) == []


def test_context_is_previous_and_next_of_the_same_session(store: SessionDB) -> None:
    store.create_session("a", "cli")
    store.create_session("b", "cli")
    # Interleave the two sessions so that global id neighbours belong to the other session.
    for i in range(4):
        add(store, "a", ("user" if i % 2 == 0 else "assistant", f"alpha {i} text"), t=T0 + 10 * i)
        add(store, "b", ("user", f"bravo {i} text"), t=T0 + 10 * i + 5)
    store.append_messages("a", [{"role": "assistant", "content": None, "timestamp": T0 + 35}])
    [middle] = store.search_messages('"alpha 1"')
    assert middle["context"] == [
        {"role": "user", "content": "alpha 0 text"},
        {"role": "assistant", "content": "alpha 1 text"},
        {"role": "user", "content": "alpha 2 text"},
    ]
    [first] = store.search_messages('"alpha 0"')
    assert [c["content"] for c in first["context"]] == ["alpha 0 text", "alpha 1 text"]
    [last_text] = store.search_messages('"alpha 3"')
    assert last_text["context"][-1] == {"role": "assistant", "content": ""}  # None shown as ""
    [bravo_last] = store.search_messages('"bravo 3"')
    assert [c["content"] for c in bravo_last["context"]] == ["bravo 2 text", "bravo 3 text"]


def test_context_follows_timestamp_then_id_and_cuts_to_200(store: SessionDB) -> None:
    store.create_session("s", "cli")
    long_text = "L" * 500
    later = add(store, "s", ("user", "late target"), t=T0 + 100)
    # Appended afterwards (higher ids) but earlier in time; two of them share a timestamp.
    store.append_messages(
        "s",
        [
            {"role": "user", "content": "first by time", "timestamp": T0},
            {"role": "assistant", "content": long_text, "timestamp": T0 + 50},
            {"role": "user", "content": "tie later id", "timestamp": T0 + 50},
        ],
    )
    [row] = store.search_messages("target")
    assert row["id"] == later[0]
    assert row["context"] == [
        {"role": "user", "content": "tie later id"},
        {"role": "user", "content": "late target"},
    ]
    [tie] = store.search_messages('"later id"')
    assert tie["context"][0] == {"role": "assistant", "content": "L" * 200}


def test_a_neighbour_past_the_load_limit_is_read_only_as_far_as_its_context(
    sqlite_store: SessionDB,
) -> None:
    """A neighbour longer than SQLite may load for the page's one query is read through a blob
    handle instead (its first 200 characters); the connection's length limit comes back, so a
    later read of that long message still works."""
    store = sqlite_store
    store.create_session("s", "cli")
    long_text = "\u00e9" + "x" * fts5.NEIGHBOUR_LOAD_LIMIT  # past the limit in bytes
    before, match, after = add(
        store, "s", ("tool", long_text), ("user", "needle here"), ("assistant", "after"), t=T0
    )
    [row] = store.search_messages("needle")
    assert row["id"] == match
    assert row["context"] == [
        {"role": "tool", "content": long_text[:200]},
        {"role": "user", "content": "needle here"},
        {"role": "assistant", "content": "after"},
    ]
    messages = {m["id"]: m for m in store.get_messages("s")}
    assert messages[before]["content"] == long_text
    assert messages[after]["content"] == "after"


def test_a_neighbour_that_is_not_utf8_gets_its_context_replaced_not_a_failure(
    sqlite_store: SessionDB,
) -> None:
    """Bytes that are not UTF-8, stored as text by another program, fail a SQL read: the page's
    contexts are read through blob handles, which replace them."""
    store = sqlite_store
    store.create_session("s", "cli")
    [match] = add(store, "s", ("user", "needle here"), t=T0 + 10)
    with sqlite3.connect(store.engine.url.database or "") as raw:
        raw.execute(
            "INSERT INTO messages (session_id, role, content, timestamp)"
            " VALUES ('s', 'tool', CAST(x'ff41' AS TEXT), ?)",
            (T0,),
        )
    raw.close()
    [row] = store.search_messages("needle")
    assert row["id"] == match
    assert row["context"] == [
        {"role": "tool", "content": "\ufffdA"},
        {"role": "user", "content": "needle here"},
    ]


def test_prefix_phrase_and_boolean_operators(store: SessionDB) -> None:
    store.create_session("s", "cli")
    deploy, quick, reversed_, both, alpha_only, gamma = add(
        store,
        "s",
        ("user", "deployment finished"),
        ("user", "the quick brown fox"),
        ("user", "brown quick dogs"),
        ("user", "alpha and beta together"),
        ("user", "alpha alone"),
        ("user", "gamma rays"),
        t=T0,
    )
    assert ids(store.search_messages("deploy*")) == [deploy]
    # No word "deploy": SQLite keeps FTS5's word semantics; PostgreSQL, whose parser keeps
    # paths and e-mails whole, answers a query without word hits by substring.
    assert ids(store.search_messages("deploy")) == ([] if store.is_sqlite else [deploy])
    assert ids(store.search_messages('"quick brown"')) == [quick]
    assert set(ids(store.search_messages("quick brown"))) == {quick, reversed_}
    assert ids(store.search_messages("alpha AND beta")) == [both]
    assert set(ids(store.search_messages("alpha OR gamma"))) == {both, alpha_only, gamma}
    assert ids(store.search_messages("alpha NOT beta")) == [alpha_only]
    assert ids(store.search_messages("alpha AND NOT beta")) == [alpha_only]


@pytest.mark.parametrize(
    ("query", "content"),
    [
        ("数据库", "我们明天要做数据库迁移"),
        ("迁移", "我们明天要做数据库迁移"),
        ("東京", "来週は東京で会議があります"),
        ("ひらがな", "これはひらがなのテストです"),
        ("한국어", "이 문서는 한국어로 작성되었습니다"),
        ("Agent通信", "我们讨论了Agent通信协议"),
        ("agent通信", "我们讨论了Agent通信协议"),  # ASCII letters match case-insensitively
        ("通信 协议", "我们讨论了Agent通信协议"),
    ],
)
def test_cjk_queries_find_their_message(store: SessionDB, query: str, content: str) -> None:
    store.create_session("s", "cli")
    [target, _] = add(store, "s", ("user", content), ("assistant", "unrelated reply"), t=T0)
    [row] = store.search_messages(query)
    assert row["id"] == target and set(row) == RESULT_KEYS
    assert ">>>" in row["snippet"] and "<<<" in row["snippet"]
    assert row["context"] == [
        {"role": "user", "content": content},
        {"role": "assistant", "content": "unrelated reply"},
    ]


def test_cjk_fallback_is_newest_first_with_centred_snippet(store: SessionDB) -> None:
    store.create_session("s", "cli")
    old, new = add(
        store,
        "s",
        ("user", "旧" * 200 + "数据库迁移" + "旧" * 200),
        ("user", "新的数据库迁移计划"),
        t=T0,
    )
    rows = store.search_messages("数据库迁移")
    assert ids(rows) == [new, old]
    assert rows[0]["snippet"] == "新的>>>数据库迁移<<<计划"
    long_snippet = rows[1]["snippet"]
    assert long_snippet.startswith("...") and long_snippet.endswith("...")
    assert ">>>数据库迁移<<<" in long_snippet
    assert len(long_snippet) <= snippets.SUBSTRING_SNIPPET_CHARS + 12


def test_corpus_of_special_character_queries(store: SessionDB) -> None:
    assert len(CORPUS) >= 40
    planted: dict[str, int] = {}
    for index, (query, content) in enumerate(CORPUS):
        session_id = f"s{index % 7}"
        store.ensure_session(session_id, "cli")
        [planted[query], _] = add(
            store, session_id, ("user", content), ("assistant", "noted, thanks"), t=T0 + index * 10
        )
    missing = [q for q, _ in CORPUS if planted[q] not in ids(store.search_messages(q, limit=50))]
    assert missing == []


HOSTILE = [
    '"', '""', '"unbalanced', "a\"b", "(", ")", "((a)", "{", "}", "^", "^a", "+", "-", "--",
    ":", "a:", ":a", "col:val", "*", "**a", "a**", "NEAR", "NEAR(", "NEAR(a b)", "a NEAR/2 b",
    "AND OR NOT", "a AND AND b", "a OR NOT b", "NOT", "'", "''", "\\", "\\\\", "%", "_", "%_%",
    "' OR 1=1 --", "); DROP TABLE messages; --", "<>", "[]", "|", "&&", "!", "~", "`", "$",
    "@", "#", "?", ",", ";", "=", ".", "..", "a.", ".a", "a\x00b", "\x00", "\ud800x", "\x1a",
    "\t\n", "\u200b", "😀", "a" * 5000, "a " * 3000, "中" * 300, "x-" * 400, '"a" ' * 200,
]  # fmt: skip


def test_hostile_queries_never_raise(store: SessionDB) -> None:
    store.create_session("s", "cli")
    add(store, "s", ("user", "a b col val NEAR x 1=1 中文 'quoted' % _"), t=T0)
    for query in HOSTILE:
        result = store.search_messages(query)
        assert isinstance(result, list), query
        assert all(set(row) == RESULT_KEYS for row in result)


def test_page_past_the_full_text_results_does_not_switch_to_substrings(store: SessionDB) -> None:
    store.create_session("s", "cli")
    word_hit, _substring_only = add(
        store, "s", ("user", "the chat-send tool"), ("user", "webchat-sender daemon"), t=T0
    )
    assert ids(store.search_messages("chat-send")) == [word_hit]
    assert store.search_messages("chat-send", offset=1) == []


def test_fts5_syntax_error_is_retried_and_logged_at_debug(
    sqlite_store: SessionDB, caplog: pytest.LogCaptureFixture
) -> None:
    sqlite_store.create_session("s", "cli")
    [target] = add(sqlite_store, "s", ("user", "alpha then beta"), t=T0)
    with caplog.at_level(logging.DEBUG, logger="hermes_store.search.fts5"):
        assert ids(sqlite_store.search_messages("alpha AND AND beta")) == [target]
    assert any("retrying with quoted terms" in r.getMessage() for r in caplog.records)


def test_other_database_errors_propagate(sqlite_store: SessionDB) -> None:
    """Not a query FTS5 refused: the index dropped from under the open store is said as such,
    not answered by the substring fallback."""
    sqlite_store.create_session("s", "cli")
    add(sqlite_store, "s", ("user", "hello"), t=T0)
    with sqlite_store.engine.begin() as conn:
        for statement in ddl.SQLITE_FTS_DROP:
            conn.exec_driver_sql(statement)
    with pytest.raises(UnrecognizedSchemaError, match="no such table: messages_fts"):
        sqlite_store.search_messages("hello")


# -- files that store text as UTF-16 -------------------------------------------------------------

#: The text encodings a SQLite file may have (``PRAGMA encoding``, fixed by its first table).
FILE_ENCODINGS = ("UTF-8", "UTF-16le", "UTF-16be")
_LONG_ROLE_NEIGHBOUR = "\u00e9" + "x" * fts5.NEIGHBOUR_LOAD_LIMIT  # read through a blob handle
#: Past a blob chunk (64 KiB) and the inline snippet: read in chunks, decoded incrementally,
#: with two-byte UTF-8 and surrogate-pair UTF-16 characters across the chunk boundaries.
_LONG_MATCH = "é😀x " * 20_000 + "zebra stripes " + "ü" * 300 + "😀" * 300
_ENCODED_MESSAGES = (
    ("a", "user", "first question about zebras"),
    ("b", "user", "bravo interleaved"),
    ("a", "assistant", "zebra answer"),
    ("a", "rôle-é", "third message, the zebra again"),
    ("a", "工具", "数据库迁移完成了"),
    ("a", "user\x00nul", "好的迁移 😀 \U00020000 zebra"),
    ("b", "tool", _LONG_ROLE_NEIGHBOUR),
    ("b", "user", "needle here, the chat-send tool"),
    ("b", "assistant", "nul\x00inside the needle answer"),
    ("a", "tool", _LONG_MATCH),
    ("a", "🛠️", "a last zebra after the long one, é" + "ß" * 300),
)
_ENCODED_QUERIES = (
    "zebra", "zebra*", '"zebra answer"', "answer", "needle", "迁移", "数据库", "好的",
    "chat-send", "é", "stripes", "zebra OR needle", "😀",
)  # fmt: skip


def _store_in(path: Path, encoding: str) -> SessionDB:
    """A store on a new file whose text is stored in ``encoding`` (set before its first table,
    as another program may), with the same messages at the same times in every encoding."""
    raw = sqlite3.connect(path)
    raw.execute(f"PRAGMA encoding = '{encoding}'")
    raw.execute("CREATE TABLE t(x)")
    raw.execute("DROP TABLE t")
    raw.close()
    store = SessionDB(path, clock=FakeClock(start=T0))
    store.create_session("a", "cli")
    store.create_session("b", "telegram")
    for i, (session_id, role, content) in enumerate(_ENCODED_MESSAGES):
        add(store, session_id, (role, content), t=T0 + 10 * i)
    return store


def _encoded_answers(store: SessionDB) -> dict[tuple[str, str, str], Any]:
    found: dict[tuple[str, str, str], Any] = {}
    for query, sort in itertools.product(_ENCODED_QUERIES, SORTS):
        found[query, sort, ""] = store.search_messages(query, sort=sort, limit=50)
        for role in ("rôle-é", "user\x00nul", "🛠️"):
            found[query, sort, role] = store.search_messages(query, sort=sort, role_filter=role)
        found[query, sort, "telegram"] = store.search_messages(
            query, sort=sort, source_filter="telegram"
        )
    return found


def test_a_file_storing_utf16_searches_as_a_utf8_one(tmp_path: Path) -> None:
    """SQLite converts text for every function and for the driver, but a text CAST AS BLOB and
    a blob handle give the bytes as the file stores them: full-text, CJK and substring search,
    snippets (inline and bounded) and contexts (in SQL and through blob handles) answer alike
    in a UTF-8, a UTF-16le and a UTF-16be file."""
    answers = {}
    for encoding in FILE_ENCODINGS:
        store = _store_in(tmp_path / f"{encoding}.db", encoding)
        with store.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA encoding").scalar() == encoding
        answers[encoding] = _encoded_answers(store)
        store.close()
    utf8 = answers["UTF-8"]
    assert all(utf8[query, "rank", ""] for query in _ENCODED_QUERIES)
    [third] = utf8['"zebra answer"', "rank", ""]
    assert [c["role"] for c in third["context"]] == ["user", "assistant", "rôle-é"]
    [nul] = utf8["迁移", "oldest", "user\x00nul"]
    assert nul["context"] == [
        {"role": "工具", "content": "数据库迁移完成了"},
        {"role": "user\x00nul", "content": "好的迁移 😀 \U00020000 zebra"},
        {"role": "tool", "content": _LONG_MATCH[:200]},
    ]
    needle = utf8["needle", "oldest", "telegram"][0]
    assert needle["context"][0] == {"role": "tool", "content": _LONG_ROLE_NEIGHBOUR[:200]}
    [long] = utf8["stripes", "rank", ""]
    assert ">>>stripes<<<" in long["snippet"]
    assert long["context"][1] == {"role": "tool", "content": _LONG_MATCH[:200]}
    assert long["context"][2]["role"] == "🛠️"
    for encoding in FILE_ENCODINGS[1:]:
        for key, rows in utf8.items():
            assert answers[encoding][key] == rows, (encoding, key)


# -- properties ----------------------------------------------------------------------------------

_serial = itertools.count()
_PUNCTUATION = list("\"*()+-^:.{}#$%&|\\'/@,?=;!~[]<>_")
_SYNTAX = [*_PUNCTUATION, " ", "AND", "OR", "NOT", "NEAR", "中文", "한"]
_QUERIES = st.one_of(
    st.text(max_size=40),
    st.lists(st.sampled_from([*_SYNTAX, "alpha", "be*", "x.y", "a-b"]), max_size=10).map(" ".join),
    st.text(alphabet=st.sampled_from([*_PUNCTUATION, *" ab1中"]), max_size=30),
)
_WORD = st.text(
    alphabet=st.one_of(
        st.characters(blacklist_categories=("Cs", "Cc", "Zs", "Zl", "Zp")),
        st.sampled_from(_PUNCTUATION),
    ),
    min_size=1,
    max_size=12,
).filter(lambda w: not any(ch.isspace() for ch in w))
_PROPERTY_SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _fresh_session(store: SessionDB) -> tuple[str, str]:
    """A new session on its own source, so one store serves every example of a test."""
    n = next(_serial)
    session_id, source = f"prop-{n}", f"src-{n}"
    store.create_session(session_id, source)
    return session_id, source


@_PROPERTY_SETTINGS
@given(stored=st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=80),
       query=_QUERIES)  # fmt: skip
def test_property_search_never_raises(store: SessionDB, stored: str, query: str) -> None:
    session_id, _ = _fresh_session(store)
    if store.is_sqlite or "\x00" not in stored:
        add(store, session_id, ("user", stored), t=T0)
    for result in (
        store.search_messages(query),
        store.search_messages(query, role_filter=["user"]),
    ):
        assert isinstance(result, list)
        assert all(set(row) == RESULT_KEYS for row in result)


@_PROPERTY_SETTINGS
@given(words=st.lists(_WORD, min_size=1, max_size=6), pick=st.integers(min_value=0))
def test_property_any_word_of_a_message_finds_it(
    store: SessionDB, words: list[str], pick: int
) -> None:
    word = words[pick % len(words)]
    assume(sanitize_fts5_query(word))
    session_id, source = _fresh_session(store)
    [target] = add(store, session_id, ("user", " ".join(words)), t=T0)
    assert target in ids(store.search_messages(word, source_filter=[source]))


# -- scale --------------------------------------------------------------------------------------

N_SESSIONS = 2_000
N_MESSAGES = 40_000
VOCABULARY = (
    "alpha", "beta", "gamma", "delta", "deploy", "server", "config", "token", "agent",
    "memory", "python", "rust", "cache", "lambda", "kernel", "docker", "network",
)  # fmt: skip


def _generate(engine: sa.Engine) -> dict[str, Any]:
    """2,000 sessions (every tenth a child) and 40,000 interleaved messages via executemany."""
    rng = random.Random(4)
    sessions = [
        {
            "id": f"s{i:05d}",
            "source": ("cli", "telegram", "discord")[i % 3],
            "started_at": T0 + i * 10.0,
            "parent_session_id": f"s{i - 1:05d}" if i % 10 == 9 else None,
            "message_count": N_MESSAGES // N_SESSIONS,
        }
        for i in range(N_SESSIONS)
    ]
    messages = []
    for j in range(N_MESSAGES):
        k = j % N_SESSIONS  # round-robin: a session's messages are N_SESSIONS ids apart
        text = " ".join(rng.choice(VOCABULARY) for _ in range(rng.randint(3, 25)))
        if j % 1_000 == 7:
            text += " zanzibar 数据库迁移 src/app/main.py"
        messages.append(
            {"session_id": f"s{k:05d}", "role": ("user", "assistant")[j // N_SESSIONS % 2],
             "content": text, "timestamp": T0 + k * 10.0 + j / N_MESSAGES}
        )  # fmt: skip
    with engine.begin() as conn:
        conn.execute(S.insert(), sessions)
        conn.execute(M.insert(), messages)
    return {"sessions": sessions, "messages": messages}


def test_large_database_search_and_listing(store: SessionDB) -> None:
    data = _generate(store.engine)
    messages = data["messages"]
    needles = {j for j, m in enumerate(messages) if "zanzibar" in m["content"]}
    by_position = {m["timestamp"]: j for j, m in enumerate(messages)}

    def all_pages(query: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while page := store.search_messages(query, limit=15, offset=len(out)):
            out += page
        return out

    for query in ("zanzibar", "数据库迁移", "src/app/main.py"):
        found = all_pages(query)
        assert {by_position[row["timestamp"]] for row in found} == needles, query
    # context: neighbours of the same session, 2,000 ids away, not the global id neighbours
    for row in all_pages("zanzibar"):
        j = by_position[row["timestamp"]]
        around = [k for k in (j - N_SESSIONS, j, j + N_SESSIONS) if 0 <= k < N_MESSAGES]
        assert row["context"] == [
            {"role": messages[k]["role"], "content": messages[k]["content"][:200]} for k in around
        ]
    assert len(store.search_messages("kernel", source_filter=["cli"], limit=50)) == 50

    top_level = sorted(
        (s for s in data["sessions"] if s["parent_session_id"] is None),
        key=lambda s: s["started_at"],
        reverse=True,
    )
    page = store.list_sessions_rich(limit=25, offset=500)
    assert [r["id"] for r in page] == [s["id"] for s in top_level[500:525]]
    for row in page:
        mine = [m for m in messages if m["session_id"] == row["id"]]
        first_user = next(m["content"] for m in mine if m["role"] == "user")
        assert row["preview"] == (first_user[:60] + "..." if len(first_user) > 60 else first_user)
        assert row["last_active"] == max(m["timestamp"] for m in mine)
    with_children = store.list_sessions_rich(limit=N_SESSIONS, include_children=True)
    assert len(with_children) == N_SESSIONS


# -- plans and index maintenance --------------------------------------------------------------


def test_search_plans_use_the_indexes(store: SessionDB) -> None:
    store.create_session("s", "cli")
    add(store, "s", *[("user", f"plan check {i}") for i in range(5)], t=T0)
    with captured_selects(store) as statements:
        found = store.search_messages("plan")
    assert len(found) == 5
    if not store.is_sqlite:
        # One statement: the ranked page off the GIN index, then sessions, the headlines and
        # the context seeks for the page's rows only.
        [statement] = statements
        plan = explain(store, *statement)
        assert ddl.PG_FTS_INDEX in plan
        assert "pk_messages" in plan and "pk_sessions" in plan, plan
        assert plan.count("idx_messages_session") >= 2, plan
        return
    match, snippets, context = statements  # the page, the engine's snippets, the context
    match_plan = explain(store, *match)
    snippet_plan = explain(store, *snippets)
    context_plan = explain(store, *context)
    assert "VIRTUAL TABLE INDEX" in match_plan
    # FTS5 yields the newest matches in rowid order (no sorter for that); what is sorted
    # is the bounded window by rank, then the page of at most ``limit`` rows.
    assert match_plan.count("TEMP B-TREE") == 2, match_plan
    assert "VIRTUAL TABLE INDEX 0:M1><" in snippet_plan  # one pass over the rowid range
    assert context_plan.count("idx_messages_session") >= 2


def test_index_maintenance(store: SessionDB, backend: str) -> None:
    store.create_session("s", "cli")
    [target] = add(store, "s", ("user", "maintenance probe"), t=T0)
    with store.engine.begin() as conn:
        # A CJK index missing where SQLite could have one is damage the check reports.
        assert pipeline.check_index(conn) is (backend != NO_CJK_INDEX)
        pipeline.optimize_index(conn)
        pipeline.rebuild_index(conn)
        assert pipeline.check_index(conn)
    assert ids(store.search_messages("probe")) == [target]


def test_check_index_detects_a_corrupt_fts5_index(
    sqlite_store: SessionDB, caplog: pytest.LogCaptureFixture
) -> None:
    sqlite_store.create_session("s", "cli")
    [target] = add(sqlite_store, "s", ("user", "original words"), t=T0)
    with sqlite_store.engine.begin() as conn:
        # Deleting with the wrong content is the documented way to corrupt an external index.
        conn.exec_driver_sql(
            "INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', ?, ?)",
            (target, "different words"),
        )
    with sqlite_store.engine.begin() as conn, caplog.at_level(logging.ERROR):
        assert not pipeline.check_index(conn)
    assert any("integrity check" in r.getMessage() for r in caplog.records)
    with sqlite_store.engine.begin() as conn:
        pipeline.rebuild_index(conn)
        assert pipeline.check_index(conn)
    assert ids(sqlite_store.search_messages("original")) == [target]


def test_rebuild_index_repairs_a_missing_index(store: SessionDB) -> None:
    store.create_session("s", "cli")
    [target] = add(store, "s", ("user", "catalogue probe"), t=T0)
    with store.engine.begin() as conn:
        if store.is_sqlite:
            for statement in ddl.SQLITE_FTS_DROP:
                conn.exec_driver_sql(statement)
        else:
            conn.exec_driver_sql(f"DROP INDEX {ddl.PG_FTS_INDEX}")
        assert not pipeline.check_index(conn)
        pipeline.rebuild_index(conn)
        assert pipeline.check_index(conn)
    assert ids(store.search_messages("catalogue")) == [target]
    [later] = add(store, "s", ("user", "catalogue again"), t=T0 + 5)  # the triggers are back
    assert set(ids(store.search_messages("catalogue"))) == {target, later}
