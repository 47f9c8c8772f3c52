"""The built wheel carries the Alembic revisions: an upgrade works from the installed package
alone, from a folder that is not the checkout.

The wheel is built with pip (hatchling comes from pip's build isolation, or from the
environment when it is installed there), unpacked as an installer would, and imported by a
fresh interpreter whose path holds only the unpacked wheel and this environment's
site-packages (for SQLAlchemy and Alembic), without ``site``'s .pth files, so the editable
install of the checkout is not visible.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.support.migration_checks import HEAD, REPO, REVISIONS

PROBE = """
import json, sqlite3, sys
import hermes_store
from hermes_store.schema.revisions import script_location
from hermes_store.schema.revisions import script_location
from hermes_store.schema import migrate
path = sys.argv[1]
revision = hermes_store.upgrade(path)
con = sqlite3.connect(path)
version = con.execute("SELECT version FROM schema_version").fetchone()[0]
con.close()
print(json.dumps({
    "package": hermes_store.__file__,
    "scripts": script_location(),
    "revision": revision,
    "current": hermes_store.current(path),
    "schema_version": version,
}))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build the project's wheel once for this module."""
    out = tmp_path_factory.mktemp("wheel")
    command = [sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "-q", "-w", str(out)]
    if importlib.util.find_spec("hatchling") is not None:
        command.append("--no-build-isolation")  # offline when the backend is at hand
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    (built,) = out.glob("hermes_store-*.whl")
    return built


def test_wheel_ships_the_revisions(wheel: Path) -> None:
    """env.py, the template and all six revisions are inside, under migrations."""
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    inside = {n for n in names if n.startswith("hermes_store/migrations/")}
    assert "hermes_store/migrations/env.py" in inside
    assert {f"hermes_store/migrations/versions/{r}.py" for r in REVISIONS} <= inside
    # the checkout's pointer package is replaced by the revisions themselves
    pointer = (REPO / "hermes_store" / "migrations" / "__init__.py").read_bytes()
    with zipfile.ZipFile(wheel) as archive:
        assert archive.read("hermes_store/migrations/__init__.py") != pointer
    assert not any(n.startswith("migrations/") for n in names)  # not a stray top-level package
    assert not any("__pycache__" in n or n.startswith("tests/") for n in names)


def test_upgrade_from_installed_wheel_outside_checkout(wheel: Path, tmp_path: Path) -> None:
    """A fresh interpreter importing hermes_store from the unpacked wheel, in a folder that is
    not the checkout, finds the revisions inside the package and upgrades a new file to head."""
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    work = tmp_path / "elsewhere"
    work.mkdir()
    dependencies = sysconfig.get_paths()["purelib"]
    env = {
        "PYTHONPATH": os.pathsep.join([str(site), dependencies]),
        "PATH": "/usr/bin:/bin",
        "HOME": str(work),
    }
    result = subprocess.run(
        [sys.executable, "-S", "-c", PROBE, str(work / "state.db")],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert Path(report["package"]).is_relative_to(site)
    assert Path(report["scripts"]) == site / "hermes_store" / "migrations"
    assert report["revision"] == report["current"] == HEAD
    assert report["schema_version"] == 6


def test_alembic_from_installed_wheel_online_and_offline(wheel: Path, tmp_path: Path) -> None:
    """``python -m hermes_store.migrations`` (Alembic's command line with the packaged ini)
    upgrades a database and prints offline SQL, importing only the unpacked wheel."""
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {
        "PYTHONPATH": os.pathsep.join([str(site), sysconfig.get_paths()["purelib"]]),
        "PATH": "/usr/bin:/bin",
        "HOME": str(work),
    }
    module = [sys.executable, "-S", "-m", "hermes_store.migrations"]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*module, *args], cwd=work, env=env, capture_output=True, text=True, timeout=120
        )

    ini = run("--ini")
    assert ini.returncode == 0, ini.stderr
    assert Path(ini.stdout.strip()) == site / "hermes_store" / "migrations" / "alembic.ini"
    online = run("-x", f"url={work / 'state.db'}", "upgrade", "head")
    assert online.returncode == 0, online.stderr
    assert f"-> {HEAD}" in online.stderr
    offline = run("-x", "url=postgresql+psycopg://nobody@127.0.0.1:1/x", "upgrade", "head", "--sql")
    assert offline.returncode == 0, offline.stderr
    assert "CREATE INDEX IF NOT EXISTS ix_messages_content_fts" in offline.stdout
