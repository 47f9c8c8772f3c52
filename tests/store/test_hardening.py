"""Hardening: ``NOT IN`` lists padded for the SQLite fast path, a full disk met when opening,
arguments of the wrong type or range on every public method, OS errors when opening, litter
left by killed creators and the modes of the folders the store creates.

The full-disk test mounts a real 4 MB tmpfs (root only); the "owned by another user" test
runs the store in a child that drops root privileges to ``nobody``.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import multiprocessing as mp
import os
import queue
import shutil
import sqlite3
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sqlalchemy.engine import URL
from sqlalchemy.pool import NullPool

from hermes_store import (
    AccessDeniedError,
    HermesStoreError,
    InvalidInputError,
    NotADatabaseError,
    SessionDB,
    StorageFullError,
    TitleInUseError,
    UnrecognizedSchemaError,
    timestamps,
    validate,
)
from hermes_store.cli import cli
from hermes_store.errors import UndecodableTextError, WriteRefusedError
from hermes_store.schema.migrate import remove_stale_temps
from tests.support import disks

# -- 1. NOT IN lists on the SQLite fast path ---------------------------------------------------


def _sources_store(store: SessionDB) -> list[str]:
    sources = [f"src{i}" for i in range(9)]
    for index, source in enumerate(sources):
        store.create_session(f"s{index}", source)
    return sources


def test_list_sessions_rich_excludes_any_number_of_sources(store: SessionDB) -> None:
    """3, 5, 6, 7 excluded sources were padded with NULL to 4 or 8: ``NOT IN`` matched nothing."""
    sources = _sources_store(store)
    for count in range(len(sources) + 1):
        excluded = sources[:count]
        rows = store.list_sessions_rich(exclude_sources=excluded or None, limit=50)
        assert sorted(row["source"] for row in rows) == sources[count:], count


def test_exclude_sources_as_a_tuple_a_set_or_one_string(store: SessionDB) -> None:
    sources = _sources_store(store)
    for excluded in (tuple(sources[:3]), set(sources[:3]), iter(sources[:3])):
        rows = store.list_sessions_rich(exclude_sources=excluded, limit=50)  # type: ignore[arg-type]
        assert sorted(row["source"] for row in rows) == sources[3:]
    rows = store.list_sessions_rich(exclude_sources="src0", limit=50)  # one name, not 4 letters
    assert sorted(row["source"] for row in rows) == sources[1:]


def test_search_excludes_any_number_of_sources(store: SessionDB) -> None:
    sources = _sources_store(store)
    for index in range(len(sources)):
        store.append_message(f"s{index}", "user", "needle in a haystack")
    for count in (3, 5, 6, 7):
        found = store.search_messages("needle", exclude_sources=sources[:count], limit=50)
        assert sorted(row["source"] for row in found) == sources[count:], count


def test_cli_sessions_list_with_three_excluded_sources(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    with SessionDB(path) as store:
        sources = _sources_store(store)
    args = ["--db", str(path), "sessions", "list", "--json"]
    for source in sources[:3]:
        args += ["--exclude-source", source]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert sorted(row["source"] for row in json.loads(result.output)) == sources[3:]


# -- 3. a full disk when a fresh process opens an existing database ----------------------------


_OPEN_AND_USE = """
import json, sys
from hermes_store import HermesStoreError, SessionDB
report = {}
def attempt(name, fn):
    try:
        report[name] = ["ok", repr(fn())]
    except HermesStoreError as error:
        report[name] = [type(error).__name__, str(error)]
    except BaseException as error:
        report[name] = ["RAW " + type(error).__name__, str(error)]
holder = {}
attempt("open", lambda: holder.setdefault("db", SessionDB(sys.argv[1])) and None)
if "db" in holder:
    db = holder["db"]
    attempt("read", lambda: db.get_session("s")["message_count"])
    attempt("write", lambda: db.append_message("s", "user", "on a full disk"))
    attempt("list", lambda: len(db.list_sessions_rich()))
