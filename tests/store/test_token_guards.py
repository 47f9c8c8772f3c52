"""``update_token_counts``' 64-bit guard: SQLite's statement bounds each counter with a nonzero
increment (a WHERE condition computed from the increment) and tells an overflow (refused,
nothing written) from an unknown session (a no-op) when no row changed.

The cases an exact guard must keep: a counter the original store already turned into a REAL
is left alone by an increment of 0, refused by a nonzero one; a counter holding text counts
as SQLite's ``+`` reads it, as in the original store; every counter's bound holds on its own;
the refusal leaves the row, and a ``transaction()`` block's other writes, as they were until
the block decides.
"""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

import pytest

from hermes_store import InvalidInputError, SessionDB
from tests.support.seed_store import SeedSessionDB

pytestmark = pytest.mark.unit

TOP = 2**63 - 1
BOTTOM = -(2**63)


def _counters(db: SessionDB, session_id: str = "s") -> tuple[object, ...]:
    row = db.get_session(session_id)
    assert row is not None
    return tuple(
        row[name]
        for name in (
            "input_tokens",
            "output_tokens",
            "cache_read_tokens",
            "cache_write_tokens",
            "reasoning_tokens",
            "estimated_cost_usd",
        )
    )


_RAW_SET = {
    "input_tokens": "UPDATE sessions SET input_tokens = ? WHERE id = 's'",
    "reasoning_tokens": "UPDATE sessions SET reasoning_tokens = ? WHERE id = 's'",
}


def _raw_set(db: SessionDB, column: str, value: object) -> None:
    """Write a counter as another program (the original store) could have left it."""
    path = db.engine.url.database
    assert path is not None
    raw = sqlite3.connect(path)
    with raw:
        raw.execute(_RAW_SET[column], (value,))
    raw.close()


@pytest.mark.parametrize(
    ("name", "start", "step"),
    [
        ("input_tokens", TOP - 5, 6),
        ("output_tokens", BOTTOM + 5, -6),
        ("cache_read_tokens", TOP, 1),
        ("cache_write_tokens", BOTTOM, -1),
        ("reasoning_tokens", 1, TOP),
    ],
)
def test_each_counter_stops_at_its_own_bound(
    db: SessionDB, name: str, start: int, step: int
) -> None:
    db.update_token_counts("s", absolute=True, **{name: start})
    before = _counters(db)
    with pytest.raises(InvalidInputError, match="overflow"):
        db.update_token_counts("s", estimated_cost_usd=1.0, **{name: step})
    assert _counters(db) == before  # the costs given beside it were not added either
    back = -1 if step > 0 else 1
    db.update_token_counts("s", **{name: back})  # away from the edge: lands
    row = db.get_session("s")
    assert row is not None and row[name] == start + back and type(row[name]) is int


def test_the_edge_itself_is_reached_exactly(db: SessionDB) -> None:
    db.update_token_counts("s", input_tokens=TOP - 3, output_tokens=BOTTOM + 3, absolute=True)
    db.update_token_counts("s", input_tokens=3, output_tokens=-3)
    assert _counters(db)[:2] == (TOP, BOTTOM)


def test_one_counter_over_refuses_the_whole_call(db: SessionDB) -> None:
    db.update_token_counts("s", output_tokens=TOP, absolute=True)
    with pytest.raises(InvalidInputError):
        db.update_token_counts("s", input_tokens=5, output_tokens=1, reasoning_tokens=2)
    assert _counters(db)[:5] == (0, TOP, 0, 0, 0)


def test_an_unknown_session_is_a_no_op_even_at_the_edge(db: SessionDB) -> None:
    db.update_token_counts("nobody", input_tokens=TOP, output_tokens=BOTTOM)
    db.update_token_counts("nobody", input_tokens=TOP, absolute=True)
    assert db.get_session("nobody") is None


@pytest.mark.parametrize(("held", "after_zero"), [(1e30, 1e30), (-1e30, -1e30)])
def test_a_counter_left_out_of_range_is_refused_a_step_but_not_a_zero(
    db: SessionDB, held: object, after_zero: object
) -> None:
    """The original store overflowed into a REAL: a nonzero step on that counter is refused,
    nothing written; a call that adds 0 to it (a step on another counter) lands, the counter
    as SQLite's arithmetic leaves it (+ 0)."""
    _raw_set(db, "input_tokens", held)
    step = -1 if held == -1e30 else 1
    with pytest.raises(InvalidInputError):
        db.update_token_counts("s", input_tokens=step, output_tokens=7)
    row = db.get_session("s")
    assert row is not None and row["input_tokens"] == held and row["output_tokens"] == 0
    db.update_token_counts("s", output_tokens=7)
    row = db.get_session("s")
    assert row is not None and row["input_tokens"] == after_zero and row["output_tokens"] == 7


#: Counters another program (or an old bug) left as text or bytes, and steps on them: a text
#: that reads as no number counts from 0, one that does as that number, one past 64 bits (a
#: REAL to SQLite's ``+``) is refused like a REAL.
_ODD_COUNTERS: list[tuple[object, int]] = [
    ("", 10),
    ("abc", 10),
    ("abc", -3),
    ("12abc", 5),
    ("7.5 tokens", 2),
    (b"31", 4),
    (f"{TOP - 1} tokens", 1),
    (f"{BOTTOM + 1} tokens", -1),
]


