"""JSON text as the package writes it (exports, ``--json`` outputs, trajectory samples):
always valid JSON. (A caller's value for a JSON column holding NaN or an infinity is refused
instead: see ``store._to_json``.)

Python's :func:`json.dumps` writes a non-finite float as ``Infinity``, ``-Infinity`` or
``NaN``, which is not JSON: jq and most parsers refuse the whole document. A file the original
store wrote may hold such a float (an infinite cost in a REAL column), so every JSON the package
writes goes through :func:`dumps`, which writes it as ``null``. The usual value has no such
float and costs one ``json.dumps`` as before; only a refused one is walked and written again.
"""

from __future__ import annotations

import json
import math
from typing import Any


def dumps(value: Any, **options: Any) -> str:
    """:func:`json.dumps` of ``value`` (with ``options``), every non-finite float as ``null``."""
    try:
        return json.dumps(value, allow_nan=False, **options)
    except ValueError as error:
        if not str(error).startswith("Out of range float"):
            raise  # a circular reference, say: not ours to mend
    return json.dumps(finite(value), allow_nan=False, **options)


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
