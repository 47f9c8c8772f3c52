"""Misuse that the row types must make mypy reject (tests/store/test_typing.py expects 3 errors)."""

from __future__ import annotations

from hermes_store import SessionDB


def misuse(db: SessionDB) -> None:
    row = db.get_session("s")
    assert row is not None
    tokens: str = row["input_tokens"]  # an int | None, not a str
    print(row["no_such_column"])  # not a column
    for hit in db.search_messages("x"):
        print(hit["snipet"])  # a typo of "snippet"
    print(tokens)
