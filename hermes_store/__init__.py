"""hermes_store: the persistence layer of the Hermes agent.

``SessionDB`` is a drop-in for the original store's; :mod:`hermes_store.models` holds the ORM
models, :mod:`hermes_store.uow` the Unit of Work, :mod:`hermes_store.schema` the migrations;
``docs/architecture.md`` shows every layer.

The names below load on first use (PEP 562), so ``import hermes_store.cli`` (and so
``hermes-store --help``) does not pay for SQLAlchemy and Alembic; ``from hermes_store import
SessionDB`` works as before.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hermes_store.aio import AsyncSessionDB
    from hermes_store.engine.factory import create_engine, default_db_path
    from hermes_store.errors import (
        AccessDeniedError,
        DatabaseAliasError,
        DatabaseLockedError,
        DatabaseUnavailableError,
        EngineSettingsError,
        ForkedProcessError,
        HermesStoreError,
        InvalidInputError,
        MissingExtraError,
        NotADatabaseError,
        ReadOnlyDatabaseError,
        ReadOnlyUnitError,
        SchemaBehindError,
        SchemaError,
        SchemaTooNewError,
        SharedStoreMismatchError,
        StorageFullError,
        StorageIOError,
        StoreConfigError,
        StoreMisuseError,
        TitleInUseError,
        TitleTooLongError,
        TransactionMisuseError,
        UndecodableTextError,
        UnknownSessionError,
        UnrecognizedSchemaError,
        UnsafePathError,
        UnsupportedEngineError,
        WalDeletedError,
        WriteNotLandedError,
        WriteOutcomeUnknownError,
        WriteRefusedError,
    )
    from hermes_store.models import Base, ChatSession, Message, SchemaVersion
    from hermes_store.schema.migrate import current, downgrade, upgrade
    from hermes_store.store import SessionDB, open_store
    from hermes_store.titles import MAX_TITLE_LENGTH
    from hermes_store.trajectory import (
        convert_scratchpad_to_think,
        has_incomplete_scratchpad,
        save_trajectory,
    )
    from hermes_store.uow.unit import RetryPolicy, StoreStats, UnitOfWork

#: Public name -> the module that defines it.
_LAZY = {
    "AsyncSessionDB": "aio",
    "create_engine": "engine.factory",
    "default_db_path": "engine.factory",
    **dict.fromkeys(
        (
            "AccessDeniedError",
            "DatabaseLockedError",
            "DatabaseUnavailableError",
            "HermesStoreError",
            "InvalidInputError",
            "MissingExtraError",
            "NotADatabaseError",
            "ReadOnlyDatabaseError",
            "SchemaBehindError",
            "SchemaError",
            "SchemaTooNewError",
            "StorageFullError",
            "StorageIOError",
            "TitleInUseError",
            "TitleTooLongError",
            "UnknownSessionError",
            "UnrecognizedSchemaError",
            "EngineSettingsError",
            "ReadOnlyUnitError",
            "SharedStoreMismatchError",
            "StoreConfigError",
            "UnsupportedEngineError",
            "UnsafePathError",
            "ForkedProcessError",
            "WalDeletedError",
            "StoreMisuseError",
            "TransactionMisuseError",
            "DatabaseAliasError",
            "WriteNotLandedError",
            "WriteOutcomeUnknownError",
            "UndecodableTextError",
            "WriteRefusedError",
        ),
        "errors",
    ),
    "current": "schema.migrate",
    "downgrade": "schema.migrate",
    "upgrade": "schema.migrate",
    "Base": "models",
    "ChatSession": "models",
    "Message": "models",
    "SchemaVersion": "models",
    "SessionDB": "store",
    "open_store": "store",
    "MAX_TITLE_LENGTH": "titles",
    "convert_scratchpad_to_think": "trajectory",
    "has_incomplete_scratchpad": "trajectory",
    "save_trajectory": "trajectory",
    "RetryPolicy": "uow.unit",
    "StoreStats": "uow.unit",
    "UnitOfWork": "uow.unit",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hermes_store' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"hermes_store.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "MAX_TITLE_LENGTH",
    "AccessDeniedError",
    "AsyncSessionDB",
    "Base",
    "ChatSession",
    "DatabaseAliasError",
    "DatabaseLockedError",
    "DatabaseUnavailableError",
    "EngineSettingsError",
    "ForkedProcessError",
    "HermesStoreError",
    "InvalidInputError",
    "Message",
    "MissingExtraError",
    "NotADatabaseError",
    "ReadOnlyDatabaseError",
    "ReadOnlyUnitError",
    "RetryPolicy",
    "SchemaBehindError",
    "SchemaError",
    "SchemaTooNewError",
    "SchemaVersion",
    "SessionDB",
    "SharedStoreMismatchError",
    "StorageFullError",
    "StorageIOError",
    "StoreConfigError",
    "StoreMisuseError",
    "StoreStats",
    "TitleInUseError",
    "TitleTooLongError",
    "TransactionMisuseError",
    "UndecodableTextError",
    "UnitOfWork",
    "UnknownSessionError",
    "UnrecognizedSchemaError",
    "UnsafePathError",
    "UnsupportedEngineError",
    "WalDeletedError",
    "WriteNotLandedError",
    "WriteOutcomeUnknownError",
    "WriteRefusedError",
    "convert_scratchpad_to_think",
    "create_engine",
    "current",
    "default_db_path",
    "downgrade",
    "has_incomplete_scratchpad",
    "open_store",
    "save_trajectory",
    "upgrade",
]