print(json.dumps(report))
"""


def _fresh_process(path: Path) -> dict[str, list[str]]:
    done = subprocess.run(
        [sys.executable, "-c", _OPEN_AND_USE, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report: dict[str, list[str]] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


@pytest.mark.slow
def test_full_disk_when_opening_is_storage_full_not_a_broken_file(tiny_disk: Path) -> None:
    """A fresh process cannot size the ``-shm`` (SQLITE_IOERR_SHMSIZE): every call says the disk
    is full, the CLI too, and once space is back the database opens with every row."""
    path = tiny_disk / "state.db"
    with SessionDB(path) as store:
        store.create_session("s", "cli")
        store.append_message("s", "user", "written before the disk filled up")
    assert not Path(f"{path}-shm").exists()  # closed cleanly: the next opener must make it
    filler = disks.fill(tiny_disk)

    for attempt in ("first opener", "opener that finds the sidecar files"):
        report = _fresh_process(path)
        calls = [name for name in ("open", "read", "write", "list") if name in report]
        assert calls, report
        for name in calls:
            kind, message = report[name]
            if name == "open" and kind == "ok":
                continue
            assert kind == "StorageFullError", (attempt, name, report)
            assert "disk is full" in message, (attempt, name, report)

    result = CliRunner().invoke(cli, ["--db", str(path), "sessions", "list"])
    assert result.exit_code != 0
    assert "disk is full" in result.output
    assert "not a readable SQLite database" not in result.output

    filler.unlink()
    report = _fresh_process(path)
    assert report["read"] == ["ok", "1"], report
    assert report["write"][0] == "ok", report


def test_io_error_family_maps_to_package_errors() -> None:
    """The mapping itself, for the codes a small disk cannot produce on demand."""
    import sqlalchemy as sa

    from hermes_store.errors import StorageIOError, translate

    def wrapped(code: int, name: str) -> sa.exc.DBAPIError:
        orig = sqlite3.OperationalError("disk I/O error")
        orig.sqlite_errorcode = code
        orig.sqlite_errorname = name
        error = sa.exc.DBAPIError.instance("SELECT 1", None, orig, sqlite3.Error)
        assert isinstance(error, sa.exc.DBAPIError)
        return error

    assert isinstance(translate(wrapped(4874, "SQLITE_IOERR_SHMSIZE")), StorageFullError)
    read_error = translate(wrapped(266, "SQLITE_IOERR_READ"))
    assert isinstance(read_error, StorageIOError)
    assert "SQLITE_IOERR_READ" in str(read_error)


# -- 4. arguments of the wrong type or range ----------------------------------------------------

HUGE = 2**63
NAN = float("nan")
INF = float("inf")


def _nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


class _NoTruth:
    """A value whose truth value is undefined, as a numpy array's is."""

    def __bool__(self) -> bool:
        raise RuntimeError("no truth value")


class _LyingInt(int):
    """An int whose comparisons say it is inside any range and smaller than nothing."""

    def __lt__(self, other: object) -> bool:
        return False

    def __gt__(self, other: object) -> bool:
        return False

    def __le__(self, other: object) -> bool:
        return True

    def __ge__(self, other: object) -> bool:
        return True


class _ComparedElementwise:
    """Compares to anything with a result that has no truth value, as a numpy array does."""

    def __eq__(self, other: object) -> _NoTruth:  # type: ignore[override]
        return _NoTruth()

    __hash__ = object.__hash__


BAD_CALLS: dict[str, Callable[[SessionDB], object]] = {
    "input_tokens >= 2**63": lambda db: db.update_token_counts("base", input_tokens=HUGE),
    "reasoning_tokens < -2**63": lambda db: db.update_token_counts(
        "base", reasoning_tokens=-HUGE - 1
    ),
    "token_count >= 2**63": lambda db: db.append_message("base", "user", "x", token_count=HUGE),
    "limit >= 2**63": lambda db: db.list_sessions_rich(limit=HUGE),
    "offset >= 2**63": lambda db: db.search_sessions(offset=HUGE),
    "search limit >= 2**63": lambda db: db.search_messages("hello", limit=HUGE),
    "prune 10**400 days": lambda db: db.prune_sessions(10**400),
    "prune nan days": lambda db: db.prune_sessions(NAN),
    "nested tool_calls": lambda db: db.append_message(
        "base", "user", "x", tool_calls=_nested(5000)
    ),
    "timestamp NaN": lambda db: db.append_messages("base", [{"role": "user", "timestamp": NAN}]),
    "timestamp inf": lambda db: db.append_messages("base", [{"role": "user", "timestamp": INF}]),
    "timestamp in milliseconds": lambda db: db.append_messages(
        "base", [{"role": "user", "timestamp": 1_733_500_000_000.5}]
    ),
    "timestamp 1e300": lambda db: db.append_messages(
        "base", [{"role": "user", "timestamp": 1e300}]
    ),
    "timestamp before year 1": lambda db: db.append_messages(
        "base", [{"role": "user", "timestamp": -1e12}]
    ),
    "estimated cost 2**70 as an int": lambda db: db.update_token_counts(
        "base", estimated_cost_usd=2**70
    ),
    "actual cost 2**63 as an int": lambda db: db.update_token_counts("base", actual_cost_usd=HUGE),
    "estimated cost 1e308": lambda db: db.update_token_counts("base", estimated_cost_usd=1e308),
    "actual cost -1e13, absolute": lambda db: db.update_token_counts(
        "base", actual_cost_usd=-1e13, absolute=True
    ),
    "estimated cost NaN": lambda db: db.update_token_counts("base", estimated_cost_usd=NAN),
    "actual cost -inf": lambda db: db.update_token_counts("base", actual_cost_usd=-INF),
    "search 5": lambda db: db.search_messages(5),  # type: ignore[arg-type]
    "search bytes": lambda db: db.search_messages(b"hello"),  # type: ignore[arg-type]
    "title 5": lambda db: db.set_session_title("base", 5),  # type: ignore[arg-type]
    "limit '5'": lambda db: db.list_sessions_rich(limit="5"),  # type: ignore[arg-type]
    "get_session list": lambda db: db.get_session(["a"]),  # type: ignore[arg-type]
    "end_session dict": lambda db: db.end_session({"a": 1}, "x"),  # type: ignore[arg-type]
    "after_id 'abc'": lambda db: db.get_messages("base", after_id="abc"),  # type: ignore[arg-type]
    "absolute 'yes'": lambda db: db.update_token_counts("base", absolute="yes"),  # type: ignore[arg-type]
    "iter_messages page_size 0": lambda db: list(db.iter_messages("base", page_size=0)),
    "iter_messages page_size 0 that says it is in range": lambda db: list(
        db.iter_messages("base", page_size=_LyingInt(0))
    ),
    "export page_size -1 that says it is in range": lambda db: list(
        db.iter_export(page_size=_LyingInt(-1))
    ),
    "limit -1 that says it is in range": lambda db: db.get_messages("base", limit=_LyingInt(-1)),
    "prefix minimum 0 that says it is in range": lambda db: db.unique_id_prefixes(
        ["base"], minimum=_LyingInt(0)
    ),
    "exclude_sources [None]": lambda db: db.list_sessions_rich(exclude_sources=[None]),  # type: ignore[list-item]
    "messages not mappings": lambda db: db.append_messages("base", [1, 2]),  # type: ignore[list-item]
    "message key not text": lambda db: db.append_messages("base", [{1: "user"}]),  # type: ignore[dict-item]
    "tool_calls without a truth value": lambda db: db.append_message(
        "base", "assistant", "x", tool_calls=_NoTruth()
    ),
    "reasoning_details without a truth value": lambda db: db.append_message(
        "base", "assistant", "x", reasoning_details=_NoTruth()
    ),
    "codex_reasoning_items without a truth value": lambda db: db.append_message(
        "base", "assistant", "x", codex_reasoning_items=_NoTruth()
    ),
    "batched tool_calls without a truth value": lambda db: db.append_messages(
        "base", [{"role": "user", "content": "ok"}, {"role": "assistant", "tool_calls": _NoTruth()}]
    ),
    "model_config without a truth value": lambda db: db.create_session(
        "new",
        "cli",
        model_config=_NoTruth(),  # type: ignore[arg-type]
    ),
    "sort compared element-wise": lambda db: db.search_messages(
        "hello",
        sort=_ComparedElementwise(),  # type: ignore[arg-type]
    ),
}


