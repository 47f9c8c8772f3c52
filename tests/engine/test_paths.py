"""Odd but legal paths open the file they name, every time, and leave nothing beside it.

Paths reach SQLite as ``file:`` URIs where a connection needs flags (the read-only probe, the
read-only fallback). Unescaped, ``%20`` in a folder name was decoded into a space (the file
was "not a readable SQLite database" on every later open) and ``#``/``?`` cut the path short
(the probe created a stray empty file in the parent folder and every open took the
migration path).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hermes_store import SessionDB
from hermes_store.engine.factory import MAX_PATH_BYTES, sqlite_file, to_url
from hermes_store.engine.files import WRITER_LOCK_SUFFIX, path_from_uri, sqlite_uri
from hermes_store.errors import InvalidInputError, ReadOnlyDatabaseError
from hermes_store.schema import migrate


def _files(folder: Path) -> list[str]:
    """What is in the folder, besides the writer queue's lock file (which stays by design)."""
    return sorted(p for p in os.listdir(folder) if not p.endswith(WRITER_LOCK_SUFFIX))


NAMES = [
    "My%20Files",
    "100%",
    "a#b",
    "what?x=1&y=2",
    "a=b&c",
    "with spaces  twice",
    "ünïcödé 数据库 🚀",
    "%2e%2e",
    "x" * 200,
]


@pytest.mark.parametrize("name", NAMES)
def test_a_database_in_an_odd_folder_reopens_as_itself(tmp_path: Path, name: str) -> None:
    folder = tmp_path / name
    folder.mkdir()
    path = folder / "state.db"
    with SessionDB(path) as store:
        store.create_session("s", "cli")
        store.append_message("s", "user", "hello")
    before = sorted(os.listdir(tmp_path))
    for _ in range(2):
        state = migrate.preflight_sqlite(path)
        assert state is not None and state.revision == migrate.head_revision()
        assert migrate.current(path) == migrate.head_revision()
        with SessionDB(path) as store:
            assert store.get_messages("s")[0]["content"] == "hello"
    assert sorted(os.listdir(tmp_path)) == before == sorted([name])
    assert _files(folder) == ["state.db"]


@pytest.mark.parametrize("name", NAMES)
def test_read_only_uri_of_an_odd_path_reads_that_file(tmp_path: Path, name: str) -> None:
    folder = tmp_path / name
    folder.mkdir()
    path = folder / "state.db"
    with SessionDB(path) as store:
        store.create_session("s", "cli")
    url = sqlite_uri(path, mode="ro")
    assert sqlite_file(url) == path
    with SessionDB(url) as store:
        assert store.get_session("s") is not None


