"""How a SQLite file stores its text: ``PRAGMA encoding``, UTF-8 or UTF-16 (le or be), fixed
by whichever program made the file's first table (the original store adopts any of them).

SQLite converts text for every function and for the driver, but a text CAST AS BLOB (whose
length packs a context's role, :func:`.hits.context_columns`) and a blob handle
(:mod:`.blobs`) give the bytes as the file stores them: those are read with the file's codec,
chosen once per DB-API connection (:func:`of`), never per row.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy.engine import Connection

from hermes_store.search import hits

_KEY = "hermes_store.search.stored"


@dataclass(frozen=True)
class Stored:
    """A file's text encoding: Python's ``codec``, its ``decode`` function (as
    ``codecs.utf_8_decode``: bytes, errors, final) and the context's :data:`.hits.Unpack`."""

    codec: str
    decode: Callable[[bytes, str | None, bool], tuple[str, int]]
    unpack: hits.Unpack

    def octets(self, text: str) -> int:
        """``length(CAST(text AS BLOB))`` in this encoding."""
        return len(text.encode(self.codec))


UTF8 = Stored("utf-8", codecs.utf_8_decode, hits.unpack_utf8)
_BY_PRAGMA = {
    "UTF-8": UTF8,
    "UTF-16le": Stored("utf-16-le", codecs.utf_16_le_decode, hits.unpack_in("utf-16-le")),
    "UTF-16be": Stored("utf-16-be", codecs.utf_16_be_decode, hits.unpack_in("utf-16-be")),
}


def of(conn: Connection) -> Stored:
    """The encoding of ``conn``'s SQLite file, read once per DB-API connection (a file's
    encoding never changes once it has a table)."""
    info = conn.connection.info
    found: Stored | None = info.get(_KEY)
    if found is None:
        found = info[_KEY] = _BY_PRAGMA[conn.exec_driver_sql("PRAGMA encoding").scalar_one()]
    return found
