"""Import speed: a realistic export restored into a new database, in messages per second.

    .venv/bin/python -m bench.import_speed [--messages 100000] [--runs 3] [--backend sqlite]

The export is what an agent's ``state.db`` holds (built once per size and seed, cached under
the temp folder): sessions with a system prompt of a few KB, chat turns (user 20-400
characters, assistant 50-1,500, some with reasoning), assistant turns that call a tool followed
by the tool's output of 5-50 KB (log lines, paths, numbers), 5% of all messages carrying
Chinese text, titles, parents, counters and costs with every digit. Each run imports it into a
new database (a new SQLite file, or an emptied PostgreSQL database) with ``hermes-store
import`` (into a new SQLite file: ``transfer.import_new_file``, built privately and linked in
place), in a fresh process, and is checked: the database then exports the same bytes, and the
full-text index passes FTS5's integrity check. Printed: per run the wall time, the CPU time of
the process, messages/s on the wall clock and on CPU; then the median [min..max] of the runs
(``--before DIR`` runs another checkout in the same, interleaved rounds; ``--existing`` the
import into an existing empty file, through the store; ``--mix scale`` uses
``bench/scale.py``'s 2 GB mix instead: 1,020,000 messages make its 2 GB file).

``--ceiling`` adds, in the same rounds, what bare ``sqlite3`` does with the same messages (read
from the file before the clock starts, inserted in id order in one transaction, FTS5 with its
default settings): ``raw rows`` (the messages table only), ``raw fts`` (the full-text table
only) and ``raw rows+fts`` (both: what no import of this schema can beat on one core).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

_VOCABULARY = (
    "the a to of and in is it that for on with this be as you are we can not was but file "
    "error code run test build config function value line return data user request output "
    "change update fix check need should will use model call token session message tool "
    "result python install version path import module class method list string type null "
    "deploy service cache query index table database log debug issue branch commit merge "
    "review script shell command network timeout retry lock thread process memory disk agent "
    "prompt context reply stream chunk image upload parse json yaml schema field"
)
_WORDS = _VOCABULARY.split()
_CJK = (
    "我们需要检查一下",
    "连接超时了",
    "请帮我看看这个错误",
    "服务器重启之后",
    "日志里面显示",
    "配置文件有问题",
    "这个函数返回空值",
    "部署到生产环境",
    "测试全部通过了",
    "缓存没有刷新",
    "数据库连接失败",
)
_LEVELS = ("INFO", "DEBUG", "WARN", "ERROR")


class _Writer:
    """Draws the texts of one export, deterministically from ``seed``."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        rng = self.rng
        self.lines = [
            f"{rng.choice(_LEVELS)} /srv/app/{rng.choice(_WORDS)}/{rng.choice(_WORDS)}.py:"
            f"{rng.randint(1, 999)} " + " ".join(rng.choices(_WORDS, k=rng.randint(4, 12)))
            for _ in range(3000)
        ]
        self.prompt = " ".join(rng.choices(_WORDS, k=600))

    def chat(self, low: int, high: int, cjk: bool) -> str:
        rng = self.rng
        size = rng.randint(low, high)
        if cjk:
            text = "，".join(rng.choice(_CJK) for _ in range(max(1, size // 24))) + "。"
            return text + " " + " ".join(rng.choices(_WORDS, k=3))
        words: list[str] = []
        length = 0
        while length < size:
            word = rng.choice(_WORDS)
            words.append(word)
            length += len(word) + 1
        return " ".join(words).capitalize() + "."

    def tool_output(self, cjk: bool) -> str:
        rng = self.rng
        size = rng.randint(5_000, 50_000)
        out: list[str] = []
        length = 0
        while length < size:
            line = f"{rng.choice(self.lines)} id={rng.getrandbits(32):08x} t={rng.random():.6f}"
            if cjk and rng.random() < 0.2:
                line += " " + rng.choice(_CJK)
            out.append(line)
            length += len(line) + 1
        return "\n".join(out)


def _next_role(previous: dict[str, Any] | None) -> str:
    """user -> assistant; an assistant's tool call -> the tool's output -> assistant again."""
    if previous is None:
        return "user"
    if previous["role"] == "assistant":
        return "tool" if previous["tool_calls"] else "user"
    return "assistant"


def export_lines(
    messages: int, seed: int = 31, tool_calls_per_turn: float = 0.4
) -> Iterator[dict[str, Any]]:
    """Export records (as ``SessionDB.export_session`` writes them) holding ``messages``; an
    assistant turn calls a tool (whose output follows) with ``tool_calls_per_turn``."""
    w = _Writer(seed)
    rng = w.rng
    made = 0
    index = 0
    ids: list[str] = []
    clock = 1_760_000_000.0
    next_id = 1
    while made < messages:
        sid = f"2026{index:07d}_{rng.getrandbits(32):08x}"
        started = clock + rng.random()
        clock += rng.uniform(30, 3600)
        count = min(messages - made, rng.randint(6, 60))
        rows: list[dict[str, Any]] = []
        at = started
        tool_calls = 0
        while len(rows) < count:
            at += rng.uniform(0.5, 40)
            cjk = rng.random() < 0.05
            role = _next_role(rows[-1] if rows else None)
            row: dict[str, Any] = {
                "id": next_id,
                "session_id": sid,
                "role": role,
                "content": None,
                "tool_call_id": None,
                "tool_calls": None,
                "tool_name": None,
                "timestamp": at,
                "token_count": None,
                "finish_reason": None,
                "reasoning": None,
                "reasoning_details": None,
                "codex_reasoning_items": None,
            }
            if role == "user":
                row["content"] = w.chat(20, 400, cjk)
            elif role == "assistant":
                row["content"] = w.chat(50, 1500, cjk)
                row["token_count"] = rng.randint(20, 900)
                row["finish_reason"] = "stop"
                if rng.random() < 0.3:
                    row["reasoning"] = w.chat(100, 800, False)
                if rng.random() < tool_calls_per_turn and len(rows) + 1 < count:
                    call = f"call_{rng.getrandbits(48):012x}"
                    row["tool_calls"] = [
                        {
                            "id": call,
                            "type": "function",
                            "function": {"name": "terminal", "arguments": '{"command": "ls"}'},
                        }
                    ]
                    row["finish_reason"] = "tool_calls"
                    tool_calls += 1
            else:
                previous = rows[-1]["tool_calls"][0]
                row["content"] = w.tool_output(cjk)
                row["tool_call_id"] = previous["id"]
                row["tool_name"] = "terminal"
            rows.append(row)
            next_id += 1
        made += len(rows)
        cost = round(rng.uniform(0, 2), 6) + rng.random() * 1e-9
        record: dict[str, Any] = {
            "id": sid,
            "source": rng.choice(("cli", "telegram", "discord")),
            "user_id": None,
            "model": rng.choice(("claude-sonnet-4", "gpt-5", "qwen3-coder")),
            "model_config": json.dumps({"temperature": 0.7, "max_tokens": 4096}),
            "system_prompt": w.prompt,
            "parent_session_id": (
                ids[rng.randrange(len(ids))] if ids and rng.random() < 0.1 else None
            ),
            "started_at": started,
            "ended_at": at + 1.25,
            "end_reason": rng.choice(("user_exit", "timeout", "compression")),
            "message_count": len(rows),
            "tool_call_count": tool_calls,
            "input_tokens": rng.randint(1_000, 2_000_000),
            "output_tokens": rng.randint(100, 200_000),
            "cache_read_tokens": rng.randint(0, 1_000_000),
            "cache_write_tokens": rng.randint(0, 100_000),
            "reasoning_tokens": rng.randint(0, 50_000),
            "billing_provider": "openrouter",
            "billing_base_url": "https://openrouter.ai/api/v1",
            "billing_mode": "official_docs_snapshot",
            "estimated_cost_usd": cost,
            "actual_cost_usd": cost * 0.97,
            "cost_status": "estimated",
            "cost_source": "official_docs_snapshot",
            "pricing_version": "2026-01",
            "title": (
                f"{rng.choice(_WORDS)} {rng.choice(_WORDS)} {index}" if rng.random() < 0.3 else None
            ),
            "messages": rows,
        }
        ids.append(sid)
        index += 1
        yield record


def build_export(path: Path, messages: int, seed: int, tool_calls_per_turn: float = 0.4) -> None:
    """Write the export file (newest session first, as ``export`` writes it)."""
    _write_newest_first(path, list(export_lines(messages, seed, tool_calls_per_turn)))


def _write_newest_first(path: Path, records: list[dict[str, Any]]) -> None:
    """The records as an export file, newest session first (as ``export`` writes them)."""
    partial = path.with_suffix(".partial")
    with open(partial, "w", encoding="utf-8") as handle:
        for record in reversed(records):
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    partial.replace(path)


def build_scale_export(path: Path, messages: int) -> None:
    """The export of ``bench/scale.py``'s realistic file at ``messages`` (2 GB per 1,020,000:
    sessions of ~51 messages over 12 months, 5-50 KB tool outputs, 5% CJK)."""
    from bench import scale

    size_mb = max(1, round(messages * SCALE_MB_PER_MESSAGE))
    sessions = max(1, messages // 51)
    share = scale.tool_share(size_mb, messages)
    _write_newest_first(path, list(scale.export_lines(sessions, messages, share, time.time())))


#: ``bench/scale.py``'s file: 2,048 MB for 1,020,000 messages.
SCALE_MB_PER_MESSAGE = 2048 / 1_020_000


def cached_export(messages: int, seed: int, tool_calls_per_turn: float, mix: str = "agent") -> Path:
    """The export file for these parameters, built once under the temp folder."""
    folder = Path(tempfile.gettempdir()) / "hermes-import-bench"
    folder.mkdir(exist_ok=True)
    name = f"{mix}-{messages}" if mix == "scale" else f"{messages}-{seed}-{tool_calls_per_turn:g}"
    path = folder / f"export-{name}.jsonl"
    if not path.exists():
        started = time.perf_counter()
        if mix == "scale":
            build_scale_export(path, messages)
        else:
            build_export(path, messages, seed, tool_calls_per_turn)
        print(f"(built {path.name}: {time.perf_counter() - started:.0f} s)", file=sys.stderr)
    return path


def fresh_target(backend: str, folder: Path, run: int) -> str:
    """A new database: a SQLite file that does not exist yet, or an emptied PostgreSQL one."""
    if backend == "sqlite":
        return str(folder / f"run-{run}.db")
    import sqlalchemy as sa

    base = sa.make_url(os.environ["HERMES_STORE_TEST_PG_URL"])
    admin = sa.create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql('DROP DATABASE IF EXISTS "hermes_import_bench" WITH (FORCE)')
        conn.exec_driver_sql('CREATE DATABASE "hermes_import_bench"')
    admin.dispose()
    return base.set(database="hermes_import_bench").render_as_string(hide_password=False)


def import_once(target: str, export: Path, pythonpath: Path) -> tuple[float, float]:
    """``hermes-store --db TARGET import EXPORT`` in a fresh process: its wall and CPU seconds
    (user + system, from ``wait4``)."""
    env = {**os.environ, "PYTHONPATH": str(pythonpath), "HERMES_HOME": str(export.parent)}
    env.pop("HERMES_STORE_URL", None)
    argv = [sys.executable, "-m", "hermes_store", "--db", target, "import", str(export), "--json"]
    started = time.perf_counter()
    child = subprocess.Popen(
        argv, env=env, cwd=export.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert child.stdout is not None and child.stderr is not None
    out, err = child.stdout.read(), child.stderr.read()
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"the import failed:\n{err.decode()}")
    json.loads(out)
    return wall, usage.ru_utime + usage.ru_stime


def check_exact(target: str, export: Path) -> None:
    """The database exports what the file holds, value for value (floats bit for bit), and its
    full-text indexes are sound."""
    from hermes_store import SessionDB

    with SessionDB(target) as store, open(export, "rb") as handle:
        exported = {record["id"]: record for record in store.iter_export()}
        for line in handle:
            record = json.loads(line)
            got = exported.pop(record["id"])
            for key, value in record.items():
                if got[key] != value:  # type: ignore[literal-required]
                    raise SystemExit(f"{record['id']}: {key} differs after the import")
        if exported:
            raise SystemExit(f"{len(exported)} sessions the file does not hold")
        if not store.check_search_index():
            raise SystemExit("the full-text index failed its check after the import")


RAW_SIDES = ("raw rows", "raw fts", "raw rows+fts")
#: The import as a restore runs it: into a file that does not exist yet.
NEW_FILE = "hermes_store, into a new file"
#: What an import into a new SQLite file should reach on the 2-core machine (messages/s).
TARGET_RATE = 20_000
#: The side importing into a database that exists (empty, at head): the import through the
#: store (WAL, FULL), as every import ran before a new file was built privately.
EXISTING = "hermes_store, into an existing file"


def _create_empty(target: str, pythonpath: Path) -> None:
    """An empty database at head at ``target``, made by a process of that checkout."""
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    env.pop("HERMES_STORE_URL", None)
    argv = [sys.executable, "-P", "-m", "hermes_store", "--db", target, "db", "upgrade"]
    subprocess.run(argv, env=env, check=True, capture_output=True)


_RAW_SCHEMA = (
    "CREATE TABLE messages (id INTEGER PRIMARY KEY, content TEXT)",
    "CREATE VIRTUAL TABLE messages_fts USING fts5(content, content=messages, content_rowid=id)",
)


def raw_insert(export: Path, target: Path, what: str) -> None:
    """(child process) Insert the export's messages with bare ``sqlite3``, WAL and
    ``synchronous=FULL`` as the store writes; print the insert's wall and CPU seconds."""
    import sqlite3

    with open(export, "rb") as handle:
        rows = sorted(
            (message["id"], message["content"])
            for line in handle
            for message in json.loads(line)["messages"]
        )
    conn = sqlite3.connect(target, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    for statement in _RAW_SCHEMA:
        conn.execute(statement)
    started, cpu = time.perf_counter(), time.process_time()
    conn.execute("BEGIN")
    if "rows" in what:
        conn.executemany("INSERT INTO messages (id, content) VALUES (?, ?)", rows)
    if "fts" in what:
        conn.executemany("INSERT INTO messages_fts (rowid, content) VALUES (?, ?)", rows)
    conn.execute("COMMIT")
    conn.close()
    print(json.dumps([time.perf_counter() - started, time.process_time() - cpu]))


def raw_once(target: str, export: Path, what: str) -> tuple[float, float]:
    """:func:`raw_insert` in a fresh process: its wall and CPU seconds."""
    argv = [sys.executable, "-m", "bench.import_speed", "--raw", what, str(export), target]
    out = subprocess.run(argv, cwd=ROOT, check=True, capture_output=True, text=True).stdout
    wall, cpu = json.loads(out)
    return float(wall), float(cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=3, help="interleaved rounds (>= 3)")
    parser.add_argument("--backend", choices=("sqlite", "postgresql"), default="sqlite")
    parser.add_argument(
        "--tool-calls", type=float, default=0.4, help="share of assistant turns calling a tool"
    )
    parser.add_argument("--seed", type=int, default=31)
    parser.add_argument("--before", type=Path, help="another checkout, in the same rounds")
    parser.add_argument(
        "--ceiling", action="store_true", help="bare sqlite3 on the same messages, same rounds"
    )
    parser.add_argument(
        "--mix",
        choices=("agent", "scale"),
        default="agent",
        help="agent: this module's export (heavy tool outputs); scale: bench/scale.py's 2 GB mix",
    )
    parser.add_argument(
        "--existing",
        action="store_true",
        help="also into an existing empty database (the import through the store, WAL+FULL)",
    )
    parser.add_argument("--raw", nargs=3, metavar=("WHAT", "EXPORT", "DB"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.raw:
        raw_insert(Path(args.raw[1]), Path(args.raw[2]), args.raw[0])
        return
    export = cached_export(args.messages, args.seed, args.tool_calls, args.mix)
    sides = {NEW_FILE: ROOT}
    if args.existing and args.backend == "sqlite":
        sides[EXISTING] = ROOT
    if args.before is not None:
        sides["before"] = args.before.resolve()
    if args.ceiling and args.backend == "sqlite":
        sides.update({side: ROOT for side in RAW_SIDES})
    megabytes = export.stat().st_size / 1e6
    load_before = os.getloadavg()[0]
    samples: dict[str, list[tuple[float, float]]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory(prefix="import-bench-") as scratch:
        names = list(sides)
        for run in range(max(3, args.runs)):
            for side in names[run % len(names) :] + names[: run % len(names)]:
                target = fresh_target(args.backend, Path(scratch), run)
                if side in RAW_SIDES:
                    wall, cpu = raw_once(target, export, side.split()[1])
                else:
                    if side == EXISTING:
                        _create_empty(target, sides[side])
                    wall, cpu = import_once(target, export, sides[side])
                    check_exact(target, export)
                samples[side].append((wall, cpu))
                print(
                    f"run {run + 1} {side}: {wall:.1f} s wall, {cpu:.1f} s CPU, "
                    f"{args.messages / wall:,.0f} messages/s ({args.messages / cpu:,.0f} per "
                    f"CPU second), load {os.getloadavg()[0]:.1f}",
                    file=sys.stderr,
                )
                if args.backend == "sqlite":
                    for suffix in ("", "-wal", "-shm", "-writer.lock"):
                        Path(f"{target}{suffix}").unlink(missing_ok=True)
    mix = (
        "`bench/scale.py`'s 2 GB mix"
        if args.mix == "scale"
        else f"an assistant turn calls a tool {args.tool_calls:.0%} of the time"
    )
    print(
        f"Import of {args.messages:,} messages ({megabytes:,.0f} MB of JSON Lines; {mix}) into "
        f"a new {args.backend} database with `hermes-store import` (`{EXISTING}`: into an "
        f"empty database made first with `db upgrade`), each checked exact (the database "
        f"exports the file's values, the full-text indexes pass FTS5's integrity check), "
        f"fresh process per run, {max(3, args.runs)} "
        f"interleaved rounds, median [min..max]; load average {load_before:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end:\n"
    )
    print("| side | messages/s (wall) | messages/s per CPU second | MB/s (wall) |")
    print("| --- | --- | --- | --- |")
    for side, runs in samples.items():
        rate = [args.messages / wall for wall, _ in runs]
        per_cpu = [args.messages / cpu for _, cpu in runs]
        mbs = [megabytes / wall for wall, _ in runs]
        print(f"| {side} | {_spread(rate)} | {_spread(per_cpu)} | {_spread(mbs, '.1f')} |")
    if args.backend == "sqlite":
        rate = statistics.median(args.messages / wall for wall, _ in samples[NEW_FILE])
        met = "met" if rate >= TARGET_RATE else "NOT met"
        print(
            f"\nInto a new file: {rate:,.0f} messages/s (median): the {TARGET_RATE:,} "
            f"messages/s target {met}."
        )


def _spread(values: list[float], spec: str = ",.0f") -> str:
    return f"{statistics.median(values):{spec}} [{min(values):{spec}}..{max(values):{spec}}]"


if __name__ == "__main__":
    main()