@pytest.fixture
def baseline(store: SessionDB) -> Iterator[SessionDB]:
    """A session whose rows must come out of every refused call unchanged."""
    store.create_session("base", "cli", model="m")
    store.append_message("base", "user", "hello there")
    store.update_token_counts("base", input_tokens=10, estimated_cost_usd=0.5)
    before = store.export_all()
    yield store
    assert store.export_all() == before


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_bad_arguments_raise_invalid_input_and_write_nothing(
    baseline: SessionDB, case: str
) -> None:
    with pytest.raises(InvalidInputError):
        BAD_CALLS[case](baseline)


def test_an_int_subclass_is_taken_by_its_value_not_its_comparisons(store: SessionDB) -> None:
    """Ranges are checked on the number itself, and the store's own arithmetic uses it: a
    page size whose comparisons lie pages through the session as its value says (it ended
    in an IndexError after the first page)."""
    store.create_session("s", "cli")
    for n in range(5):
        store.append_message("s", "user", f"message {n}")
    paged = list(store.iter_messages("s", page_size=_LyingInt(2)))
    assert [row["content"] for row in paged] == [f"message {n}" for n in range(5)]
    assert len(store.list_sessions_rich(limit=_LyingInt(1))) == 1
    assert len(store.search_sessions(limit=_LyingInt(1))) == 1


def test_a_message_limit_given_as_an_int_subclass_holds_by_its_value(tmp_path: Path) -> None:
    """The limit kept is the plain number: a subclass whose comparisons lie let a message of
    any size through."""
    with SessionDB(tmp_path / "state.db", max_message_bytes=_LyingInt(10)) as db:
        assert type(db.max_message_bytes) is int and db.max_message_bytes == 10
        db.create_session("s", "cli")
        with pytest.raises(InvalidInputError):
            db.append_message("s", "user", "x" * 100)
        assert db.message_count("s") == 0


def test_counter_overflow_is_refused_not_turned_into_a_float(baseline: SessionDB) -> None:
    """SQLite turned an INTEGER that overflows into a REAL; both backends stop at 64 bits."""
    top = 2**63 - 1
    baseline.update_token_counts("other", input_tokens=1)  # unknown id: still a no-op
    baseline.create_session("big", "cli")
    baseline.update_token_counts("big", input_tokens=top, output_tokens=-top - 1, absolute=True)
    with pytest.raises(InvalidInputError):
        baseline.update_token_counts("big", input_tokens=1)
    with pytest.raises(InvalidInputError):
        baseline.update_token_counts("big", output_tokens=-1)
    baseline.update_token_counts("big", input_tokens=-1, output_tokens=1)  # away from the edge
    session = baseline.get_session("big")
    assert session is not None
    assert session["input_tokens"] == top - 1 and type(session["input_tokens"]) is int
    assert session["output_tokens"] == -top and type(session["output_tokens"]) is int
    baseline.delete_session("big")


