"""PostgreSQL at scale, the read side: search, listing, export and import at 100k messages, and
search at 1M.

    .venv/bin/python -m bench.pg_scale --pg postgresql://postgres@127.0.0.1/test [--million]

A 100k-message corpus (bench.corpus) is written through the store into a SQLite file, exported
once, and imported into a scratch PostgreSQL database (``pgread_bench_*``, dropped afterwards).
Interleaved rounds, median [min..max] per call:

- import of the file: PostgreSQL with COPY (ours), PostgreSQL with the generic INSERT batches
  (before), and the same import into a fresh SQLite file;
- export (every record streamed): PostgreSQL through server-side cursors (ours), PostgreSQL's
  paged path (before: a round trip per session), and the SQLite floor (the original store's
  export loop on the SQLite file);
- searches and the first listing page, with the statements each sends;
- ``--million``: a 1M-message database built by ``generate_series`` on the server (its own
  words, the same rare word planted 12 times), and the rare-word search there.

Rewrites the section between the markers in docs/benchmarks.md (``--out -`` prints it).
"""

from __future__ import annotations

import argparse
import functools
import io
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any
from unittest import mock

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sqlalchemy as sa
from sqlalchemy import event

from bench.build import drop_pg_database, fresh_pg_database
from bench.corpus import CJK_QUERY, COMMON_WORD, PHRASE, RARE_WORD, Corpus
from bench.floor import Floor
from bench.timing import Stats, interleaved
from hermes_store import SessionDB
from hermes_store.engine.factory import autocommit_engine
from hermes_store.repo import pgstream
from hermes_store.schema import migrate
from hermes_store.transfer import import_sessions, read_records, write_export

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- pg-scale:begin -->", "<!-- pg-scale:end -->"
PREFIX = "pgread_bench"
SEARCHES: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("rare word", RARE_WORD, {}),
    ("common word", COMMON_WORD, {}),
    ("phrase", PHRASE, {}),
    ("rare word, source filter", RARE_WORD, {"source_filter": ["cli"]}),
    ("common word, sort=newest", COMMON_WORD, {"sort": "newest"}),
    ("CJK (substring)", CJK_QUERY, {}),
)


def fmt(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.0f} µs"


def spread(stats: Stats) -> str:
    return f"{fmt(stats.median)} [{fmt(stats.low)}..{fmt(stats.high)}]"


def consume(records: Iterable[Any]) -> int:
    return sum(1 for _ in records)


def statements(store: SessionDB, fn: Callable[[], object]) -> int:
    """How many statements ``fn`` sends to the server."""
    seen: list[str] = []

    def capture(*args: Any) -> None:
        seen.append(args[2])

    engines = (store.engine, autocommit_engine(store.engine))  # reads run on the second
    for engine in engines:
        event.listen(engine, "before_cursor_execute", capture)
    try:
        fn()
    finally:
        for engine in engines:
            event.remove(engine, "before_cursor_execute", capture)
    return len(seen)


def import_file(target: SessionDB, data: bytes) -> None:
    records = read_records(io.BytesIO(data), lambda _size: None)
    import_sessions(target, records, batch_size=500, max_batch_messages=10_000)


def corpus_file(messages: int) -> bytes:
    """The corpus as an export file (records as ``iter_export`` writes them), made directly
    from its plans: building it through the store's API takes minutes on a loaded machine."""
    handle = io.StringIO()
    clock = 1_767_000_000.0
    records = []
    for plan in Corpus(messages).iter_plans():
        clock += 60.0
        rows = []
        for index, message in enumerate(plan.messages):
            row = {**message, "session_id": plan.session_id, "timestamp": clock + index}
            if "tool_calls" in row:
                row["tool_calls"] = row["tool_calls"]  # a list: the import encodes it
            rows.append(row)
        records.append(
            {
                "id": plan.session_id,
                "source": plan.source,
                "model": plan.model,
                "parent_session_id": plan.parent_id,
                "started_at": clock,
                "ended_at": clock + 50.0 if plan.end_reason else None,
                "end_reason": plan.end_reason,
                "message_count": len(rows),
                "input_tokens": plan.tokens[0],
                "output_tokens": plan.tokens[1],
                "title": plan.title,
                "messages": rows,
            }
        )
    consume(write_export(handle, reversed(records)))  # newest first, as exported
    return handle.getvalue().encode()