@pytest.mark.parametrize("name", ["state#1.db", "state?.db", "state%41.db", "ß tate.db"])
def test_odd_file_names(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    for _ in range(2):
        with SessionDB(path) as store:
            store.ensure_session("s")
    assert _files(tmp_path) == [name]


def test_uri_paths_decode_as_sqlite_does() -> None:
    assert path_from_uri("file:/a%20b/c%23d.db?mode=ro") == Path("/a b/c#d.db")
    assert path_from_uri("file:///srv/state.db") == Path("/srv/state.db")
    assert path_from_uri("file://localhost/srv/state.db#x") == Path("/srv/state.db")
    assert sqlite_file(to_url("sqlite:///file:/a%2520b/s.db?mode=ro&uri=true")) == Path(
        "/a b/s.db"  # make_url decodes once, as SQLAlchemy hands it to SQLite; SQLite again
    )


def test_a_path_too_long_for_sqlite_is_refused_before_anything_is_created(
    tmp_path: Path,
) -> None:
    folder = tmp_path
    while len(os.fsencode(folder)) < MAX_PATH_BYTES:
        folder = folder / ("d" * 100)
    with pytest.raises(InvalidInputError, match="at most 504 bytes"):
        SessionDB(folder / "state.db")
    assert not (tmp_path / ("d" * 100)).exists()
    room = MAX_PATH_BYTES - len(os.fsencode(tmp_path)) - len("/state.db")
    longest = tmp_path / ("d" * (room // 2 - 1)) / ("e" * (room - room // 2 - 1)) / "state.db"
    longest.parent.mkdir(parents=True)
    assert len(os.fsencode(longest)) == MAX_PATH_BYTES
    with SessionDB(tmp_path / "state.db") as store:
        store.ensure_session("s")
    (tmp_path / "state.db").rename(longest)
    with SessionDB(longest) as store:  # the longest path SQLite opens still works
        assert store.get_session("s") is not None


def test_a_path_that_is_not_utf8_is_refused_before_anything_is_created(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder named with bytes that are not UTF-8 (Python carries them as lone surrogates)
    failed with a raw UnicodeEncodeError, and an upgrade created the folder first. SQLite gets
    paths as UTF-8 URIs, so such a path is refused, saying how to fix it, with nothing made."""
    folder = tmp_path / os.fsdecode(b"b\xffd")
    path = folder / "state.db"
    refused = r"b\\xffd/state\.db is not valid UTF-8; rename the folder"
    with pytest.raises(InvalidInputError, match=refused):
        SessionDB(path)
    with pytest.raises(InvalidInputError, match=refused):
        migrate.upgrade(path)
    with pytest.raises(InvalidInputError, match="not valid UTF-8"):
        to_url(f"sqlite:///{path}")
    with pytest.raises(InvalidInputError, match="not valid UTF-8"):
        sqlite_uri(path)
    monkeypatch.setenv("HERMES_HOME", str(folder))
    with pytest.raises(InvalidInputError, match=refused):
        SessionDB()
    assert list(tmp_path.iterdir()) == []
    folder.mkdir()  # an existing folder: nothing is created in it either
    (tmp_path / "link").symlink_to(folder)
    for given in (path, tmp_path / "link" / "state.db"):
        with pytest.raises(InvalidInputError, match=refused):
            migrate.upgrade(given)
    assert list(folder.iterdir()) == []


#: A user no system here has: ``~`` followed by it names no home folder.
NO_SUCH_USER = "~hermes-no-such-user-4f1c"


def test_a_home_folder_that_cannot_be_found_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``~nosuchuser/x.db`` raised Python's bare ``RuntimeError: Could not determine home
    directory`` from the engine factory; now the package's InvalidInputError, before anything
    is created, whether the path or HERMES_HOME says it."""
    from hermes_store.query import read_only_query

    monkeypatch.chdir(tmp_path)
    given = f"{NO_SUCH_USER}/state.db"
    refused = f"'{NO_SUCH_USER}', whose home folder cannot be found"
    for attempt in (
        lambda: SessionDB(given),
        lambda: SessionDB(Path(given)),
        lambda: migrate.upgrade(given),
        lambda: read_only_query(given, "SELECT 1"),
        lambda: to_url(given),
    ):
        with pytest.raises(InvalidInputError, match=refused):
            attempt()
    monkeypatch.setenv("HERMES_HOME", f"{NO_SUCH_USER}/hermes")
    with pytest.raises(InvalidInputError, match=refused):
        SessionDB()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "url",
    [
        "sqlite:///%00x",
        "sqlite:////tmp/a%00b.db",
        "sqlite:///file:%2500x?uri=true",
        "sqlite:///file:/tmp/a%2500b.db?mode=ro&uri=true",
    ],
)
def test_a_nul_decoded_from_a_url_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str
) -> None:
    """``%00`` decodes to a NUL that no file name holds: ``path.stat()`` raised a raw
    ``ValueError: embedded null byte`` (SQLite itself cuts the name there, opening another
    file). Refused wherever a URL's path is decoded, before anything is created."""
    from hermes_store.query import read_only_query

    monkeypatch.chdir(tmp_path)
    for attempt in (
        lambda: to_url(url),
        lambda: SessionDB(url),
        lambda: migrate.upgrade(url),
        lambda: migrate.current(url),
        lambda: migrate.state_of(url),
        lambda: read_only_query(url, "SELECT 1"),
    ):
        with pytest.raises(InvalidInputError, match="NUL character"):
            attempt()
    with pytest.raises(InvalidInputError, match="NUL character"):
        path_from_uri("file:/tmp/a%00b.db")
    assert list(tmp_path.iterdir()) == []


def test_a_uri_sqlite_would_open_as_another_file_is_refused(tmp_path: Path) -> None:
    """A host in the URI (SQLite refuses it when it connects, after the store had looked at
    the path without it) and escapes that are not UTF-8 (decoded here as U+FFFD, by SQLite as
    the bytes) name another file than SQLite opens: refused before anything is opened."""
    with pytest.raises(InvalidInputError, match="names the host 'elsewhere'"):
        SessionDB(f"sqlite:///file://elsewhere{tmp_path}/state.db?uri=true")
    with pytest.raises(InvalidInputError, match="not valid UTF-8"):
        path_from_uri(f"file:{tmp_path}/b%FFd.db")
    with pytest.raises(InvalidInputError, match="not valid UTF-8"):
        SessionDB(f"sqlite:///file:{tmp_path}/b%25FFd.db?uri=true")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "url",
    [
        "sqlite:///file:x.db?mode=memory&uri=true",
        "sqlite:///file:x.db?mode=memory&cache=shared&uri=true",
        "sqlite:///file:x.db%3Fmode=memory?uri=true",
        "sqlite:///file:%253Amemory%253A?uri=true",
        "sqlite:///file:?uri=true",
        "sqlite:///file:/x.db?vfs=memdb&uri=true",
    ],
)
def test_an_in_memory_uri_is_refused_as_memory_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str
) -> None:
    """``mode=memory`` was taken for the file ``x.db``: the store asked for a file's pool
    and SQLAlchemy's in-memory pool raised ``TypeError: Invalid argument(s) 'max_overflow'``.
    Such a URI (and an empty name: SQLite's private temporary database) has no file, like
    ``:memory:``, and the store refuses it as it refuses ``:memory:``."""
    import hermes_store

    monkeypatch.chdir(tmp_path)
    assert sqlite_file(to_url(url)) is None
    with pytest.raises(hermes_store.StoreConfigError, match="in-memory SQLite database"):
        SessionDB(url)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("query", "refused"),
    [
        ("vfs=nosuch", "vfs='nosuch': no such vfs: nosuch"),
        ("mode=rox", "mode='rox' is not one SQLite takes"),
        ("cache=bogus", "cache='bogus' is not one SQLite takes"),
        ("mode=ro&mode=rw", "mode= more than once"),
        ("vfs=unix-none", "vfs=unix-none is refused: it switches SQLite's locks off"),
        ("nolock=1", "nolock=1 is refused: it switches SQLite's locks off"),
        ("nolock=yes", "nolock=yes is refused"),
        ("vfs=unix-dotfile", "vfs=unix-dotfile is refused: it locks the file otherwise"),
        ("vfs=unix-excl", "vfs=unix-excl is refused: it locks the file otherwise"),
    ],
)
def test_sqlite_uri_parameters_sqlite_refuses_or_the_store_cannot_keep_are_refused(
    tmp_path: Path, query: str, refused: str
) -> None:
    """``vfs=nosuch`` got through: ``upgrade`` raised a raw ``OperationalError: no such vfs``
    and a store opened, its first write raising it; an unknown mode or cache failed the same
    way. Such parameters, and those that switch SQLite's locks off (which the store's safety
    across processes rests on), are refused before anything is created."""
    path = tmp_path / "state.db"
    for url in (
        f"sqlite:///file:{path}?{query}&uri=true",
        f"sqlite:///file:{path}%3F{query.replace('&', '%26')}?uri=true",  # in the name itself
    ):
        with pytest.raises(InvalidInputError, match=refused):
            SessionDB(url)
        with pytest.raises(InvalidInputError, match=refused):
            migrate.upgrade(url)
    assert list(tmp_path.iterdir()) == []