def test_timestamps_and_costs_within_their_bounds_are_taken(baseline: SessionDB) -> None:
    """The store takes any date a ``datetime`` holds and costs up to a trillion dollars a
    call; a timestamp in milliseconds is named as the likely slip."""
    baseline.create_session("edges", "cli")
    baseline.append_messages(
        "edges",
        [
            {"role": "user", "content": "early", "timestamp": timestamps.EARLIEST},
            {"role": "user", "content": "late", "timestamp": timestamps.LATEST},
            {"role": "user", "content": "epoch", "timestamp": 0},
        ],
    )
    baseline.update_token_counts("edges", estimated_cost_usd=validate.MAX_COST_USD)
    baseline.update_token_counts("edges", estimated_cost_usd=validate.MAX_COST_USD)
    baseline.update_token_counts("edges", actual_cost_usd=-validate.MAX_COST_USD)
    session = baseline.get_session("edges")
    assert session is not None
    assert session["estimated_cost_usd"] == 2 * validate.MAX_COST_USD
    assert session["actual_cost_usd"] == -validate.MAX_COST_USD
    moments = [m["timestamp"] for m in baseline.get_messages("edges")]
    assert moments == [timestamps.EARLIEST, 0, timestamps.LATEST]
    with pytest.raises(InvalidInputError, match="looks like milliseconds"):
        baseline.append_messages("edges", [{"role": "user", "timestamp": 1_733_500_000_000}])
    baseline.delete_session("edges")


def test_a_directory_at_the_database_path(tmp_path: Path) -> None:
    (tmp_path / "state.db").mkdir()
    with pytest.raises(NotADatabaseError, match="directory"):
        SessionDB(tmp_path / "state.db")


def test_schema_version_holding_text_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    SessionDB(path).close()
    raw = sqlite3.connect(path)
    with raw:
        raw.execute("UPDATE schema_version SET version = 'six'")
    raw.close()
    with pytest.raises(UnrecognizedSchemaError, match="not a number"):
        SessionDB(path)


def _open_as_nobody(path: str, out: Any) -> None:
    """Child process: warm up (imports), become ``nobody``, open ``path``; report the outcome."""
    warm_dir = tempfile.mkdtemp(prefix="hermes-warm-")
    warm = SessionDB(f"{warm_dir}/warm.db")
    warm.create_session("w", "cli")
    warm.get_session("w")
    warm.close()
    if os.geteuid() == 0:
        os.setgid(65534)
        os.setuid(65534)
    try:
        SessionDB(path).close()
    except HermesStoreError as error:
        out.put(["package", type(error).__name__, str(error)])
    except BaseException as error:
        out.put(["raw", type(error).__name__, str(error)])
    else:
        out.put(["opened", "", ""])


