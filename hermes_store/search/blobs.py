"""SQLite contents read through read-only blob handles, only as far as a snippet or a context
needs: SQLite loads a whole value for any function of it (50 MB for a pasted log, whether it is
the match or its neighbour). The bytes are as the file stores them: decoded with its encoding
(:class:`.stored.Stored`)."""

from __future__ import annotations

import codecs
import re
import sqlite3
from collections.abc import Sequence
from typing import TYPE_CHECKING

from sqlalchemy.engine import Connection

from hermes_store.search.snippets import SNIPPET_INLINE_CHARS, SNIPPET_REACH, SNIPPET_SEARCH_CHARS

if TYPE_CHECKING:
    from hermes_store.search.stored import Stored

_BLOB_CHUNK = 64 * 1024


def driver(conn: Connection) -> sqlite3.Connection:
    """The sqlite3 connection under a SQLite read unit (blob handles live there)."""
    raw = conn.connection.driver_connection
    assert isinstance(raw, sqlite3.Connection)
    return raw


def content_prefix(raw: sqlite3.Connection, message_id: int, chars: int, stored: Stored) -> str:
    """The first ``chars`` characters of a content ("" for NULL), reading at most 4 bytes each
    (UTF-8, or UTF-16's surrogate pairs)."""
    try:
        blob = raw.blobopen("messages", "content", message_id, readonly=True)
    except sqlite3.OperationalError as error:
        if "of type null" not in str(error):
            raise
        return ""
    with blob:
        data = blob.read(chars * 4)
        complete = blob.tell() >= len(blob)
    # The incremental decoder's own function: a character cut at the read's end is held
    # back, not replaced, unless the value ends there (no decoder object made per call).
    return stored.decode(data, "replace", complete)[0][:chars]


def read_content(
    raw: sqlite3.Connection, message_id: int, patterns: Sequence[re.Pattern[str]], stored: Stored
) -> tuple[str, bool]:
    """A message's content, in chunks, only as far as a bounded snippet needs (the first match
    and its window); and whether that is the whole content."""
    try:
        blob = raw.blobopen("messages", "content", message_id, readonly=True)
    except sqlite3.OperationalError as error:
        if "of type null" not in str(error):
            raise
        return "", True
    with blob:
        size = len(blob)
        if size <= SNIPPET_INLINE_CHARS * 4:
            return blob.read().decode(stored.codec, "replace"), True
        decoder = codecs.getincrementaldecoder(stored.codec)("replace")
        text, searched, first = "", 0, None
        while True:
            chunk = blob.read(_BLOB_CHUNK)
            done = blob.tell() >= size or not chunk
            text += decoder.decode(chunk, final=done)
            if first is None:
                start = max(0, searched - 1_000)  # a match across the chunk boundary
                hits = [m.start() for p in patterns if (m := p.search(text, start))]
                first = min(hits) if hits else None
                searched = len(text)
            if done:
                return text, True
            if first is None and len(text) >= SNIPPET_SEARCH_CHARS:
                return text, False
            if first is not None and len(text) >= first + SNIPPET_REACH * 2:
                return text, False
