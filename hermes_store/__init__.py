"""hermes_store: the persistence layer of the Hermes agent.

``SessionDB`` is a drop-in for the seed's store; :mod:`hermes_store.models` holds the ORM
models, :mod:`hermes_store.uow` the Unit of Work, :mod:`hermes_store.migrate` the migrations.
"""

from hermes_store.engine import create_engine, default_db_path
from hermes_store.errors import (
    DatabaseLockedError,
    DatabaseUnavailableError,
    EngineSettingsError,
    HermesStoreError,
    InvalidInputError,
    NotADatabaseError,
    ReadOnlyDatabaseError,
    ReadOnlyUnitError,
    SchemaError,
    SchemaTooNewError,
    SharedStoreMismatchError,
    StorageFullError,
    StoreConfigError,
    TitleInUseError,
    TitleTooLongError,
    UnknownSessionError,
    UnrecognizedSchemaError,
    UnsupportedEngineError,
)
from hermes_store.migrate import current, downgrade, upgrade
from hermes_store.models import Base, ChatSession, Message, SchemaVersion
from hermes_store.store import SessionDB, open_store
from hermes_store.titles import MAX_TITLE_LENGTH
from hermes_store.trajectory import (
    convert_scratchpad_to_think,
    has_incomplete_scratchpad,
    save_trajectory,
)
from hermes_store.uow import RetryPolicy, StoreStats, UnitOfWork

__all__ = [
    "MAX_TITLE_LENGTH",
    "Base",
    "ChatSession",
    "DatabaseLockedError",
    "DatabaseUnavailableError",
    "EngineSettingsError",
    "HermesStoreError",
    "InvalidInputError",
    "Message",
    "NotADatabaseError",
    "ReadOnlyDatabaseError",
    "ReadOnlyUnitError",
    "RetryPolicy",
    "SchemaError",
    "SchemaTooNewError",
    "SchemaVersion",
    "SessionDB",
    "SharedStoreMismatchError",
    "StorageFullError",
    "StoreConfigError",
    "StoreStats",
    "TitleInUseError",
    "TitleTooLongError",
    "UnitOfWork",
    "UnknownSessionError",
    "UnrecognizedSchemaError",
    "UnsupportedEngineError",
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