@pytest.mark.slow
def test_a_file_owned_by_another_user(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to hand the file to another user")
    folder = Path(tempfile.mkdtemp(prefix="hermes-other-owner-"))
    try:
        folder.chmod(0o755)
        path = folder / "state.db"
        SessionDB(path).close()
        assert stat.S_IMODE(path.stat().st_mode) == 0o600  # root's, owner-only
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        proc = ctx.Process(target=_open_as_nobody, args=(str(path), out))
        proc.start()
        try:
            outcome = out.get(timeout=120)
        except queue.Empty:
            outcome = ["no report", "", ""]
        proc.join(timeout=30)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    assert outcome[0] == "package", outcome
    assert outcome[1] == AccessDeniedError.__name__, outcome
    assert "permission denied" in outcome[2].lower()


# -- 4. every public method, arbitrary arguments ------------------------------------------------

INTS = st.one_of(
    st.integers(min_value=-1000, max_value=1000),
    st.sampled_from([2**31, 2**63 - 1, 2**63, -(2**63) - 1, 10**400]),
)
LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    INTS,
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["base", "cli", "user", "hello", "", "\x00", "\ud800"]),
    st.text(max_size=8),
    st.binary(max_size=4),
)
ARGS = st.recursive(
    LEAVES,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
#: Every public method of SessionDB but ``close`` (it ends the store the test is using).
METHODS = sorted(
    name
    for name, member in inspect.getmembers(SessionDB)
    if callable(member)
    and (not name.startswith("_") or name in ("_sanitize_fts5_query", "_contains_cjk"))
    and name not in ("close", "from_url")
)
FUZZ = settings(
    max_examples=250,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _parameters(name: str) -> list[inspect.Parameter]:
    signature = inspect.signature(getattr(SessionDB, name))
    return [
        p
        for p in signature.parameters.values()
        if p.name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]


def test_fuzz_covers_the_api() -> None:
    assert {"append_message", "update_token_counts", "list_sessions_rich", "iter_export"} <= set(
        METHODS
    )


@FUZZ
@given(data=st.data())
def test_every_public_method_answers_or_raises_a_package_error(
    store: SessionDB, data: st.DataObject, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only success or a HermesStoreError may come out, whatever the arguments' types.
    Relative paths (``backup("cli")``) land in a temporary folder, never in the checkout."""
    monkeypatch.chdir(tmp_path)
    if store.get_session("base") is None:  # fuzzed deletes and prunes may remove it
        store.create_session("base", "cli", model="m")
        store.append_message("base", "user", "hello there")
    name = data.draw(st.sampled_from(METHODS), label="method")
    arguments: dict[str, Any] = {}
    for parameter in _parameters(name):
        if parameter.default is not inspect.Parameter.empty and data.draw(st.booleans()):
            continue  # leave an optional argument at its default
        arguments[parameter.name] = data.draw(ARGS, label=parameter.name)
    try:
        result = getattr(store, name)(**arguments)
        if inspect.isgenerator(result):
            list(result)
    except HermesStoreError:
        pass


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@example(db_path="a://b", checkpoint_every=50, writer_busy_timeout=None)
@example(db_path="folder", checkpoint_every=50, writer_busy_timeout=None)
@example(db_path=b"state.db", checkpoint_every=50, writer_busy_timeout=None)
@example(db_path=None, checkpoint_every=-1, writer_busy_timeout=float("nan"))
@given(
    db_path=st.one_of(
        ARGS.filter(lambda value: not isinstance(value, str)),
        st.sampled_from(["", " ", "\x00", "a\x00b", "a://b", "nowhere+x://h/db", "folder"]),
    ),
    checkpoint_every=st.one_of(st.just(50), ARGS),
    writer_busy_timeout=st.one_of(st.none(), ARGS),
)
def test_opening_with_arbitrary_arguments(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    db_path: Any,
    checkpoint_every: Any,
    writer_busy_timeout: Any,
) -> None:
    """The constructor refuses what it cannot open with package errors (strings are a fixed
    set, relative to a temporary folder: a random path could land anywhere)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HERMES_HOME", str(tmp_path / "home"))
    (tmp_path / "folder").mkdir(exist_ok=True)
    with contextlib.suppress(HermesStoreError):
        SessionDB(
            db_path, checkpoint_every=checkpoint_every, writer_busy_timeout=writer_busy_timeout
        ).close()


# -- 6. litter from killed creators, and folder modes -------------------------------------------


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=60)
    return child.pid


def _litter(folder: Path, name: str, *, age: float) -> Path:
    path = folder / name
    path.write_bytes(b"")
    then = time.time() - age
    os.utime(path, (then, then))
    return path


def test_stale_temporary_files_of_killed_creators_are_removed(tmp_path: Path) -> None:
    """Only ``.NAME.PID.HEX.new`` and ``.import`` (and sidecars) of a dead pid AND older than
    the bound go (a vacuum swap's copy is the swap's to remove)."""
    dead, alive, hex16 = _dead_pid(), os.getpid(), "0123456789abcdef"
    hour = 3600.0
    stale = [
        _litter(tmp_path, f".state.db.{dead}.{hex16}.new", age=2 * hour),
        _litter(tmp_path, f".state.db.{dead}.{hex16}.new-wal", age=2 * hour),
        _litter(tmp_path, f".state.db.{dead}.{hex16}.new-shm", age=2 * hour),
        _litter(tmp_path, f".state.db.{hex16}.new", age=2 * hour),  # older releases: no pid
        _litter(tmp_path, f".state.db.{dead}.{hex16}.import", age=2 * hour),  # an import's
    ]
    kept = [
        _litter(tmp_path, f".state.db.{dead}.fedcba9876543210.new", age=60),  # too recent
        _litter(tmp_path, f".state.db.{alive}.{hex16}.new", age=2 * hour),  # creator alive
        _litter(tmp_path, ".state.db.ffffffffffffffff.new", age=60),  # no pid, too recent
        _litter(tmp_path, f".other.db.{dead}.{hex16}.new", age=2 * hour),  # another database
        _litter(tmp_path, f"state.db.{dead}.{hex16}.new", age=2 * hour),  # not hidden
        _litter(tmp_path, f".state.db.{dead}.{hex16}.new.bak", age=2 * hour),
        _litter(tmp_path, f".state.db.{dead}.{hex16}.compact", age=2 * hour),  # the swap's
        _litter(tmp_path, "notes.txt", age=2 * hour),
    ]

    with SessionDB(tmp_path / "state.db") as store:  # a new database: its creator cleans up
        store.create_session("s", "cli")

    assert [p.name for p in stale if p.exists()] == []
    assert [p.name for p in kept if not p.exists()] == []
    leftovers = {p.name for p in tmp_path.iterdir()} - {p.name for p in kept}
    allowed = {"state.db", "state.db-wal", "state.db-shm", "state.db-writer.lock"}
    assert "state.db" in leftovers <= allowed


def test_removal_spares_what_it_cannot_judge(tmp_path: Path) -> None:
    dead, hex16 = _dead_pid(), "0123456789abcdef"
    link = tmp_path / f".state.db.{dead}.{hex16}.new"
    target = _litter(tmp_path, "precious", age=7200)
    link.symlink_to(target)
    folder = tmp_path / f".state.db.{dead}.{hex16}.new-wal"
    folder.mkdir()
    assert remove_stale_temps(tmp_path / "state.db", older_than=0) == []
    assert link.is_symlink() and target.exists() and folder.is_dir()
    assert remove_stale_temps(tmp_path / "missing" / "state.db") == []  # no folder: nothing


def test_new_database_temp_file_carries_the_creator_pid(tmp_path: Path) -> None:
    """The name the cleanup relies on: watch the folder while a database is created."""
    import sqlalchemy as sa

    seen: list[str] = []

    @sa.event.listens_for(sa.engine.Engine, "connect")
    def _watch(dbapi_connection: Any, record: Any) -> None:
        seen.extend(p.name for p in tmp_path.iterdir() if p.name.endswith(".new"))

    try:
        SessionDB(tmp_path / "state.db").close()
    finally:
        sa.event.remove(sa.engine.Engine, "connect", _watch)
    assert seen, "the creation went through no temporary file"
    assert all(name.startswith(f".state.db.{os.getpid()}.") for name in seen), seen
    assert not any(p.name.endswith(".new") for p in tmp_path.iterdir())


@pytest.fixture
def umask_zero() -> Iterator[None]:
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def test_folders_the_store_creates_are_owner_only(tmp_path: Path, umask_zero: None) -> None:
    """Under umask 000 the new folders were 0777; the existing ones are never changed."""
    existing = tmp_path / "existing"
    existing.mkdir(mode=0o775)
    path = existing / "new" / "deeper" / "state.db"
    SessionDB(path).close()
    assert stat.S_IMODE((existing / "new").stat().st_mode) == 0o700
    assert stat.S_IMODE((existing / "new" / "deeper").stat().st_mode) == 0o700
    assert stat.S_IMODE(existing.stat().st_mode) == 0o775
    assert stat.S_IMODE(path.stat().st_mode) == 0o600

    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    SessionDB(shared / "state.db").close()
    assert stat.S_IMODE(shared.stat().st_mode) == 0o777  # not ours to tighten


def test_default_home_folder_is_owner_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, umask_zero: None
) -> None:
    monkeypatch.setenv("HERMES_HOME", str(tmp_path / "home" / ".hermes"))
    SessionDB().close()
    assert stat.S_IMODE((tmp_path / "home").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "home" / ".hermes").stat().st_mode) == 0o700


