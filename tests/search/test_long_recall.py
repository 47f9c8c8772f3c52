"""Words anywhere in a long message. SQLite's FTS5 indexes every character. PostgreSQL's stored
tsvector holds a message's first 200,000 characters (``ddl.PG_INDEXED_CHARS``: a tsvector
cannot exceed 1 MB); the whole text of a longer message is also indexed in chunks
(``message_text_chunks``, revision ``h10_pg_long_text``), which the search unions with the
stored column: the same answers on both backends, whatever else matches beside it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL, Engine
from sqlalchemy.pool import NullPool

from hermes_store import SessionDB
from hermes_store.schema import ddl
from hermes_store.transfer import import_sessions
from tests.support.backends import url_string

WORD = "zebracorn"
#: Enough repeated filler to push what follows past the stored column's first 200,000
#: characters (and past 200,000 bytes: the length that makes a message long).
FILLER = "filler words " * (ddl.PG_INDEXED_CHARS // 13 + 1000)


def _long_message(store: SessionDB, session: str = "long", tail: str = f"{WORD} tail") -> int:
    assert len(FILLER) > ddl.PG_INDEXED_CHARS
    if store.get_session(session) is None:
        store.create_session(session, "cli")
    return int(store.append_message(session, "tool", f"{FILLER} {tail}"))


def _short(store: SessionDB, text: str, session: str = "short", role: str = "user") -> int:
    if store.get_session(session) is None:
        store.create_session(session, "cli")
    return int(store.append_message(session, role, text))


def _hits(store: SessionDB, query: str, **filters: object) -> set[int]:
    return {hit["id"] for hit in store.search_messages(query, limit=50, **filters)}  # type: ignore[arg-type]


def _ranked(store: SessionDB, query: str, **options: object) -> list[int]:
    return [hit["id"] for hit in store.search_messages(query, **options)]  # type: ignore[arg-type]


@pytest.fixture
def raw_engine(store: SessionDB, db_url: URL) -> Iterator[Engine | None]:
    """A plain engine on the store's PostgreSQL database (None on SQLite), to look at the
    chunk table and to write as another program would."""
    if store.is_sqlite:
        yield None
        return
    engine = sa.create_engine(db_url, poolclass=NullPool)
    yield engine
    engine.dispose()


def _chunks(engine: Engine, message_id: int) -> list[int]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                sa.text(
                    f"SELECT chunk_no FROM {ddl.PG_CHUNK_TABLE} WHERE message_id = :id"
                    " ORDER BY chunk_no"
                ),
                {"id": message_id},
            ).scalars()
        )


def test_a_word_past_the_indexed_bound_is_found_when_nothing_else_holds_it(
    store: SessionDB,
) -> None:
    long_id = _long_message(store)
    assert _hits(store, WORD) == {long_id}
    assert _hits(store, "filler") == {long_id}
    assert _hits(store, f"{WORD} OR absent") == {long_id}


def test_a_word_past_the_indexed_bound_is_found_beside_other_matches(store: SessionDB) -> None:
    long_id = _long_message(store)
    short_id = _short(store, f"a short {WORD} message")
    assert _hits(store, WORD) == {long_id, short_id}
    assert _hits(store, f"{WORD}*") == {long_id, short_id}
    assert _hits(store, f'"{WORD} tail"') == {long_id}  # a phrase in the tail


def test_and_or_not_hold_over_the_whole_long_message(store: SessionDB) -> None:
    """A term at the start and one in the tail make an AND match; a NOT term in the tail
    excludes the message even though its first 200,000 characters do not hold it."""
    long_id = _long_message(store)
    both = _short(store, f"filler and {WORD}")
    only_filler = _short(store, "just filler here")
    assert _hits(store, f"filler {WORD}") == {long_id, both}
    assert _hits(store, f"filler AND {WORD}") == {long_id, both}
    assert _hits(store, f"filler NOT {WORD}") == {only_filler}
    assert _hits(store, f"{WORD} NOT filler") == set()
    assert _hits(store, f"absent OR {WORD} NOT here") == {long_id, both}
    assert _hits(store, "tail NOT absent") == {long_id}


def test_a_word_at_the_very_end_of_a_16_mib_message_is_found(store: SessionDB) -> None:
    """The largest message the store takes: 16 MiB of text, the word its last bytes."""
    tail = f" {WORD}"
    body = ("filler words " * (store.max_message_bytes // 13 + 1))[
        : store.max_message_bytes - len(tail)
    ] + tail
    assert len(body.encode()) == store.max_message_bytes
    store.create_session("huge", "cli")
    huge_id = int(store.append_message("huge", "tool", body))
    short_id = _short(store, f"short {WORD}")
    assert _hits(store, WORD) == {huge_id, short_id}
    assert _hits(store, "filler") == {huge_id}


def test_a_long_message_ranks_among_the_other_matches(store: SessionDB) -> None:
    """Rank order with a tail match beside short ones: the long message that holds the word
    thirty times ranks above messages that hold it once (on SQLite by BM25, on PostgreSQL by
    the ts_rank of its best chunk); ``newest``/``oldest`` order by time, and paging cuts the
    one order."""
    first = _short(store, f"once {WORD} here", session="a")
    long_id = _long_message(store, tail=" ".join([WORD] * 30))
    last = _short(store, f"also {WORD} once", session="b")
    ranked = _ranked(store, WORD)
    assert ranked[0] == long_id and set(ranked) == {first, long_id, last}
    assert _ranked(store, WORD, sort="newest") == [last, long_id, first]
    assert _ranked(store, WORD, sort="oldest") == [first, long_id, last]
    pages = [_ranked(store, WORD, limit=1, offset=offset) for offset in range(4)]
    assert pages == [[ranked[0]], [ranked[1]], [ranked[2]], []]


def test_filters_apply_to_long_matches(store: SessionDB) -> None:
    store.create_session("web-session", "web")
    long_id = _long_message(store)  # role tool, source cli
    web_id = _short(store, f"{WORD} on the web", session="web-session", role="assistant")
    tool_id = _short(store, f"{WORD} from a tool", role="tool")
    assert _hits(store, WORD, role_filter=["tool"]) == {long_id, tool_id}
    assert _hits(store, WORD, role_filter=["assistant"]) == {web_id}
    assert _hits(store, WORD, source_filter=["cli"]) == {long_id, tool_id}
    assert _hits(store, WORD, exclude_sources=["web"]) == {long_id, tool_id}
    assert _hits(store, WORD, exclude_sources=["cli"]) == {web_id}
    assert _hits(store, WORD, source_filter=["web"], role_filter=["tool"]) == set()


def test_the_snippet_of_a_tail_match_shows_the_word(store: SessionDB) -> None:
    _long_message(store)
    (hit,) = store.search_messages(WORD)
    assert f">>>{WORD}<<<" in hit["snippet"]


def test_a_cjk_word_in_the_tail_is_found(store: SessionDB) -> None:
    long_id = _long_message(store, tail="我们明天要做数据库迁移")
    short_id = _short(store, "数据库")
    assert _hits(store, "数据库") == {long_id, short_id}


def test_deleting_a_long_message_removes_its_chunks(
    store: SessionDB, raw_engine: Engine | None
) -> None:
    long_id = _long_message(store)
    kept_id = _long_message(store, session="kept")
    if raw_engine is not None:
        assert len(_chunks(raw_engine, long_id)) > 1
    assert store.delete_session("long")
    assert _hits(store, WORD) == {kept_id}
    if raw_engine is not None:
        assert _chunks(raw_engine, long_id) == []
        assert len(_chunks(raw_engine, kept_id)) > 1


@pytest.mark.parametrize("backend", ["postgresql"])
def test_updating_a_long_message_reindexes_its_chunks(
    store: SessionDB, raw_engine: Engine | None
) -> None:
    """Another program (or a redaction) rewrites a message in place: the chunks follow, for a
    long text replaced by another, by a short one, and a short one made long."""
    assert raw_engine is not None
    long_id = _long_message(store)
    short_id = _short(store, "short and plain")

    def rewrite(message_id: int, content: str) -> None:
        with raw_engine.begin() as conn:
            conn.execute(
                sa.text("UPDATE messages SET content = :c WHERE id = :id"),
                {"c": content, "id": message_id},
            )

    rewrite(long_id, f"{FILLER} unicornfish tail")
    assert _hits(store, WORD) == set()
    assert _hits(store, "unicornfish") == {long_id}
    before = _chunks(raw_engine, long_id)
    assert before == list(range(len(before))) and len(before) > 1
    rewrite(long_id, "now short")
    assert _chunks(raw_engine, long_id) == []
    assert _hits(store, "unicornfish") == set()
    rewrite(short_id, f"{FILLER} {WORD}")
    assert len(_chunks(raw_engine, short_id)) > 1
    assert _hits(store, WORD) == {short_id}


def test_a_bulk_import_indexes_long_messages(store: SessionDB, db_url: URL) -> None:
    """Export and import (COPY on PostgreSQL) keep a tail word findable."""
    long_id = _long_message(store)
    records = list(store.iter_export())
    store.delete_session("long")
    assert _hits(store, WORD) == set()
    target = SessionDB(url_string(db_url))
    try:
        import_sessions(target, enumerate(records, 1))
        assert _hits(target, WORD) == {long_id}
    finally:
        target.close()


@pytest.mark.parametrize("backend", ["postgresql"])
def test_chunks_fit_postgresql_limits(store: SessionDB, raw_engine: Engine | None) -> None:
    """A message of distinct words with multi-byte characters and a stretch without
    whitespace, and one of 300,000 one-letter words: every chunk's tsvector stays well under
    1 MB and its positions under 16,383 (where PostgreSQL stops counting), and words around
    the cuts are found."""
    assert raw_engine is not None
    words = [f"w{i:06d}ü" for i in range(40_000)]
    blob = "x" * 5_000  # a run longer than a cut's search for whitespace
    body = " ".join(words[:20_000]) + f" {blob} " + " ".join(words[20_000:])
    store.create_session("distinct", "cli")
    message_id = int(store.append_message("distinct", "tool", body))
    dense_id = _long_message(store, session="dense", tail=" ".join("abcdefghij" * 30_000))
    with raw_engine.connect() as conn:
        size, position = conn.execute(
            sa.text(
                f"SELECT max(pg_column_size(tsv)), max(p) FROM {ddl.PG_CHUNK_TABLE},"
                " unnest(tsv) AS u, unnest(u.positions) AS p WHERE message_id IN (:a, :b)"
            ),
            {"a": message_id, "b": dense_id},
        ).one()
    assert size < 256 * 1024 and position < 16_383
    for word in (words[0], words[19_999], words[20_000], words[-1], words[12_345]):
        assert _hits(store, word) == {message_id}, word


def test_long_messages_in_two_schemas_of_one_database(pg_url: URL) -> None:
    """Stores placed in schemas of one database: each one's triggers index into its own chunk
    table (the store's one-statement writes name tables by schema and set no search_path),
    and each one's search finds only its own messages."""
    url = url_string(pg_url)
    with SessionDB(url, schema="recall_a") as a, SessionDB(url, schema="recall_b") as b:
        found: dict[str, set[int]] = {}
        for db, word in ((a, "alphaword"), (b, "betaword")):
            long_id = _long_message(db, tail=word)
            short_id = _short(db, f"short {word}")
            found[word] = {long_id, short_id}
        assert _hits(a, "alphaword") == found["alphaword"]
        assert _hits(b, "betaword") == found["betaword"]
        assert _hits(a, "betaword") == set() and _hits(b, "alphaword") == set()
    engine = sa.create_engine(pg_url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            counts = [
                conn.execute(
                    sa.text(f"SELECT count(*) FROM {schema}.{ddl.PG_CHUNK_TABLE}")
                ).scalar()
                for schema in ("recall_a", "recall_b")
            ]
            assert (
                conn.execute(sa.text(f"SELECT to_regclass('public.{ddl.PG_CHUNK_TABLE}')")).scalar()
                is not None
            )
            assert (
                conn.execute(sa.text(f"SELECT count(*) FROM public.{ddl.PG_CHUNK_TABLE}")).scalar()
                == 0
            )
    finally:
        engine.dispose()
    assert counts[0] == counts[1] and counts[0] > 1


def test_a_phrase_across_a_chunk_cut_is_found(store: SessionDB) -> None:
    """Chunks are cut at whitespace every ~16,000 bytes and each reads 1,000 bytes on into
    the next: a phrase that straddles a cut (here the one after byte 208,001, past the
    stored column's 200,000 characters) is whole in the chunk before it."""
    cut = 13 * ddl.PG_CHUNK_BYTES + 1  # "x " repeated: cuts fall after every 16,000th byte
    before = "x " * ((cut - 3) // 2)  # the phrase's first word covers the cut
    assert len(before) > ddl.PG_INDEXED_CHARS and len(before) < cut < len(before) + 5
    store.create_session("phrase", "cli")
    long_id = int(store.append_message("phrase", "tool", f"{before}alpha bravo {'x ' * 500}"))
    short_id = _short(store, "alpha bravo in short")
    _short(store, "bravo alpha the other way")
    assert _hits(store, '"alpha bravo"') == {long_id, short_id}


@pytest.mark.parametrize("backend", ["postgresql"])
def test_a_term_without_a_word_weighs_the_same_on_both_sides(store: SessionDB) -> None:
    """PostgreSQL's parser finds no word in some characters Python calls digits or letters
    (``²``, private use): the stored column's query drops such a term, and so does the
    evaluation over a long message's chunks (SQLite's tokenizer keeps them: not compared)."""
    long_id = _long_message(store)
    short_id = _short(store, f"short {WORD}")
    for query in (f"{WORD} ²", f"{WORD} \ue000", f"{WORD} NOT ²", f"² OR {WORD}"):
        assert _hits(store, query) == {long_id, short_id}, query
