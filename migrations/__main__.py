"""``python -m hermes_store.migrations ARGS``: Alembic's command line with the packaged config.

``--ini`` prints the packaged ``alembic.ini`` path, for ``alembic -c "$(...)" ...``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from alembic.config import main as alembic_main

INI = Path(__file__).resolve().parent / "alembic.ini"


def run(argv: list[str]) -> None:
    if argv == ["--ini"]:
        print(INI)
        return
    alembic_main(argv=["-c", str(INI), *argv], prog="python -m hermes_store.migrations")


if __name__ == "__main__":
    run(sys.argv[1:])
