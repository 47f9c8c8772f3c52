"""What an import reads: a JSON Lines export, each line read in bounded pieces.

What must hold: an input that is no export (binary data, ``/dev/zero``, a line that is not a
JSON object, a line longer than ``MAX_LINE_BYTES``) is refused with ``NotAnExportError`` as
soon as the piece showing it is read, with memory bounded by the cap and nothing of its batch
written; a valid export still imports, its long lines read in pieces; the progress callback
sums to the bytes read.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import pytest

from hermes_store import SessionDB, transfer
from hermes_store.errors import InvalidInputError
from tests.support import import_workers as workers

CHUNK = 1 << 20  # what one read of a line takes at most (transfer._LINE_CHUNK)


def read_all(handle: Any) -> tuple[list[tuple[int, Any]], list[int]]:
    """The records of ``handle`` and the sizes handed to the progress callback."""
    sizes: list[int] = []
    return list(transfer.read_records(handle, sizes.append)), sizes


def write_lines(path: Path, records: list[dict[str, Any]], end: str = "\n") -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + end for r in records), "utf-8")
    return path


class Capped(io.RawIOBase):
    """A file read through a guard: more than ``cap`` bytes read fails the test, so that a
    reader taking ``/dev/zero`` whole fails at once instead of taking the machine's memory."""

    def __init__(self, path: str, cap: int) -> None:
        self._file = open(path, "rb", buffering=0)  # noqa: SIM115 (closed with this one)
        self._left = cap

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        assert self._left > 0, "read past the guard: the input is being read whole"
        with memoryview(buffer) as view:
            got = self._file.readinto(view[: self._left])
        self._left -= got or 0
        return got or 0

    def close(self) -> None:
        self._file.close()
        super().close()


def test_dev_zero_is_refused_after_one_piece_as_binary_data() -> None:
    """``/dev/zero`` has no newline: read line by line, it grew to gigabytes and never said
    anything. The first piece shows a NUL byte, which JSON text never holds."""
    sizes: list[int] = []
    with (
        io.BufferedReader(Capped("/dev/zero", 64 * CHUNK)) as handle,
        pytest.raises(transfer.NotAnExportError, match=r"^line 1: holds a NUL byte: not a JSON"),
    ):
        next(transfer.read_records(handle, sizes.append))
    assert sizes == [CHUNK]  # one piece read, then refused


def test_binary_data_is_refused_at_its_first_nul(tmp_path: Path) -> None:
    good = {"id": "fine", "source": "cli", "started_at": 1.0}
    path = tmp_path / "mixed.jsonl"
    sqlite_header = b"SQLite format 3\x00\x10\x00\x02\x02\x00@  \x00\x00\x00\x01"
    path.write_bytes(json.dumps(good).encode() + b"\n" + sqlite_header)
    with open(path, "rb") as handle:
        records = transfer.read_records(handle, lambda _: None)
        assert next(records) == (1, good)
        with pytest.raises(transfer.NotAnExportError, match=r"^line 2: holds a NUL byte"):
            next(records)


@pytest.mark.parametrize(
    ("data", "first"),
    [
        (b"hello world\n", "'h'"),
        (b"   [1, 2, 3]\n", "'['"),
        (b'"a string"\n', "'\"'"),
        (b"\x89PNG\r\n", "'\\x89'"),
        (b"SQLite format 3", "'S'"),
    ],
)
def test_a_line_that_is_no_json_object_is_refused(data: bytes, first: str) -> None:
    with pytest.raises(transfer.NotAnExportError) as refused:
        read_all(io.BytesIO(data))
    assert str(refused.value) == (
        "line 1: not a JSON Lines export: every line is a JSON object ({...}), this one "
        f"starts with {first}"
    )
    assert isinstance(refused.value, InvalidInputError)


def test_a_long_line_that_is_no_object_is_refused_at_its_first_piece() -> None:
    """A file of 3 pieces' worth without a newline: refused once the first piece is read."""
    sizes: list[int] = []
    data = io.BytesIO(b"x" * (3 * CHUNK))
    with pytest.raises(transfer.NotAnExportError, match="starts with 'x'"):
        next(transfer.read_records(data, sizes.append))
    assert sizes == [CHUNK] and data.tell() == CHUNK


def test_a_line_over_the_cap_is_refused_before_more_is_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A valid JSON object, but over the cap: refused with at most the cap and one piece read
    (memory stays bounded by the cap); a line of exactly the cap is read whole."""
    monkeypatch.setattr(transfer, "MAX_LINE_BYTES", 4000)
    monkeypatch.setattr(transfer, "_LINE_CHUNK", 1000)
    start = '{"id": "a", "source": "cli", "started_at": 1.0, "title": "'
    at_cap = start + "x" * (4000 - len(start) - 2) + '"}'
    assert len(at_cap) == 4000
    over = at_cap[:-2] + 'y"}'
    data = io.BytesIO(f"{at_cap}\n{over}\n{'z' * 10_000}".encode())
    sizes: list[int] = []
    records = transfer.read_records(data, sizes.append)
    assert next(records)[0] == 1
    with pytest.raises(transfer.NotAnExportError) as refused:
        next(records)
    assert str(refused.value).startswith("line 2: longer than 4,000 bytes: not a JSON Lines")
    assert sum(sizes) == data.tell() <= 4001 + 4000 + 1000


def test_a_valid_export_imports_its_long_lines_in_pieces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lines of several pieces each (a small piece size), a blank line, a byte order mark and
    a last line without a newline: every record as written, the progress summing to the size."""
    monkeypatch.setattr(transfer, "_LINE_CHUNK", 4096)
    records = workers.export_records(sessions=6, per_session=10)
    body = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records[:-1])
    path = tmp_path / "export.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + body.encode() + b"\n  \n" + json.dumps(records[-1]).encode())
    assert max(len(line) for line in path.read_bytes().splitlines()) > 4 * 4096
    with open(path, "rb") as handle:
        read, sizes = read_all(handle)
    assert [record for _, record in read] == records
    assert [line for line, _ in read] == [1, 2, 3, 4, 5, 8]  # blank lines counted, skipped
    assert sum(sizes) == os.path.getsize(path) and max(sizes) <= 4096
    with SessionDB(tmp_path / "state.db") as store, open(path, "rb") as handle:
        report = transfer.import_sessions(
            store, transfer.read_records(handle, lambda _: None), batch_size=4
        )
        assert (report.sessions, report.messages) == (6, 60)
        assert store.export_session(records[3]["id"]) is not None


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (b"\x00" * 100, "holds a NUL byte"),
        (b"not an export\n", "starts with 'n'"),
    ],
    ids=["binary", "no object"],
)
def test_nothing_of_the_refused_batch_is_written(tmp_path: Path, bad: bytes, reason: str) -> None:
    good = {"id": "fine", "source": "cli", "started_at": 1.0}
    path = tmp_path / "in.jsonl"
    path.write_bytes(json.dumps(good).encode() + b"\n" + bad)
    with SessionDB(tmp_path / "state.db") as store, open(path, "rb") as handle:
        with pytest.raises(transfer.NotAnExportError, match=f"line 2: .*{reason}"):
            transfer.import_sessions(store, transfer.read_records(handle, lambda _: None))
        assert store.session_count() == 0
