"""The command line with standard streams it cannot use: closed by the caller (``>&-``,
``<&-``, ``2>&-``), a full device (``>/dev/full``), a reader gone before anything is written.
No traceback ever: a closed stream is /dev/null (the command does its work, its output goes
nowhere), a failed write of the output is one line on stderr and an exit code, and the
top-level ``--help``/``--version`` get the same answer as a subcommand's.

Every case runs the real command line in a child process: only a real process has real
standard descriptors to close or point at a device.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hermes_store import SessionDB
from tests.support.cli_process import RUN_CLI

TIMEOUT = 120  # a hang guard only
FULL = Path("/dev/full")
#: What a failed write of the output says: the output, not the database, is what failed.
OUTPUT_FULL = "Error: could not write the output: No space left on device"


@pytest.fixture
def path(tmp_path: Path) -> Path:
    """A store with one session (id ``s1``, one message holding ``hello``)."""
    target = tmp_path / "state.db"
    with SessionDB(target) as db:
        db.create_session("s1", "cli")
        db.append_message("s1", "user", "hello from the first session")
    return target


def _env() -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k not in ("HERMES_STORE_URL", "COLUMNS")}
    return {**base, "NO_COLOR": "1"}


def _closing(*fds: int) -> Callable[[], None]:
    """A ``preexec_fn`` that closes ``fds`` in the child, as the shell's ``N>&-`` does."""

    def close() -> None:
        for fd in fds:
            os.close(fd)

    return close


def _cli(*args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    kwargs.setdefault("stdout", subprocess.PIPE)
    kwargs.setdefault("stderr", subprocess.PIPE)
    kwargs.setdefault("stdin", subprocess.DEVNULL)
    kwargs.setdefault("env", _env())
    return subprocess.run(
        [sys.executable, "-c", RUN_CLI, *args],
        text=True,
        timeout=TIMEOUT,
        check=False,
        **kwargs,
    )


def _title(path: Path) -> str | None:
    with SessionDB(path) as db:
        row = db.get_session("s1")
    assert row is not None
    return row.get("title")


# -- a closed stdout -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "command",
    [
        ["stats"],
        ["sessions", "list"],
        ["sessions", "show", "s1"],
        ["search", "hello"],
        ["db", "current"],
    ],
    ids=" ".join,
)
def test_a_command_with_stdout_closed_runs_without_a_traceback(
    path: Path, command: list[str]
) -> None:
    done = _cli("--db", str(path), *command, stdout=None, preexec_fn=_closing(1))
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 0, done.stderr


def test_a_write_with_stdin_stdout_and_stderr_closed_is_done(path: Path) -> None:
    """The rename lands, and its exit code says so, with no stream to read or write."""
    done = _cli(
        "--db",
        str(path),
        "sessions",
        "rename",
        "s1",
        "renamed with every stream closed",
        stdin=None,
        stdout=None,
        stderr=None,
        preexec_fn=_closing(0, 1, 2),
    )
    assert done.returncode == 0
    assert _title(path) == "renamed with every stream closed"


def test_a_confirmation_with_stdin_closed_is_refused_in_one_line(path: Path) -> None:
    """No terminal to ask: refused as from a pipe (exit 1, one line), nothing deleted."""
    done = _cli("--db", str(path), "sessions", "delete", "s1", stdin=None, preexec_fn=_closing(0))
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "Error: refusing to delete session s1 without confirmation: pass --yes (no terminal to ask)"
    ]
    with SessionDB(path) as db:
        assert db.get_session("s1") is not None


# -- stdout on a full device, or read by no one ------------------------------------------------


def _to_full(*args: str) -> subprocess.CompletedProcess[str]:
    with FULL.open("w") as full:
        return _cli(*args, stdout=full)


@pytest.mark.skipif(not FULL.exists(), reason="no /dev/full on this system")
@pytest.mark.parametrize("option", ["--help", "-h", "--version"])
def test_top_level_help_and_version_on_a_full_device_answer_as_a_subcommand_does(
    option: str,
) -> None:
    subcommand = _to_full("stats", "--help")  # the error boundary's answer, for comparison
    assert subcommand.returncode == 3
    assert subcommand.stderr.strip() == OUTPUT_FULL

    done = _to_full(option)

    assert "Traceback" not in done.stderr, done.stderr
    assert (done.returncode, done.stderr) == (subcommand.returncode, subcommand.stderr)


@pytest.mark.skipif(not FULL.exists(), reason="no /dev/full on this system")
@pytest.mark.parametrize("args", [("--help",), ("stats", "--help"), ("--version",)])
def test_output_left_in_a_buffer_on_a_full_device_is_one_error(args: tuple[str, ...]) -> None:
    """With stdout block-buffered (no ``PYTHONUNBUFFERED``, as in CI), click's write leaves the
    text in the buffer and the failure came at the interpreter's last flush: "Exception
    ignored ... OSError" and exit 120, after the error boundary had said its line."""
    env = {k: v for k, v in _env().items() if k != "PYTHONUNBUFFERED"}
    with FULL.open("w") as full:
        done = _cli(*args, stdout=full, env=env)
    assert (done.returncode, done.stderr) == (3, OUTPUT_FULL + "\n")


@pytest.mark.skipif(not FULL.exists(), reason="no /dev/full on this system")
@pytest.mark.parametrize(
    "args", [("sessions", "list"), ("export", "-o", "-"), ("sessions", "show", "s1")]
)
def test_a_command_whose_output_meets_a_full_device_says_so(
    path: Path, args: tuple[str, ...]
) -> None:
    """One line naming the output, exit 3, whether the write failed as the command ran or at
    the last flush (block-buffered stdout, as in CI); the database is untouched."""
    for env in (_env(), {k: v for k, v in _env().items() if k != "PYTHONUNBUFFERED"}):
        with FULL.open("w") as full:
            done = _cli("--db", str(path), *args, stdout=full, env=env)
        assert (done.returncode, done.stderr) == (3, OUTPUT_FULL + "\n"), done.stderr
    with SessionDB(path) as db:
        assert db.message_count("s1") == 1


@pytest.mark.parametrize("option", ["--help", "--version"])
def test_top_level_help_to_a_reader_gone_ends_quietly_as_a_command_does(option: str) -> None:
    """``hermes-store --help | head -0``: as for any command's output, a reader that left is
    not an error (exit 0, nothing on stderr)."""
    read, write = os.pipe()
    os.close(read)
    try:
        done = _cli(option, stdout=write)
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (0, "")


@pytest.mark.parametrize("name", ["stdin", "stdout", "stderr"])
def test_a_missing_standard_stream_is_no_terminal(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Called without :func:`main` (an application running ``cli`` itself, with a stream
    closed): Python's None for the stream is no terminal, not an AttributeError."""
    from hermes_store.cli import app, output

    asks = {
        "stdin": app.stdin_is_terminal,
        "stdout": output.stdout_is_terminal,
        "stderr": app.stderr_is_terminal,
    }
    monkeypatch.setattr(sys, name, None)
    assert asks[name]() is False
    if name == "stderr":
        assert type(output.progress(None, "copying")).__name__ == "_NoProgress"