def test_the_uri_parameters_sqlite_takes_still_open_the_file(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    for query in ("mode=rwc", "mode=rw&cache=private", "psow=1", "nolock=0", "vfs=unix"):
        with SessionDB(f"sqlite:///file:{path}?{query}&uri=true") as store:
            store.ensure_session("s")
    with SessionDB(f"sqlite:///file:{path}?mode=ro&uri=true") as store:
        assert store.get_session("s") is not None


@pytest.mark.parametrize("query", ["", "?uri=false", "?uri=0"])
def test_a_file_name_without_uri_true_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, query: str
) -> None:
    """``sqlite:///file:state.db`` without ``uri=true``: SQLAlchemy opens a plain file named
    ``file:state.db`` while the store read the name as a URI, brought ``state.db`` to head
    and kept its lock file beside it; the first write then met ``./file:state.db`` with no
    tables (a raw ``OperationalError``), and two names of the store shared no lock. Refused
    before anything is created, pointing at ``uri=true``."""
    monkeypatch.chdir(tmp_path)
    url = f"sqlite:///file:state.db{query}"
    with pytest.raises(InvalidInputError, match="only with uri=true"):
        SessionDB(url)
    with pytest.raises(InvalidInputError, match="only with uri=true"):
        migrate.upgrade(url)
    assert list(tmp_path.iterdir()) == []


def test_uri_is_read_as_sqlalchemy_reads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidInputError, match="uri='maybe' is not a boolean"):
        SessionDB("sqlite:///file:state.db?uri=maybe")
    assert list(tmp_path.iterdir()) == []
    with SessionDB("sqlite:///file:state.db?uri=yes") as store:  # SQLAlchemy's asbool
        store.ensure_session("s")
    assert _files(tmp_path) == ["state.db"]
    with SessionDB(tmp_path / "state.db") as store:
        assert store.get_session("s") is not None


@pytest.mark.parametrize("flag", ["immutable=1", "immutable=yes", "immutable=on", "mode=ro"])
def test_every_read_only_spelling_is_opened_read_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, flag: str
) -> None:
    """SQLite reads ``immutable=yes`` as true; the store took it for a writable file, tried to
    switch it to WAL and warned that the file "refuses WAL" and would fall back to DELETE."""
    path = tmp_path / "state.db"
    with SessionDB(path) as store:
        store.ensure_session("s")
    before = path.read_bytes()
    with caplog.at_level("WARNING"), SessionDB(f"sqlite:///file:{path}?{flag}&uri=true") as store:
        assert store.get_session("s") is not None
        with pytest.raises(ReadOnlyDatabaseError):
            store.append_message("s", "user", "no")
    assert not [r for r in caplog.records if "refuses WAL" in r.getMessage()]
    assert path.read_bytes() == before