@pytest.mark.parametrize("name", ["\x00", "copy\x00.db", "sub/\x00/copy.db"])
def test_backup_to_a_path_with_nul_is_invalid_input_and_writes_nothing(
    sqlite_store: SessionDB, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """The OS cannot take a NUL in a path: say so before any partial file is created."""
    sqlite_store.create_session("s", "cli")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    for destination in (name, Path(name)):
        with pytest.raises(InvalidInputError, match="NUL"):
            sqlite_store.backup(destination)
    assert list(work.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["work", *(p.name for p in tmp_path.glob("state.db*"))]
    )


# -- another tool's constraints and triggers, and text that is not UTF-8 -----------------------


def _add_refusal(db_url: URL, backend: str, table: str, event: str, message: str) -> None:
    """A trigger another tool could have added: it refuses ``event`` on ``table``."""
    engine = sa.create_engine(db_url, poolclass=NullPool)
    with engine.begin() as conn:
        if backend == "sqlite":
            conn.exec_driver_sql(
                f"CREATE TRIGGER audit_refusal BEFORE {event} ON {table} "
                f"BEGIN SELECT RAISE(ABORT, '{message}'); END"
            )
        else:
            conn.exec_driver_sql(
                "CREATE FUNCTION audit_refusal() RETURNS trigger LANGUAGE plpgsql AS "
                f"$$ BEGIN RAISE EXCEPTION '{message}'; END $$"
            )
            conn.exec_driver_sql(
                f"CREATE TRIGGER audit_refusal BEFORE {event} ON {table} "
                "FOR EACH ROW EXECUTE FUNCTION audit_refusal()"
            )
    engine.dispose()


def _contents(db_url: URL) -> dict[str, list[tuple[Any, ...]]]:
    engine = sa.create_engine(db_url, poolclass=NullPool)
    with engine.connect() as conn:
        found = {
            table: sorted(map(tuple, conn.exec_driver_sql(f"SELECT * FROM {table}")), key=repr)
            for table in ("sessions", "messages", "write_keys")
        }
    engine.dispose()
    return found


#: Each write method, and the trigger (table, event) that refuses it.
_REFUSED_WRITES: dict[str, tuple[str, str, Callable[[SessionDB], object]]] = {
    "create_session": ("sessions", "INSERT", lambda db: db.create_session("new", "cli")),
    "create_child": (
        "sessions",
        "INSERT",
        lambda db: db.create_session("child", "cli", parent_session_id="s"),
    ),
    "append_message": ("messages", "INSERT", lambda db: db.append_message("s", "tool", "out")),
    "append_message_keyed": (
        "messages",
        "INSERT",
        lambda db: db.append_message("s", "tool", "out", idempotency_key="k-append"),
    ),
    "append_message_bump": ("sessions", "UPDATE", lambda db: db.append_message("s", "user", "x")),
    "append_messages": (
        "messages",
        "INSERT",
        lambda db: db.append_messages("s", [{"role": "user", "content": "a"}]),
    ),
    "update_token_counts": (
        "sessions",
        "UPDATE",
        lambda db: db.update_token_counts("s", input_tokens=5),
    ),
    "update_token_counts_keyed": (
        "sessions",
        "UPDATE",
        lambda db: db.update_token_counts("s", input_tokens=5, idempotency_key="k-tokens"),
    ),
    "update_token_counts_absolute": (
        "sessions",
        "UPDATE",
        lambda db: db.update_token_counts("s", input_tokens=5, absolute=True),
    ),
    "end_session": ("sessions", "UPDATE", lambda db: db.end_session("s", "done")),
    "set_session_title": (
        "sessions",
        "UPDATE OF title",
        lambda db: db.set_session_title("s", "A title nobody holds"),
    ),
    "delete_session": ("sessions", "DELETE", lambda db: db.delete_session("s")),
    "delete_session_messages": ("messages", "DELETE", lambda db: db.delete_session("s")),
    "clear_messages": ("messages", "DELETE", lambda db: db.clear_messages("s")),
}


@pytest.mark.parametrize("case", sorted(_REFUSED_WRITES))
def test_a_trigger_refusing_a_write_is_a_write_refused_error(
    store: SessionDB, db_url: URL, backend: str, case: str
) -> None:
    """Another tool's trigger refuses the write: one package error carrying the trigger's own
    words, for every write method (a title nobody holds is not "already in use"); nothing
    was written."""
    store.create_session("s", "cli")
    store.append_message("s", "user", "kept")
    table, event, call = _REFUSED_WRITES[case]
    _add_refusal(db_url, backend, table, event, "refused by the audit tool")
    before = _contents(db_url)
    with pytest.raises(WriteRefusedError, match="refused by the audit tool") as raised:
        call(store)
    assert not isinstance(raised.value, TitleInUseError)
    assert _contents(db_url) == before


def test_a_title_held_by_another_session_is_still_in_use(
    store: SessionDB, db_url: URL, backend: str
) -> None:
    """With another tool's trigger on the titles that lets the write through, the unique
    title index still says :class:`TitleInUseError`."""
    store.create_session("a", "cli")
    store.create_session("b", "cli")
    store.set_session_title("a", "Taken")
    engine = sa.create_engine(db_url, poolclass=NullPool)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE audit_log (title TEXT)")
        if backend == "sqlite":
            conn.exec_driver_sql(
                "CREATE TRIGGER audit_titles AFTER UPDATE OF title ON sessions "
                "BEGIN INSERT INTO audit_log VALUES (new.title); END"
            )
    engine.dispose()
    with pytest.raises(TitleInUseError, match="Taken"):
        store.set_session_title("b", "Taken")
    with store.transaction(), pytest.raises(TitleInUseError, match="Taken"):
        store.set_session_title("b", "Taken")
    assert store.get_session_title("b") is None


def test_a_trigger_refusal_inside_a_transaction_is_raised_at_the_block(
    store: SessionDB, db_url: URL, backend: str
) -> None:
    """Inside a ``transaction()`` block the refused title write is not "in use" either."""
    store.create_session("s", "cli")
    _add_refusal(db_url, backend, "sessions", "UPDATE OF title", "titles are frozen")
    with pytest.raises(WriteRefusedError, match="titles are frozen"), store.transaction():
        store.set_session_title("s", "Fresh")
    assert store.get_session_title("s") is None


class _Abandoned(Exception):
    """Raised to leave a ``transaction()`` block, so it rolls back."""


@pytest.mark.parametrize("case", sorted(_REFUSED_WRITES))
def test_a_refused_write_inside_a_transaction_is_named_where_it_is_raised(
    store: SessionDB, db_url: URL, backend: str, case: str
) -> None:
    """Code inside a ``transaction()`` block catches a refused store call by the package's
    name at the call, as it would outside a block, not SQLAlchemy's error."""
    store.create_session("s", "cli")
    store.append_message("s", "user", "kept")
    table, event, call = _REFUSED_WRITES[case]
    _add_refusal(db_url, backend, table, event, "refused by the audit tool")
    before = _contents(db_url)
    with pytest.raises(_Abandoned), store.transaction():
        with pytest.raises(WriteRefusedError, match="refused by the audit tool"):
            call(store)
        raise _Abandoned
    assert _contents(db_url) == before


def _undecodable_store(tmp_path: Path) -> SessionDB:
    """A store whose session "s" has a title and a message whose bytes are not UTF-8 (the
    original store's SQLite keeps whatever another program wrote as TEXT)."""
    path = tmp_path / "state.db"
    with SessionDB(path) as store:
        store.create_session("s", "cli", model="m")
        store.set_session_title("s", "fine")
        store.append_message("s", "user", "hello world")
    with contextlib.closing(sqlite3.connect(path)) as raw, raw:
        raw.execute("UPDATE messages SET content = CAST(X'C328' AS TEXT)")
        raw.execute("UPDATE sessions SET title = CAST(X'66C328' AS TEXT)")
    return SessionDB(path)


#: Every read that meets the title or the content, twice (the second call on the thread's
#: held read connection, past its first read).
_UNDECODABLE_READS: dict[str, Callable[[SessionDB], object]] = {
    "get_session": lambda db: db.get_session("s"),
    "get_session_title": lambda db: db.get_session_title("s"),
    "get_messages": lambda db: db.get_messages("s"),
    "iter_messages": lambda db: list(db.iter_messages("s")),
    "get_messages_as_conversation": lambda db: db.get_messages_as_conversation("s"),
    "list_sessions_rich": lambda db: db.list_sessions_rich(),
    "list_sessions_rich_source": lambda db: db.list_sessions_rich(source="cli"),
    "search_sessions": lambda db: db.search_sessions(),
    "export_session": lambda db: db.export_session("s"),
    "export_all": lambda db: db.export_all(),
    "iter_export": lambda db: list(db.iter_export()),
}


@pytest.mark.parametrize("case", sorted(_UNDECODABLE_READS))
def test_text_that_is_not_utf8_is_a_clear_error(tmp_path: Path, case: str) -> None:
    """sqlite3 cannot turn those bytes into a str: the read says which column holds text that
    is not UTF-8 and how to repair it, as a package error; the file is left as it was."""
    read = _UNDECODABLE_READS[case]
    with _undecodable_store(tmp_path) as store:
        for _ in range(2):
            with pytest.raises(UndecodableTextError, match="not valid UTF-8") as raised:
                read(store)
            assert "column '" in str(raised.value) and "text_factory=bytes" in str(raised.value)
        store.append_message("s", "user", "still writable")  # writes go on
    with contextlib.closing(sqlite3.connect(tmp_path / "state.db")) as raw:
        raw.text_factory = bytes
        assert raw.execute("SELECT content FROM messages ORDER BY id").fetchall() == [
            (b"\xc3(",),
            (b"still writable",),
        ]


@pytest.mark.parametrize("case", sorted(_UNDECODABLE_READS))
def test_text_that_is_not_utf8_read_inside_a_transaction_is_named_at_the_read(
    tmp_path: Path, case: str
) -> None:
    """Inside a ``transaction()`` block the read raises the package's error itself, so the
    block's code can catch it and go on writing."""
    read = _UNDECODABLE_READS[case]
    with _undecodable_store(tmp_path) as store:
        with store.transaction():
            with pytest.raises(UndecodableTextError, match="not valid UTF-8"):
                read(store)
            store.append_message("s", "user", "written after the refused read")
        assert store.message_count("s") == 2


def test_text_that_is_not_utf8_through_the_cli_is_a_clear_error(tmp_path: Path) -> None:
    _undecodable_store(tmp_path).close()
    args = ["--db", str(tmp_path / "state.db"), "sessions", "list", "--json"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code != 0
    assert "not valid UTF-8" in result.output
    assert "Traceback" not in result.output


def test_a_short_message_that_is_not_utf8_does_not_fail_the_searches_finding_it(
    tmp_path: Path,
) -> None:
    """FTS5's snippet hands back a short content's raw bytes: one message another program
    stored as bytes that are not UTF-8 failed every search whose page held it. Its snippet is
    made from its blob instead, the bad byte replaced, as a long content's is."""
    path = tmp_path / "state.db"
    with SessionDB(path) as store:
        store.create_session("s", "cli")
        for index in range(5):
            store.append_message("s", "user", f"deploy number {index}")
    with contextlib.closing(sqlite3.connect(path)) as raw, raw:
        raw.execute(
            "INSERT INTO messages (session_id, role, content, timestamp) "
            "VALUES ('s', 'user', CAST(X'6465706C6F7920FF' AS TEXT), 1.0)"
        )
    with SessionDB(path) as store:
        hits = store.search_messages("deploy", limit=10)
        assert len(hits) == 6
        snippets = sorted(hit["snippet"] for hit in hits)
        assert ">>>deploy<<< \ufffd" in snippets, snippets
        assert sum(">>>deploy<<< number" in s for s in snippets) == 5
