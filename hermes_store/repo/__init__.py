"""Statements per backend: what a unit runs, on the connection it is given.

``listing`` lists sessions (the rich list, compression chains, children); ``pgstream`` streams
exports and imports through psycopg on PostgreSQL. Nothing here begins or commits: the caller's
unit owns the transaction. May import: ``hermes_store.schema``, ``hermes_store.uow``,
``hermes_store.engine`` and the leaves.
"""

__all__: list[str] = []
