"""The package root's public face: every error a caller may catch, every name the docs use."""

from __future__ import annotations

import builtins
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

import hermes_store
from hermes_store import errors

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _store_errors() -> list[str]:
    return sorted(
        name
        for name, value in vars(errors).items()
        if inspect.isclass(value)
        and issubclass(value, errors.HermesStoreError)
        and value.__module__ == errors.__name__
    )


@pytest.mark.parametrize("name", _store_errors())
def test_every_error_is_importable_from_the_root(name: str) -> None:
    assert name in hermes_store.__all__
    assert getattr(hermes_store, name) is getattr(errors, name)


def _names_in_docs() -> set[str]:
    """Names the docs tell callers to import from the root or to catch."""
    names: set[str] = set()
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for wrapped, line in re.findall(r"from hermes_store import (?:\(([^)]*)\)|([^\n]+))", text):
            names.update(part.strip() for part in (wrapped or line).split(",") if part.strip())
        names.update(re.findall(r"\b([A-Z]\w*Error)\b", text))
    not_ours = {n for n in names if hasattr(builtins, n)} | {"CancelledError"}
    return names - not_ours


def _importable(name: str) -> bool:
    """``from hermes_store import name`` works: a public name or a submodule."""
    try:
        exec(f"from hermes_store import {name}", {})
    except ImportError:
        return False
    return True


def test_the_docs_name_only_importable_things() -> None:
    names = _names_in_docs()
    assert "SchemaBehindError" in names  # the docs tell gateways to catch it
    missing = sorted(n for n in names if not _importable(n))
    assert missing == []


def _blocked(module: str, code: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter where ``module`` cannot be imported."""
    prelude = f"import sys; sys.modules[{module!r}] = None\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + code],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.parametrize(
    ("module", "code", "extra"),
    [
        (
            "psycopg",
            "from hermes_store import SessionDB; SessionDB('postgresql://u@127.0.0.1:1/db')",
            "postgresql",
        ),
        (
            "greenlet",
            "import asyncio\nfrom hermes_store import AsyncSessionDB\n"
            "async def main():\n"
            "    await AsyncSessionDB('postgresql://u@127.0.0.1:1/db').get_session('x')\n"
            "asyncio.run(main())",
            "async",
        ),
        (
            "pandas",
            "from hermes_store import analytics\n"
            "analytics.to_dataframe(analytics.totals(), 'postgresql://u@127.0.0.1:1/db')",
            "analytics",
        ),
    ],
    ids=["postgresql", "async", "analytics"],
)
def test_a_missing_extra_is_named(module: str, code: str, extra: str) -> None:
    code = (
        "from hermes_store import MissingExtraError\ntry:\n"
        + "".join(f"    {line}\n" for line in code.splitlines())
        + "except MissingExtraError as error:\n"
        "    assert isinstance(error, ImportError)\n"
        "    print(error)\n"
    )
    done = _blocked(module, code)
    assert done.returncode == 0, done.stderr
    assert f"pip install 'hermes-store[{extra}]'" in done.stdout


def test_the_cli_names_the_missing_extra() -> None:
    done = _blocked(
        "psycopg",
        "import sys\nfrom hermes_store.cli import main\n"
        "sys.argv = ['hermes-store', '--db', 'postgresql://u@127.0.0.1:1/db', 'stats']\nmain()",
    )
    assert done.returncode == 3
    assert done.stderr.strip() == (
        "Error: PostgreSQL needs its driver (psycopg 3): pip install 'hermes-store[postgresql]'"
    )
