"""Every documented example runs, and every CLI command is documented.

Each page runs in document order in a fresh home (``HOME`` and ``HERMES_HOME`` in tmp_path)
whose default ``state.db`` is a file the original store left at schema_version 3, as a new
user upgrading the agent would have it: ``python`` blocks run in one namespace per page,
and ``hermes-store`` / ``python -m hermes_store`` lines of ``bash`` blocks run through
click's CliRunner (``alembic`` lines as a subprocess; of a pipeline, the CLI part runs).
``export NAME=value`` lines apply to the rest of their block. The placeholder PostgreSQL URL
is replaced by the test server's database, and what needs it is skipped when there is none.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from sqlalchemy.engine import URL

from hermes_store.cli import cli
from tests.support import legacy
from tests.support.backends import reset_pg, url_string

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PYTHON_PAGES = [README, ROOT / "docs" / "analytics.md", ROOT / "docs" / "architecture.md"]
COMMAND_PAGES = sorted({README, *PYTHON_PAGES, *(ROOT / "docs").glob("*.md")})
PG_PLACEHOLDER = "postgresql+psycopg://hermes@localhost/hermes"
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
QUICKSTART = (
    "python3 -m venv .venv && . .venv/bin/activate && pip install -e . "
    "&& hermes-store db upgrade && hermes-store doctor"
)
TEST_COMMAND = "pip install -e '.[test]' && pytest -n auto"
PACKAGED_INI_WORD = "$(python -m hermes_store.migrations --ini)"
PACKAGED_INI = ROOT / "migrations" / "alembic.ini"


def code_blocks(page: Path) -> list[tuple[str, str]]:
    """(language, body) of every fenced block, in order."""
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(page.read_text(encoding="utf-8"))]


def shell_commands(body: str) -> Iterator[list[str]]:
    """Each simple command of a shell block (continuations joined, ``&&``/``;`` split)."""
    text = re.sub(r"\\\n", " ", body)
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        lexer = shlex.shlex(line.strip().removeprefix("$ "), posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words = list(lexer)
        command: list[str] = []
        for word in [*words, "&&"]:
            if word in ("&&", ";", "||"):
                if command:
                    yield command
                command = []
            else:
                command.append(word)


def cli_args(words: list[str]) -> list[str] | None:
    """The arguments when ``words`` runs the CLI, else None."""
    if words[0] == "hermes-store":
        return words[1:]
    if words[:3] == ["python", "-m", "hermes_store"]:
        return words[3:]
    return None


def command_paths(group: click.Group, prefix: str = "") -> Iterator[str]:
    for name, command in sorted(group.commands.items()):
        path = f"{prefix}{name}"
        if isinstance(command, click.Group):
            yield from command_paths(command, path + " ")
        else:
            yield path


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A new user's machine: ~ and ~/.hermes in tmp_path, with the agent's old state.db."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("HERMES_HOME", str(tmp_path / ".hermes"))
    monkeypatch.delenv("HERMES_STORE_URL", raising=False)
    monkeypatch.chdir(tmp_path)
    legacy.build_legacy_db(tmp_path / ".hermes" / "state.db", 3)
    return tmp_path


def _redirect(words: list[str]) -> tuple[list[str], str | None]:
    """``... > FILE``: the command without the redirection, and the file."""
    if len(words) > 2 and words[-2] == ">":
        return words[:-2], words[-1]
    return words, None


def run_shell_block(body: str, pg_url: str | None, home: Path) -> int:
    """Run the block's CLI and alembic commands; returns how many ran."""
    env: dict[str, str | None] = {"COLUMNS": "160", "NO_COLOR": "1"}
    ran = 0
    for words in shell_commands(body):
        line = " ".join(words)
        if PG_PLACEHOLDER in line:
            if pg_url is None:
                continue
            words = [w.replace(PG_PLACEHOLDER, pg_url) for w in words]
        if words[0] == "export":
            name, _, value = words[1].partition("=")
            env[name] = value
            continue
        if "|" in words:  # a pipeline: the CLI part runs; grep and cut are the reader's
            words = words[: words.index("|")]
        args = cli_args(words)
        if args is not None:
            result = CliRunner(env=env).invoke(cli, args, catch_exceptions=False)
            assert result.exit_code == 0, f"`{line}` exited {result.exit_code}:\n{result.output}"
            ran += 1
        elif words[0] == "alembic" or words[:3] == ["python", "-m", "hermes_store.migrations"]:
            words, output = _redirect(words)
            if words[0] == "alembic":
                words = [w.replace(PACKAGED_INI_WORD, str(PACKAGED_INI)) for w in words]
                config = [] if "-c" in words else ["-c", str(ROOT / "alembic.ini")]
                argv = [sys.executable, "-m", "alembic", *config, *words[1:]]
            else:
                argv = [sys.executable, *words[1:]]
            full_env = {**os.environ, **{k: v for k, v in env.items() if v is not None}}
            done = subprocess.run(
                argv, cwd=home, env=full_env, capture_output=True, text=True, timeout=120
            )
            assert done.returncode == 0, f"`{line}` failed:\n{done.stdout}{done.stderr}"
            if output is not None:
                (home / output).write_text(done.stdout, encoding="utf-8")
            ran += 1
    return ran


@pytest.mark.parametrize("page", COMMAND_PAGES, ids=lambda p: p.name)
def test_every_example_runs(page: Path, home: Path, pg_worker_url: URL | None) -> None:
    pg_url = url_string(pg_worker_url) if pg_worker_url is not None else None
    if pg_worker_url is not None:
        reset_pg(pg_worker_url)
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem}"}
    ran = 0
    for number, (language, body) in enumerate(code_blocks(page), 1):
        if language in ("bash", "sh", "shell", "console"):
            ran += run_shell_block(body, pg_url, home)
        elif language == "python" and page in PYTHON_PAGES:
            if PG_PLACEHOLDER in body:
                if pg_url is None:
                    continue
                body = body.replace(PG_PLACEHOLDER, pg_url)
            exec(compile(body, f"{page.name} block {number}", "exec"), namespace)
            ran += 1
    for value in namespace.values():  # close what the examples opened
        close = getattr(value, "close", None)
        if callable(close) and type(value).__name__ == "SessionDB":
            close()
    if page in PYTHON_PAGES[:2]:
        assert ran > 5, f"{page.name}: only {ran} examples found"


def test_readme_documents_every_command() -> None:
    text = README.read_text(encoding="utf-8")
    reference = text[text.index("## CLI reference") :]
    missing = [p for p in command_paths(cli) if f"hermes-store {p}" not in reference]
    assert not missing, f"commands missing from the README's CLI reference: {missing}"
    assert "hermes-store sessions list" in reference  # the walk found the groups


def test_readme_states_the_two_fresh_machine_commands() -> None:
    blocks = [body.strip() for language, body in code_blocks(README) if language == "bash"]
    assert QUICKSTART in blocks and TEST_COMMAND in blocks


def test_shell_parser() -> None:
    assert list(shell_commands("$ a b && c 'd e' # note\n# skip\nx \\\n  y; z\n")) == [
        ["a", "b"],
        ["c", "d e"],
        ["x", "y"],
        ["z"],
    ]
    assert cli_args(["python", "-m", "hermes_store", "doctor"]) == ["doctor"]
    assert cli_args(["pip", "install"]) is None
