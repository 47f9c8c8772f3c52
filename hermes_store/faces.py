"""Public faces of the layer packages: names that load on first use (PEP 562).

Each layer package (``hermes_store.engine``, ``hermes_store.uow`` ...) re-exports its public
names from the module that defines them, without importing that module until a name is used:
``import hermes_store.engine.files`` must not pay for SQLAlchemy's engine machinery, and a
store opened at head must not import Alembic.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(
    package: str, defined_in: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: each public name -> its submodule.

    An unknown name raises ``AttributeError``, so ``from package import submodule`` still
    finds a submodule.
    """
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str) -> Any:
        module = defined_in.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *defined_in})

    return __getattr__, __dir__