def import_rows(base: str, data: bytes, work: Path, rounds: int) -> tuple[list[str], str, Path]:
    """Interleaved imports; the table rows, the URL of the PostgreSQL copy and the SQLite one."""
    targets: dict[str, SessionDB] = {}
    counter = iter(range(10_000))

    def fresh(name: str) -> SessionDB:
        old = targets.pop(name, None)
        if old is not None:
            old.close()
        if name == "sqlite":
            targets[name] = SessionDB(work / f"import-{next(counter)}.db")
        else:
            url = fresh_pg_database(base, f"{PREFIX}_{name}")
            migrate.upgrade(url)
            targets[name] = SessionDB(url.render_as_string(hide_password=False))
        return targets[name]

    samples: dict[str, list[float]] = {"copy": [], "insert": [], "sqlite": []}
    for round_index in range(rounds):
        names = list(samples)
        names = names[round_index % 3 :] + names[: round_index % 3]
        for name in names:
            target = fresh(name)  # not timed: an empty database at head
            start = time.perf_counter()
            if name == "insert":
                with mock.patch.object(pgstream, "supported", return_value=False):
                    import_file(target, data)
            else:
                import_file(target, data)
            samples[name].append(time.perf_counter() - start)
            print(f"import {name}: {samples[name][-1]:.1f} s", flush=True)
    floor_path = Path(str(targets["sqlite"].engine.url.database))
    for db in targets.values():
        db.close()
    drop_pg_database(base, f"{PREFIX}_insert")
    stats = {name: Stats.of(values, len(values)) for name, values in samples.items()}
    floor = stats["sqlite"].median
    rows = [
        f"| import (COPY), PostgreSQL | {spread(stats['copy'])} | "
        f"{stats['copy'].median / floor:.2f}x |",
        f"| import (INSERT batches, before), PostgreSQL | {spread(stats['insert'])} | "
        f"{stats['insert'].median / floor:.2f}x |",
        f"| import, SQLite (ours) | {spread(stats['sqlite'])} | 1.00x |",
    ]
    url = (
        sa.engine.make_url(base)
        .set(drivername="postgresql+psycopg", database=f"{PREFIX}_copy")
        .render_as_string(hide_password=False)
    )
    return rows, url, floor_path


def export_rows(store: SessionDB, floor_path: Path, rounds: int) -> list[str]:
    floor = Floor(floor_path)

    def paged() -> int:
        with store.transaction():  # inside a unit: the generic paged path
            return consume(store.iter_export())

    try:
        stats = interleaved(
            {
                "streamed": lambda: consume(store.iter_export()),
                "paged": paged,
                "floor": lambda: consume(floor.iter_export()),
            },
            rounds=rounds,
            warmup=1,
        )
    finally:
        floor.close()
    base = stats["floor"].median
    return [
        f"| export, PostgreSQL (server-side cursors) | {spread(stats['streamed'])} | "
        f"{stats['streamed'].median / base:.2f}x |",
        f"| export, PostgreSQL (paged, before) | {spread(stats['paged'])} | "
        f"{stats['paged'].median / base:.2f}x |",
        f"| export, SQLite floor (original store) | {spread(stats['floor'])} | 1.00x |",
    ]


def search_rows(store: SessionDB, size: str, rounds: int) -> list[str]:
    lines = []
    for label, query, options in SEARCHES:
        hits = len(store.search_messages(query, **options))
        search = functools.partial(store.search_messages, query, **options)
        sent = statements(store, search)
        stats = interleaved(
            {"ours": search},
            rounds=rounds,
            inner=5,
            warmup=2,
        )
        lines.append(
            f"| {size} | search: {label} `{query}` | {spread(stats['ours'])} | {sent} | {hits} |"
        )
        print(lines[-1], flush=True)
    sent = statements(store, store.list_sessions_rich)
    stats = interleaved({"ours": store.list_sessions_rich}, rounds=rounds, inner=5, warmup=2)
    lines.append(
        f"| {size} | list_sessions_rich() first page | {spread(stats['ours'])} | {sent} | 20 |"
    )
    print(lines[-1], flush=True)
    return lines


#: The 1M database, built on the server: sessions of 20 messages, 2,000 words drawn by a hash
#: of (message, position), RARE_WORD planted in 12 messages, COMMON_WORD in about a quarter.
_GENERATE = """
INSERT INTO sessions (id, source, started_at, message_count)
SELECT 'g' || lpad(i::text, 7, '0'), (ARRAY['cli', 'telegram', 'discord'])[1 + i % 3],
       1767000000 + i * 60.0, 20
FROM generate_series(0, :sessions - 1) AS i;
INSERT INTO messages (session_id, role, content, timestamp)
SELECT 'g' || lpad((j / 20)::text, 7, '0'), (ARRAY['user', 'assistant', 'tool'])[1 + j % 3],
       (SELECT string_agg('w' || ((j::bigint * 7919 + k * 104729) % 2000)::text, ' ')
          FROM generate_series(1, 8 + j % 40) AS k)
       || CASE WHEN j % 4 = 0 THEN ' ' || :common ELSE '' END
       || CASE WHEN j % (:messages / 12) = 7 THEN ' ' || :rare ELSE '' END,
       1767000000 + (j / 20) * 60.0 + (j % 20)
FROM generate_series(0, :messages - 1) AS j;
"""


