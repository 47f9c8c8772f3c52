"""Operations on a whole database: ``backup`` (and restore), ``maintenance`` (index merges,
freed pages, offline vacuum), ``retention`` (what a prune deletes, and the chunked job) and
``health`` (the doctor's checks).

Each takes what it uses (a unit of work, an engine), never the ``SessionDB`` facade above it.
May import: ``hermes_store.search``, ``hermes_store.repo``, ``hermes_store.schema``,
``hermes_store.uow``, ``hermes_store.engine`` and the leaves.
"""

__all__: list[str] = []
