"""Search at scale: the 1M-message rows of the search issue, in one short run.

    .venv/bin/python -m bench.search_scale --db ~/bench-cache/bench-1m.db [--pg URL]

``--db`` is a database built by ``bench.run`` (or ``bench/build.py``) at the wanted size; it is
reused, never rebuilt, so build it once (about 5 minutes for 1M messages on 2 cores) and keep
it outside the checkout. Times, interleaved with the original store (the floor) on the same
file: search for a common word, a rare word, a phrase, CJK words (3 and 2 characters); the CJK
index's share of the file; append CPU on non-CJK text with and without the index; a search
over a 50 MB message repeating the word (SQLite and, with ``--pg``, PostgreSQL); and how far
ranking among the newest matches agrees with BM25 over all of them. Rewrites the section
between the markers in docs/benchmarks.md (``--out -`` prints it instead).
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.build import drop_pg_database, fresh_pg_database
from bench.corpus import CJK_QUERY, COMMON_WORD, PHRASE, RARE_WORD
from bench.floor import SeedSessionDB
from bench.timing import interleaved
from hermes_store import SessionDB
from hermes_store.schema import ddl
from hermes_store.search import hits

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- search-scale:begin -->", "<!-- search-scale:end -->"
SEARCHES = (
    ("common word", COMMON_WORD),
    ("rare word", RARE_WORD),
    ("phrase", PHRASE),
    ("CJK", CJK_QUERY),
    ("CJK, 2 characters", "连接"),
)
NON_CJK = "Can you check why the deploy server keeps timing out? " * 3


def fmt(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.0f} µs"


def search_rows(path: Path, rounds: int) -> list[str]:
    store, seed = SessionDB(path), SeedSessionDB(path)
    lines = [
        "| search | ours | original store | speed-up | hits (ours / original) |",
        "|---|---:|---:|---:|---|",
    ]
    try:
        for name, query in SEARCHES:
            hits, seed_hits = len(store.search_messages(query)), len(seed.search_messages(query))
            slow = name.startswith("CJK")  # the original store scans every message
            stats = interleaved(
                {
                    "ours": lambda q=query: store.search_messages(q),
                    "seed": lambda q=query: seed.search_messages(q),
                },
                rounds=3 if slow else rounds,
                warmup=1,
            )
            ours, floor = stats["ours"].median, stats["seed"].median
            lines.append(
                f"| {name} `{query}` | {fmt(ours)} | {fmt(floor)} | {floor / ours:.0f}x "
                f"| {hits} / {seed_hits} |"
            )
            print(lines[-1], flush=True)
        for sort in ("newest", "oldest"):
            stats = interleaved(
                {"ours": lambda s=sort: store.search_messages(COMMON_WORD, sort=s)},
                rounds=rounds,
            )
            lines.append(
                f"| common word, sort={sort} | {fmt(stats['ours'].median)} | - | - | 20 / - |"
            )
            print(lines[-1], flush=True)
    finally:
        seed.close()
        store.close()
    return lines


def rank_agreement(path: Path) -> list[str]:
    """Our top 20 for the common word against BM25 over every match (FTS5 ORDER BY rank)."""
    store = SessionDB(path)
    try:
        ours = [row["id"] for row in store.search_messages(COMMON_WORD, limit=20)]
    finally:
        store.close()
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        matches = con.execute(
            "SELECT count(*) FROM messages_fts WHERE messages_fts MATCH ?", (COMMON_WORD,)
        ).fetchone()[0]
        start = time.perf_counter()
        full = con.execute(
            "SELECT rowid, rank FROM messages_fts WHERE messages_fts MATCH ?"
            " ORDER BY rank LIMIT 20",
            (COMMON_WORD,),
        ).fetchall()
        full_seconds = time.perf_counter() - start
        scores = dict(
            con.execute(
                "SELECT rowid, rank FROM messages_fts WHERE messages_fts MATCH ? AND rowid IN "
                f"({','.join('?' * len(ours))})",
                (COMMON_WORD, *ours),
            ).fetchall()
        )
    finally:
        con.close()
    full_ids = [rowid for rowid, _ in full]
    overlap = len(set(full_ids) & set(ours))
    ours_scores = sorted(scores[i] for i in ours)
    full_scores = [score for _, score in full]
    return [
        f"- Ranking `{COMMON_WORD}` ({matches:,} matches): ours scores the newest "
        f"{hits.RANK_WINDOW:,} matches by BM25 (FTS5's own scores, global statistics). "
        f"Top 20 shared with BM25 over every match: {overlap}/20 ids; BM25 of our 1st / 20th "
        f"result {ours_scores[0]:.3f} / {ours_scores[-1]:.3f} against {full_scores[0]:.3f} / "
        f"{full_scores[-1]:.3f} for the full ranking (lower is better), which took "
        f"{fmt(full_seconds)} here."
    ]


def index_share(path: Path) -> list[str]:
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        page = con.execute("PRAGMA page_size").fetchone()[0]
        pages = con.execute("PRAGMA page_count").fetchone()[0]
        data = con.execute(f"SELECT sum(length(block)) FROM {ddl.CJK_TABLE}_data").fetchone()[0]
        docs = con.execute(f"SELECT count(*), sum(length(sz)) FROM {ddl.CJK_DOCSIZE}").fetchone()
        idx = con.execute(f"SELECT count(*) FROM {ddl.CJK_TABLE}_idx").fetchone()[0]
        total = con.execute("SELECT count(*) FROM messages").fetchone()[0]
    finally:
        con.close()
    size = page * pages
    index = (data or 0) + (docs[1] or 0) + 8 * docs[0] + 16 * idx
    return [
        f"- CJK index: {docs[0]:,} of {total:,} messages indexed, about {index / 2**20:.1f} MiB "
        f"of index records in a {size / 2**20:,.0f} MiB file ({100 * index / size:.1f}%)."
    ]


def append_overhead(work: Path, rounds: int) -> list[str]:
    """CPU per append_message of non-CJK text, with the CJK index (head) and without (v6)."""
    stores = {}
    for name in ("with", "without"):
        path = work / f"append-{name}.db"
        if name == "without":  # the same schema minus the CJK index and its triggers
            SessionDB(path).close()
            with sqlite3.connect(path) as con:
                for statement in ddl.SQLITE_CJK_DROP:
                    con.execute(statement)
            con.close()
        store = SessionDB(path)
        store.create_session("s", "cli")
        stores[name] = store
    samples: dict[str, list[float]] = {name: [] for name in stores}
    try:
        for round_index in range(rounds):
            order = list(stores) if round_index % 2 else list(reversed(stores))
            for name in order:
                store = stores[name]
                start = time.process_time()
                for _ in range(50):
                    store.append_message("s", "user", NON_CJK)
                samples[name].append((time.process_time() - start) / 50)
    finally:
        for store in stores.values():
            store.close()
    with_cjk = statistics.median(samples["with"])
    without = statistics.median(samples["without"])
    return [
        f"- append_message CPU on non-CJK text: {fmt(with_cjk)} with the CJK index, "
        f"{fmt(without)} without ({100 * (with_cjk / without - 1):+.0f}%; median of {rounds} "
        "rounds of 50, process CPU time)."
    ]


def big_message(work: Path, pg: str | None) -> list[str]:
    """search_messages for a word repeated throughout one 50 MB message (plus a short one)."""
    text = "error: disk full at sector 42\n" * (50 * 2**20 // 30)
    lines = []
    targets: list[tuple[str, str]] = [("SQLite", str(work / "big.db"))]
    name = f"hermes_bench_big_{os.getpid()}"
    if pg:
        targets.append(("PostgreSQL", fresh_pg_database(pg, name).render_as_string(False)))
    try:
        for label, target in targets:
            store = SessionDB(target, max_message_bytes=2 * len(text))  # above the default cap
            try:
                store.create_session("s", "cli")
                store.append_message("s", "tool", text)
                store.append_message("s", "user", "one error here")
                times = []
                for _ in range(3):
                    start = time.perf_counter()
                    rows = store.search_messages("error")
                    times.append(time.perf_counter() - start)
                lines.append(
                    f"- {label}: searching `error` over a {len(text) / 2**20:.0f} MB message "
                    f"repeating it took {fmt(statistics.median(times))} (median of 3; "
                    f"{len(rows)} hits, snippet {len(rows[0]['snippet'])} characters)."
                )
                print(lines[-1], flush=True)
            finally:
                store.close()
    finally:
        if pg:
            drop_pg_database(pg, name)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", required=True, help="a built benchmark database (reused)")
    parser.add_argument("--pg", metavar="URL", help="also time the 50 MB message on PostgreSQL")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    args = parser.parse_args(argv)
    path = Path(args.db)
    if not path.exists():
        parser.error(
            f"{path} does not exist: build it first (bench.run --workdir, or bench/build.py)"
        )
    SessionDB(path).close()  # bring it to head (adds the CJK index to an older build once)
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as con:
        messages = con.execute("SELECT count(*) FROM messages").fetchone()[0]
    work = Path(tempfile.mkdtemp(prefix="hermes-scale-"))
    started = time.perf_counter()
    body = [f"## Search at scale ({messages:,} messages)", ""]
    body += [*search_rows(path, args.rounds), ""]
    body += rank_agreement(path)
    body += index_share(path)
    body += append_overhead(work, rounds=9)
    body += big_message(work, args.pg)
    shown = " ".join(a for a in (argv if argv is not None else sys.argv[1:]))
    body += [
        "",
        f"Run: `python -m bench.search_scale {shown}` ({(time.perf_counter() - started) / 60:.1f}"
        " min, on the machine above, shared with other jobs: figures are medians and noisy).",
    ]
    section = "\n".join([BEGIN, *body, END])
    if args.out == "-":
        print(section)
        return 0
    out = Path(args.out)
    text = out.read_text(encoding="utf-8")
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + section + text[text.index(END) + len(END) :]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    out.write_text(text, encoding="utf-8")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