def build_million(base: str, messages: int) -> tuple[str, float]:
    url = fresh_pg_database(base, f"{PREFIX}_1m")
    migrate.upgrade(url)
    engine = sa.create_engine(url)
    start = time.perf_counter()
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql("DROP INDEX IF EXISTS ix_messages_content_fts")
            conn.exec_driver_sql("DROP INDEX IF EXISTS ix_messages_content_trgm")
            params = {
                "sessions": messages // 20,
                "messages": messages,
                "common": COMMON_WORD,
                "rare": RARE_WORD,
            }
            for statement in _GENERATE.strip().split(";\n"):
                conn.execute(sa.text(statement), params)
            from hermes_store.schema import ddl

            conn.exec_driver_sql(ddl.PG_FTS_CREATE)
            conn.exec_driver_sql(ddl.PG_TRGM_CREATE)
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("VACUUM ANALYZE messages")
            conn.exec_driver_sql("VACUUM ANALYZE sessions")
    finally:
        engine.dispose()
    return url.render_as_string(hide_password=False), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pg", default=os.environ.get("HERMES_STORE_TEST_PG_URL"))
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of export and import")
    parser.add_argument("--search-rounds", type=int, default=15)
    parser.add_argument("--million", action="store_true", help="also build and search 1M")
    parser.add_argument(
        "--reuse-pg", metavar="DATABASE", help="a database on the server holding the corpus"
    )
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    args = parser.parse_args()
    if not args.pg:
        parser.error("--pg URL (or HERMES_STORE_TEST_PG_URL) is required")
    started = time.perf_counter()
    size = f"{args.messages // 1000}k"
    body: list[str] = []
    with tempfile.TemporaryDirectory(prefix="pg-scale-") as folder:
        work = Path(folder)
        try:
            data = corpus_file(args.messages)
            print(f"corpus: {len(data) / 1e6:.0f} MB", flush=True)
            if args.reuse_pg:  # a database holding this corpus already: no import rounds
                imports: list[Any] = []
                url = (
                    sa.engine.make_url(args.pg)
                    .set(drivername="postgresql+psycopg", database=args.reuse_pg)
                    .render_as_string(hide_password=False)
                )
                floor_path = work / "floor.db"
                floor_db = SessionDB(floor_path)
                try:
                    import_file(floor_db, data)
                finally:
                    floor_db.close()
            else:
                imports, url, floor_path = import_rows(args.pg, data, work, args.rounds)
            store = SessionDB(url)
            try:
                with store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                    conn.exec_driver_sql("VACUUM ANALYZE")
                exports = export_rows(store, floor_path, args.rounds)
                searches = search_rows(store, size, args.search_rounds)
            finally:
                store.close()
            print("\n".join(exports), flush=True)
            if args.million:
                million_url, seconds = build_million(args.pg, 1_000_000)
                print(f"built 1M on the server in {seconds:.0f} s", flush=True)
                big = SessionDB(million_url)
                try:
                    searches += search_rows(big, "1M (generated)", args.search_rounds)[:4]
                finally:
                    big.close()
        finally:
            for suffix in ("copy", "insert", "1m"):
                drop_pg_database(args.pg, f"{PREFIX}_{suffix}")
    body = [
        f"Run: `python -m bench.pg_scale --pg {args.pg}{' --million' if args.million else ''}`"
        f" ({(time.perf_counter() - started) / 60:.1f} min; no proxy, server on this machine;"
        f" {args.rounds} interleaved rounds for export/import, {args.search_rounds} x 5 calls"
        " for searches; median [min..max]).",
        "",
        f"| {size} messages | per run | vs the SQLite floor |",
        "|---|---:|---:|",
        *exports,
        *imports,
        "",
        "| database | call | median [min..max] | statements | hits |",
        "|---|---|---:|---:|---:|",
        *searches,
    ]
    section = "\n".join([BEGIN, *body, END])
    if args.out == "-":
        print(section)
        return
    out = Path(args.out)
    text = out.read_text(encoding="utf-8")
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + section + text[text.index(END) + len(END) :]
    else:
        text = text.rstrip("\n") + "\n\n## PostgreSQL at scale: search, export, import\n\n"
        text += section + "\n"
    out.write_text(text, encoding="utf-8")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
