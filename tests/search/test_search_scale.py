"""Search beyond the contract: CJK recall through the trigram index, sort orders, bounded
snippets, ranking among the newest matches, and the original store on a file with the index.

Tests that take ``store`` run on SQLite and on PostgreSQL.
"""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest

from hermes_store import SessionDB
from hermes_store.errors import InvalidInputError
from hermes_store.schema import ddl
from hermes_store.search import hits, snippets
from hermes_store.search.query import parse_query
from tests.support.backends import SEARCH_BACKENDS
from tests.support.query_plans import captured_selects, explain
from tests.support.search_rows import T0, add, ids
from tests.support.seed_store import SeedSessionDB


@pytest.fixture(params=SEARCH_BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """SQLite with and without the CJK trigram index, PostgreSQL, PostgreSQL behind PgBouncer."""
    return str(request.param)


#: A message where the word is a token of its own (full-text search finds it) and messages
#: where it sits inside a longer run of the same script (only a substring match finds them).
RECALL_CASES = [
    ("数据库", "数据库", ["我们明天要做数据库迁移", "数据库连接失败了"]),
    ("迁移", "迁移", ["数据库迁移计划", "迁移完成"]),
    ("数据", "数据", ["大数据平台"]),
    ("ベース", "ベース", ["データベースの移行", "ベースキャンプ"]),
    ("한국어", "한국어", ["한국어로 작성되었습니다", "이 문서는 한국어입니다"]),
    ("通信", "通信", ["我们讨论了Agent通信协议"]),
    ("ภาษา", "ภาษา", ["ภาษาไทยง่ายมาก"]),
]


@pytest.mark.parametrize(("query", "alone", "inside"), RECALL_CASES)
@pytest.mark.parametrize("other_hits", [True, False], ids=["with-fts-hits", "without"])
def test_cjk_term_is_found_inside_longer_runs(
    store: SessionDB, query: str, alone: str, inside: list[str], other_hits: bool
) -> None:
    """Every message holding the term is found, whether or not full-text search also has
    hits (it does when the term is a whole token somewhere); 1-2 character terms too."""
    store.create_session("s", "cli")
    texts = ([alone] if other_hits else []) + inside + ["nothing to see", "数字"]
    found_ids = add(store, "s", *[("user", text) for text in texts], t=T0)
    expected = found_ids[: len(texts) - 2]
    rows = store.search_messages(query)
    assert sorted(ids(rows)) == sorted(expected)
    assert all(f">>>{query}<<<" in row["snippet"] for row in rows)


def test_mixed_scripts_and_operators(store: SessionDB) -> None:
    """CJK with Latin in one term, CJK and Latin terms ANDed, ORed, negated, quoted phrases."""
    store.create_session("s", "cli")
    a, b, c, d = add(
        store,
        "s",
        ("user", "我们讨论了Agent通信协议"),
        ("user", "server 重启之后数据库连接失败"),
        ("user", "数据库连接正常, the server is fine"),
        ("user", "日志里面显示 error"),
        t=T0,
    )
    assert ids(store.search_messages("Agent通信")) == [a]
    assert ids(store.search_messages("agent通信")) == [a]  # ASCII case-insensitive
    assert sorted(ids(store.search_messages("数据库 server"))) == [b, c]
    assert ids(store.search_messages("数据库 NOT 失败")) == [c]
    assert sorted(ids(store.search_messages("协议 OR 日志"))) == [a, d]
    assert ids(store.search_messages('"连接失败"')) == [b]
    assert ids(store.search_messages("数据库连接正常")) == [c]


def test_cjk_search_uses_the_trigram_index(sqlite_store: SessionDB) -> None:
    """On SQLite the CJK query reads the trigram index (3+ characters) or the list of indexed
    rows (shorter terms), never every message."""
    store = sqlite_store
    store.create_session("s", "cli")
    add(store, "s", ("user", "我们明天要做数据库迁移"), ("user", "plain text"), t=T0)
    cases = (("数据库", "messages_cjk VIRTUAL TABLE"), ("迁移", "messages_cjk_docsize"))
    for query, marker in cases:
        with captured_selects(store) as statements:
            assert len(store.search_messages(query)) == 1
        plan = explain(store, *statements[-1])
        assert marker in plan, plan
        assert "SCAN messages\n" not in plan + "\n", plan


def test_cjk_search_without_the_index_still_finds_everything(sqlite_store: SessionDB) -> None:
    """Downgraded (or built by a SQLite without trigram), CJK search scans and finds the same."""
    store = sqlite_store
    store.create_session("s", "cli")
    ids_ = add(store, "s", ("user", "数据库"), ("user", "我们明天要做数据库迁移"), t=T0)
    with store.engine.begin() as conn:
        for statement in ddl.SQLITE_CJK_DROP:
            conn.exec_driver_sql(statement)
    assert sorted(ids(store.search_messages("数据库"))) == sorted(ids_)
    assert sorted(ids(store.search_messages("迁移"))) == [ids_[1]]


@pytest.mark.parametrize("query", ["deploy", "部署"])
def test_sort_orders(store: SessionDB, query: str) -> None:
    """rank is the default; newest and oldest order by timestamp then id, whatever the ids."""
    store.create_session("s", "cli")
    texts = [f"{query} once", f"{query} {query} {query} twice over", f"then {query} again"]
    # Timestamps out of id order: the middle message is the newest.
    first = add(store, "s", ("user", texts[0]), t=T0)
    second = add(store, "s", ("user", texts[1]), t=T0 + 100)
    third = add(store, "s", ("user", texts[2]), t=T0 + 50)
    newest = ids(store.search_messages(query, sort="newest"))
    oldest = ids(store.search_messages(query, sort="oldest"))
    assert newest == [*second, *third, *first]
    assert oldest == list(reversed(newest))
    ranked = ids(store.search_messages(query))
    assert ranked == ids(store.search_messages(query, sort="rank"))
    assert sorted(ranked) == sorted(newest)
    # Paging follows the chosen order.
    assert ids(store.search_messages(query, sort="oldest", limit=1, offset=1)) == third


def test_sort_rank_is_best_first(store: SessionDB) -> None:
    store.create_session("s", "cli")
    weak, strong = add(
        store,
        "s",
        ("user", "a long message that mentions kestrel once among many many other words here"),
        ("user", "kestrel kestrel kestrel"),
        t=T0,
    )
    assert ids(store.search_messages("kestrel")) == [strong, weak]


@pytest.mark.parametrize("sort", ["best", "", "RANK", None, 3])
def test_unknown_sort_is_refused(store: SessionDB, sort: Any) -> None:
    with pytest.raises(InvalidInputError, match="sort"):
        store.search_messages("anything", sort=sort)


def test_rank_window_keeps_bm25_order_of_the_newest_matches(
    sqlite_store: SessionDB, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With more matches than RANK_WINDOW, rank orders the newest RANK_WINDOW by BM25 (scores
    are global, so they equal full BM25's); below it, the order is full BM25's."""
    store = sqlite_store
    store.create_session("s", "cli")
    texts = ["heron " * (1 + i % 4) + "filler words " * (i % 5) for i in range(30)]
    made = add(store, "s", *[("user", t) for t in texts], t=T0)
    full = ids(store.search_messages("heron", limit=30))
    assert sorted(full) == sorted(made)
    monkeypatch.setattr(hits, "RANK_WINDOW", 10)
    windowed = ids(store.search_messages("heron", limit=5))
    newest_ten = set(made[-10:])
    assert windowed == [i for i in full if i in newest_ten][:5]
    assert windowed != full[:5]  # the window did cut: older, better matches are left out


def _in_thread(fn: Any) -> Any:
    """Run ``fn`` in a thread; a generous join timeout is the deadlock guard (a quadratic
    snippet over this message would run for hours)."""
    out: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: out.setdefault("value", fn()), daemon=True)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive(), "search did not finish: is the snippet bounded?"
    return out["value"]


def test_snippet_of_a_huge_repetitive_message_is_bounded(store: SessionDB) -> None:
    """A 4 MB log repeating the word: the snippet is a window around the first match, shaped
    like FTS5's (marked, about 40 tokens, cut with ...), and the search returns."""
    store.create_session("s", "cli")
    log = "boot ok\n" + "error: disk full at sector 42\n" * 140_000
    big, small = add(store, "s", ("tool", log), ("user", "one error here"), t=T0)
    rows = _in_thread(lambda: store.search_messages("error"))
    assert sorted(ids(rows)) == sorted([big, small])
    snippet = next(r["snippet"] for r in rows if r["id"] == big)
    assert snippet.startswith("boot ok\n>>>error<<<: disk full"), snippet[:80]
    assert snippet.endswith("...")
    assert snippet.count(">>>error<<<") >= 5
    assert len(snippet) < 600
    phrase = _in_thread(lambda: store.search_messages('"disk full"', limit=1))
    assert ">>>disk full<<<" in phrase[0]["snippet"] and len(phrase[0]["snippet"]) < 600


def test_bounded_snippet_shape() -> None:
    patterns = snippets.term_patterns(parse_query('deploy* "the migration"'))
    text = "intro " * 100 + "we ran the Migration and then deployment " + "tail " * 100
    snippet = snippets.bounded_snippet(text, patterns)
    assert snippet.startswith("...") and snippet.endswith("...")
    assert ">>>the Migration<<<" in snippet and ">>>deployment<<<" in snippet
    assert len(snippets.TOKEN.findall(snippet.replace(">>>", " ").replace("<<<", " "))) <= 41
    whole = snippets.bounded_snippet("short deploy text", patterns)
    assert whole == "short >>>deploy<<< text"


def test_original_store_writes_into_the_cjk_index(tmp_path: Path) -> None:
    """The original store opens a file at head, writes CJK messages (its inserts fire the
    index's triggers), deletes some, still searches; this store then finds exactly the rest."""
    path = tmp_path / "state.db"
    ours = SessionDB(path)
    ours.create_session("mine", "cli")
    ours.append_message("mine", "user", "我们的数据库")
    ours.close()
    seed = SeedSessionDB(path)
    try:
        seed.create_session("theirs", source="telegram")
        seed.append_message("theirs", "user", "明天做数据库迁移")
        seed.append_message("theirs", "assistant", "数据库备份好了")
        seed.create_session("gone", source="cli")
        seed.append_message("gone", "user", "这个数据库要删掉")
        seed.delete_session("gone")
        assert len(seed.search_messages("数据库迁移")) == 1  # its LIKE fallback
    finally:
        seed.close()
    con = sqlite3.connect(path)
    try:
        indexed = [i for (i,) in con.execute("SELECT id FROM messages_cjk_docsize ORDER BY id")]
        with_cjk = [i for (i,) in con.execute("SELECT id FROM messages ORDER BY id")]
        con.execute("INSERT INTO messages_cjk(messages_cjk, rank) VALUES ('integrity-check', 1)")
    finally:
        con.close()
    assert indexed == with_cjk and len(indexed) == 3
    again = SessionDB(path)
    try:
        rows = again.search_messages("数据库", sort="oldest")
        assert [r["session_id"] for r in rows] == ["mine", "theirs", "theirs"]
        assert again.check_search_index()
    finally:
        again.close()


def test_check_and_rebuild_cover_the_cjk_index(sqlite_store: SessionDB) -> None:
    """doctor's check finds a CJK index out of step (a trigger gone, a message written
    meanwhile); rebuild_search_index puts the trigger back and indexes exactly the CJK rows."""
    store = sqlite_store
    store.create_session("s", "cli")
    add(store, "s", ("user", "数据库迁移"), ("user", "plain"), t=T0)
    assert store.check_search_index()
    with store.engine.begin() as conn:
        conn.exec_driver_sql("DROP TRIGGER messages_cjk_insert")
    assert not store.check_search_index()  # a trigger is missing
    [late] = add(store, "s", ("user", "新的数据库连接"), t=T0 + 10)
    store.rebuild_search_index()
    assert store.check_search_index()
    with store.engine.begin() as conn:
        conn.exec_driver_sql(
            "INSERT INTO messages_cjk(messages_cjk, rowid, content) VALUES ('delete', ?, ?)",
            (late, "新的数据库连接"),
        )
    assert not store.check_search_index()  # the index misses a CJK message
    store.rebuild_search_index()
    assert store.check_search_index()
    assert late in ids(store.search_messages("数据库连接"))
    con = sqlite3.connect(store.engine.url.database or "")
    try:
        indexed = [i for (i,) in con.execute("SELECT id FROM messages_cjk_docsize ORDER BY id")]
        cjk = [i for (i,) in con.execute("SELECT id FROM messages WHERE content != 'plain'")]
    finally:
        con.close()
    assert indexed == cjk


def test_cjk_inside_a_run_is_found_when_ored_with_a_latin_word_or_only_negated(
    store: SessionDB,
) -> None:
    """A query whose CJK part the trigram index cannot narrow (ORed with a Latin word, or only
    negated) is still a substring match: CJK inside a longer run is never missed."""
    store.create_session("s", "cli")
    a, b, c = add(
        store,
        "s",
        ("user", "我们明天要做数据库迁移"),
        ("user", "the deploy script is ready"),
        ("user", "deploy 数据库迁移 first"),
        t=T0,
    )
    assert sorted(ids(store.search_messages("deploy OR 数据"))) == [a, b, c]
    assert sorted(ids(store.search_messages("数据 OR deploy"))) == [a, b, c]
    assert ids(store.search_messages("deploy NOT 数据")) == [b]
