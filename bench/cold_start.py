"""A fresh process, from its start to its first answer: hermes_store against the original store.

    .venv/bin/python -m bench.cold_start [--rounds 7] [--sessions 500] [--before DIR] [--db PATH]

An agent starts a process per command, so what it pays first is the interpreter, the imports
and the open: here each sample is one new process that opens a ``state.db`` at head and asks
``get_session`` once (or runs ``sessions list`` on the CLI), measured from the outside with
``os.wait4``: wall time, CPU (user + system) and peak memory (max RSS). A second run of the same
command under ``python -X importtime`` gives the time its imports took (the sum of the
top-level imports). Rounds are interleaved (each round runs every contender once, in a rotated
order), and each figure is the median [min..max] over the rounds. Every contender runs with its
bytecode cached, as an installed package has it.

Contenders: ``python -c pass`` (the interpreter), ``sqlalchemy`` (its import, a SQLite engine
and one SELECT by primary key: the least a SQLAlchemy store can pay), the original store
(``tests/support/seed_store.py``: stdlib ``sqlite3``) and hermes_store; for the CLI,
``hermes-store sessions list`` against the original store's listing printed as lines.
``--before DIR`` adds another checkout's hermes_store (its ``PYTHONPATH``) in the same rounds.
``--db PATH`` measures on an existing file at head (e.g. :mod:`bench.scale`'s 2 GB one) instead
of a fresh small one: a copy of it, so the original store's open (which writes) never touches it.
The verdict compares hermes_store's open + first read with the SQLAlchemy floor: the target is
at most 0.15 s more, with no Alembic module loaded.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # ``python bench/cold_start.py``: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.timing import spread

ROOT = Path(__file__).resolve().parents[1]
SEED_STORE = ROOT / "tests" / "support" / "seed_store.py"
#: hermes_store's open + first read may cost this much more than the SQLAlchemy floor.
TARGET_OVER_FLOOR_S = 0.15

#: Loads the original store's module by its file (``tests`` is no package to import here).
LOAD_SEED = (
    "import importlib.util as u; s = u.spec_from_file_location('seed_store', {path!r}); "
    "m = u.module_from_spec(s); s.loader.exec_module(m); "
)


def programs(db: Path, session_id: str) -> dict[str, list[str]]:
    """Each contender's command line (argv for one fresh process, this checkout's path)."""
    py = sys.executable
    script = Path(py).with_name("hermes-store")
    cli = [str(script)] if script.exists() else [py, "-m", "hermes_store"]
    seed = LOAD_SEED.format(path=str(SEED_STORE))
    return {
        "python -c pass": [py, "-c", "pass"],
        "sqlalchemy: engine + one SELECT": [
            py,
            "-c",
            "import sqlalchemy as sa; "
            f"e = sa.create_engine({f'sqlite:///{db}'!r}); c = e.connect(); "
            "c.exec_driver_sql('SELECT * FROM sessions WHERE id = ?', "
            f"({session_id!r},)).first(); c.close()",
        ],
        "original store: open + get_session": [
            py,
            "-c",
            seed + f"db = m.SeedSessionDB({str(db)!r}); db.get_session({session_id!r}); db.close()",
        ],
        "hermes_store: open + get_session": [
            py,
            "-c",
            "from hermes_store import SessionDB; "
            f"db = SessionDB({str(db)!r}); db.get_session({session_id!r}); db.close()",
        ],
        "original store: sessions list": [
            py,
            "-c",
            seed + f"db = m.SeedSessionDB({str(db)!r}); "
            "print('\\n'.join(f\"{r['id']}  {r['title'] or ''}  {r['preview']}\" "
            "for r in db.list_sessions_rich(limit=20))); db.close()",
        ],
        "hermes-store sessions list": [*cli, "--db", str(db), "sessions", "list"],
    }


@dataclass
class Samples:
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    rss_mb: list[float] = field(default_factory=list)
    imports: list[float] = field(default_factory=list)


#: Starts one command and reports its wall time and rusage on the last line of stderr. A small
#: interpreter of its own (``-S -E``): a child's max RSS counts the memory of the process that
#: forked it, so forking from this (big) process would report this process's size.
LAUNCHER = """
import os, sys, time
start = time.perf_counter()
pid = os.fork()
if pid == 0:
    os.execv(sys.argv[1], sys.argv[1:])
