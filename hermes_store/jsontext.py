"""JSON text as the package writes it (exports, ``--json`` outputs, trajectory samples):
always valid JSON. (A caller's value for a JSON column holding NaN or an infinity is refused
instead: see ``store._to_json``.)

Python's :func:`json.dumps` writes a non-finite float as ``Infinity``, ``-Infinity`` or
``NaN``, which is not JSON: jq and most parsers refuse the whole document. A file the original
store wrote may hold such a float (an infinite cost in a REAL column), so every JSON the package
writes goes through :func:`dumps`, which writes it as ``null``. The usual value has no such
float and costs one ``json.dumps`` as before; only a refused one is walked and written again.

The same file may hold a blob in any column (SQLite's dynamic typing), which JSON has no type
for: :func:`dumps` writes it as a marked object, ``{"$sqlite": "blob", "base64": ...}``
(:func:`stored`), so it is shown whole instead of failing the whole document.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Callable
from typing import Any

#: The key of an object that stands for a stored value JSON has no plain form for.
MARKER = "$sqlite"


def stored(kind: str, value: Any) -> dict[str, Any]:
    """The marked object standing for a value of SQLite storage class ``kind`` (``"blob"``,
    ``"real"``, ``"text"``, ``"integer"``): a blob's bytes in base64, a non-finite real as
    ``"Infinity"``, ``"-Infinity"`` or ``"NaN"``, any other value as it is."""
    if isinstance(value, bytes | bytearray | memoryview):
        return {MARKER: "blob", "base64": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, float) and not math.isfinite(value):
        return {MARKER: kind, "value": json.dumps(value)}  # the name JSON text has for it
    return {MARKER: kind, "value": value}


def dumps(value: Any, **options: Any) -> str:
    """:func:`json.dumps` of ``value`` (with ``options``), every non-finite float as ``null``
    and every blob as a marked object (:func:`stored`)."""
    options["default"] = _with_blobs(options.get("default"))
    try:
        return json.dumps(value, allow_nan=False, **options)
    except ValueError as error:
        if not str(error).startswith("Out of range float"):
            raise  # a circular reference, say: not ours to mend
    return json.dumps(finite(value), allow_nan=False, **options)


def _with_blobs(default: Callable[[Any], Any] | None) -> Callable[[Any], Any]:
    """A ``default`` for :func:`json.dumps` that writes blobs marked, anything else as the
    caller's ``default`` does (a ``TypeError`` without one, as json's own)."""

    def write(value: Any) -> Any:
        if isinstance(value, bytes | bytearray | memoryview):
            return stored("blob", value)
        if default is None:
            raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")
        return default(value)

    return write


def finite(value: Any) -> Any:
    """``value`` with every non-finite float inside dicts, lists and tuples replaced by None
    (a non-finite float key by the name JSON text has for it, a string)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {_key(key): finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite(item) for item in value]
    return value


def _key(key: Any) -> Any:
    if isinstance(key, float) and not math.isfinite(key):
        return json.dumps(key)  # 'Infinity', '-Infinity' or 'NaN': a string key is JSON
    return key