def _with_counter(path: Path, value: object) -> None:
    with contextlib.closing(sqlite3.connect(path)) as raw, raw:
        raw.execute("UPDATE sessions SET output_tokens = ? WHERE id = 's'", (value,))


def _output_tokens(path: Path) -> tuple[object, str]:
    with contextlib.closing(sqlite3.connect(path)) as raw:
        found = raw.execute("SELECT output_tokens, typeof(output_tokens) FROM sessions").fetchone()
    return found[0], found[1]


@pytest.mark.parametrize(("held", "step"), _ODD_COUNTERS)
def test_a_counter_holding_text_adds_as_the_original_store_adds(
    db: SessionDB, tmp_path: Path, held: object, step: int
) -> None:
    """The guard compares the number SQLite's ``+`` reads from the counter: a counter holding
    '' or 'abc' is updated to what the original store's ``output_tokens + ?`` gives, not
    refused as an overflow; value and storage type alike."""
    path = tmp_path / "state.db"
    _with_counter(path, held)
    theirs = tmp_path / "theirs.db"
    with (
        contextlib.closing(sqlite3.connect(path)) as source,
        contextlib.closing(sqlite3.connect(theirs)) as copy,
    ):
        source.backup(copy)
    db.update_token_counts("s", output_tokens=step, input_tokens=1)
    seed = SeedSessionDB(theirs)
    seed.update_token_counts("s", output_tokens=step, input_tokens=1)
    seed.close()
    assert _output_tokens(path) == _output_tokens(theirs)
    row = db.get_session("s")
    assert row is not None and row["input_tokens"] == 1


@pytest.mark.parametrize(
    ("held", "step"), [(f"{TOP} tokens", 1), (f"{BOTTOM} tokens", -1), ("1e30 tokens", 1)]
)
def test_a_counter_holding_text_past_64_bits_is_refused(
    db: SessionDB, tmp_path: Path, held: str, step: int
) -> None:
    """Text that reads as a number the step would take past 64 bits is refused as an
    overflow, nothing written; a step of 0 on it still lands."""
    path = tmp_path / "state.db"
    _with_counter(path, held)
    with pytest.raises(InvalidInputError, match="overflow"):
        db.update_token_counts("s", output_tokens=step, input_tokens=1)
    assert _output_tokens(path) == (held, "text")
    assert _counters(db)[0] == 0
    db.update_token_counts("s", input_tokens=1)
    assert _counters(db)[0] == 1


def test_a_null_counter_counts_from_zero(db: SessionDB) -> None:
    _raw_set(db, "reasoning_tokens", None)
    db.update_token_counts("s", reasoning_tokens=4)
    assert _counters(db)[4] == 4


def test_an_overflow_inside_a_transaction_leaves_the_choice_to_the_block(db: SessionDB) -> None:
    """Refused inside a block: the caller may catch it and commit the block's other writes, or
    let it go and lose them all."""
    db.update_token_counts("s", input_tokens=TOP, absolute=True)
    with db.transaction():
        db.append_message("s", "user", "kept")
        with pytest.raises(InvalidInputError):
            db.update_token_counts("s", input_tokens=1)
        db.update_token_counts("s", output_tokens=2)
    assert [m["content"] for m in db.get_messages("s")] == ["kept"]
    assert _counters(db)[:2] == (TOP, 2)
    with pytest.raises(InvalidInputError), db.transaction():
        db.append_message("s", "user", "lost")
        db.update_token_counts("s", input_tokens=1)
    assert [m["content"] for m in db.get_messages("s")] == ["kept"]


def test_many_shapes_of_increments_each_land_once(db: SessionDB) -> None:
    """Every sign pattern is its own statement: each adds exactly what it was given."""
    expected = [0, 0, 0, 0, 0]
    for index in range(3**5):
        steps = []
        for position in range(5):
            steps.append((0, 1, -1)[(index // 3**position) % 3] * (position + 1))
        db.update_token_counts(
            "s",
            input_tokens=steps[0],
            output_tokens=steps[1],
            cache_read_tokens=steps[2],
            cache_write_tokens=steps[3],
            reasoning_tokens=steps[4],
        )
        expected = [a + b for a, b in zip(expected, steps, strict=True)]
    assert list(_counters(db)[:5]) == expected


def test_the_hot_increment_binds_what_the_general_guards_bind() -> None:
    """The SQLite hot path works out an increment's plan and values without a loop
    (``repo.sqlite._increment``): for every sign pattern of the five counters, at the edges of
    64 bits too, the same plan and the same values as :func:`token_guards` and the plan's
    own picker give."""
    import itertools

    from hermes_store.repo import sqlite as repo
    from hermes_store.repo.statements import token_guards

    magnitudes = {1: (1, 7, TOP), -1: (-1, -7, BOTTOM), 0: (0,)}
    priced = ((1.5, None), (None, "ok", None, None, None, None, "model"))
    unpriced = ((None, None), (None,) * 7)  # tokens only: the plan with NULL in the SQL
    for (costs, texts), given in ((priced, True), (unpriced, False)):
        for signs in itertools.product((1, -1, 0), repeat=5):
            for pick in range(3):
                counts = tuple(magnitudes[s][pick % len(magnitudes[s])] for s in signs)
                expected_signs, bounds = token_guards(counts)
                plan = repo._token_plan(expected_signs, given)
                expected = plan.pick(("s", *counts, *costs, *texts, *bounds))
                assert repo._increment("s", counts, costs, texts) == (plan, expected), counts