_, status, usage = os.wait4(pid, 0)
wall = time.perf_counter() - start
cpu = usage.ru_utime + usage.ru_stime
code = os.waitstatus_to_exitcode(status)
sys.stderr.write(f"\\nlaunched {wall} {cpu} {usage.ru_maxrss} {code}\\n")
"""


def run_once(argv: list[str], env: dict[str, str]) -> tuple[float, float, float]:
    """Wall seconds, CPU seconds and max RSS (MB) of one fresh process (which must exit 0)."""
    done = subprocess.run(
        [sys.executable, "-S", "-E", "-c", LAUNCHER, *argv],
        env=env,
        cwd=env["HERMES_HOME"],  # not a checkout: `python -c` puts its folder first on the path
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        check=False,
    )
    *errors, last = done.stderr.rstrip("\n").split("\n")
    _, wall, cpu, rss_kb, code = last.split()
    if done.returncode != 0 or code != "0":
        raise SystemExit(f"{argv} failed ({code}):\n" + "\n".join(errors))
    return float(wall), float(cpu), int(rss_kb) / 1024


def import_seconds(argv: list[str], env: dict[str, str]) -> tuple[float, set[str]]:
    """The imports' total under ``-X importtime`` (top-level cumulative times), and the
    top-level packages imported."""
    if argv[0] != sys.executable:  # the console script: run its module the same way
        argv = [sys.executable, "-m", "hermes_store", *argv[1:]]
    done = subprocess.run(
        [argv[0], "-X", "importtime", *argv[1:]],
        env=env,
        cwd=env["HERMES_HOME"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        check=True,
    )
    total_us = 0
    packages: set[str] = set()
    for line in done.stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        _, cumulative, name = line.split("|")
        if not cumulative.strip().isdigit():
            continue  # the header
        if not name.startswith("  "):  # depth 0: its time includes everything below it
            total_us += int(cumulative)
        packages.add(name.strip().split(".")[0])
    return total_us / 1e6, packages


def process_env(folder: Path) -> dict[str, str]:
    """The contenders' environment: this checkout first on the path, ``folder`` as
    ``HERMES_HOME`` (and the working folder), bytecode cached as an installed package has it
    (the warm-up run writes it) in a folder of its own, so no checkout gets a __pycache__."""
    env = {
        **os.environ,
        "HERMES_HOME": str(folder),
        "PYTHONPATH": str(ROOT),
        "PYTHONPYCACHEPREFIX": str(folder / "pycache"),
    }
    for name in ("HERMES_STORE_URL", "PYTHONDONTWRITEBYTECODE"):
        env.pop(name, None)
    return env


def build(db: Path, sessions: int) -> str:
    """A state.db at head with ``sessions`` sessions of 10 messages; returns a session id."""
    from hermes_store import SessionDB

    store = SessionDB(db)
    try:
        for index in range(sessions):
            sid = f"session-{index:05d}"
            store.create_session(sid, source="cli", model="model-x")
            for turn in range(5):
                store.append_message(sid, "user", f"question {turn} of session {index}")
                store.append_message(sid, "assistant", f"answer {turn} " + "words " * 40)
            if index % 3 == 0:
                store.set_session_title(sid, f"title {index}")
    finally:
        store.close()
    return f"session-{sessions // 2:05d}"


def middle_session(db: Path) -> str:
    """The id of the session in the middle of the file's listing order."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        count = conn.execute("SELECT count(*) FROM sessions").fetchone()[0]
        row = conn.execute(
            "SELECT id FROM sessions ORDER BY started_at LIMIT 1 OFFSET ?", (count // 2,)
        ).fetchone()
    finally:
        conn.close()
    return str(row[0])


def _spread(values: list[float], scale: float = 1.0, unit: str = "") -> str:
    return spread(values, "{:.0f}", scale=scale, unit=unit)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (>= 3)")
    parser.add_argument("--sessions", type=int, default=500, help="sessions in the state.db")
    parser.add_argument(
        "--before", type=Path, help="another checkout of hermes_store, measured in the same rounds"
    )
    parser.add_argument("--db", type=Path, help="an existing state.db at head (copied first)")
    args = parser.parse_args()
    rounds = max(3, args.rounds)
    where = args.db.resolve().parent if args.db is not None else None
    with tempfile.TemporaryDirectory(prefix="cold-start-", dir=where) as folder:
        db = Path(folder) / "state.db"
        if args.db is not None:
            shutil.copyfile(args.db, db)
            session_id = middle_session(db)
        else:
            session_id = build(db, args.sessions)
        env = process_env(Path(folder))
        contenders = {name: (argv, env) for name, argv in programs(db, session_id).items()}
        if args.before is not None:
            before_env = {**env, "PYTHONPATH": str(args.before.resolve())}
            for name in ("hermes_store: open + get_session", "hermes-store sessions list"):
                contenders[f"{name} (before)"] = (contenders[name][0], before_env)
        names = list(contenders)
        for argv, environment in contenders.values():  # warm the page and bytecode caches
            run_once(argv, environment)
        samples = {name: Samples() for name in names}
        for round_index in range(rounds):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                argv, environment = contenders[name]
                wall, cpu, rss = run_once(argv, environment)
                seconds, _ = import_seconds(argv, environment)
                sample = samples[name]
                sample.wall.append(wall)
                sample.cpu.append(cpu)
                sample.rss_mb.append(rss)
                sample.imports.append(seconds)
        _, loaded = import_seconds(*contenders["hermes_store: open + get_session"])
    what = (
        f"a copy of {args.db} ({args.db.stat().st_size / 2**20:,.0f} MiB)"
        if args.db is not None
        else f"{args.sessions} sessions of 10 messages"
    )
    print(
        f"Fresh processes, {rounds} interleaved rounds, median [min..max]; {what}, at head; "
        f"load average {os.getloadavg()[0]:.1f}.\n"
    )
    print("| process | wall ms | CPU ms | imports ms (-X importtime) | max RSS MB |")
    print("| --- | --- | --- | --- | --- |")
    for name in names:
        s = samples[name]
        print(
            f"| {name} | {_spread(s.wall, 1000)} | {_spread(s.cpu, 1000)} | "
            f"{_spread(s.imports, 1000)} | {_spread(s.rss_mb)} |"
        )
    floor = statistics.median(samples["sqlalchemy: engine + one SELECT"].cpu)
    ours = statistics.median(samples["hermes_store: open + get_session"].cpu)
    over = ours - floor
    verdict = "within" if over <= TARGET_OVER_FLOOR_S else "OVER"
    print(
        f"\nhermes_store open + get_session: {over * 1000:+.0f} ms of CPU over the SQLAlchemy "
        f"floor (median), {verdict} the {TARGET_OVER_FLOOR_S * 1000:.0f} ms target; "
        f"Alembic {'LOADED' if 'alembic' in loaded else 'not loaded'}."
    )


if __name__ == "__main__":
    main()
