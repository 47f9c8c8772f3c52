"""``hermes_store.analytics``: the ready-made queries on both backends, and ``to_dataframe``."""

from __future__ import annotations

import sys
from datetime import UTC, date, datetime, timedelta, timezone
from pathlib import Path

import pytest
import sqlalchemy as sa

from hermes_store import InvalidInputError, SessionDB, analytics
from hermes_store.models import ChatSession
from hermes_store.models import sessions_table as S
from tests.support.read_only import archived_database, read_only_folder

# Two sessions either side of a UTC midnight, one a day later; a 3-level lineage.
LATE = datetime(2025, 3, 1, 23, 59, 30, tzinfo=UTC).timestamp()
EARLY = datetime(2025, 3, 2, 0, 0, 30, tzinfo=UTC).timestamp()
NEXT = datetime(2025, 3, 3, 12, 0, 0, tzinfo=UTC).timestamp()


@pytest.fixture
def usage_db(store: SessionDB) -> SessionDB:
    store.create_session("a", "cli", model="claude")
    store.create_session("b", "telegram", model="gpt")
    store.create_session("c", "cli", model="claude", parent_session_id="a")
    store.create_session("d", "cli", parent_session_id="c")
    store.create_session("e", "discord", model="gpt")
    store.append_message("a", "user", "run it")
    store.append_message("a", "assistant", None, tool_calls=[{"id": "1"}, {"id": "2"}])
    store.append_message("a", "tool", "ok", tool_name="terminal")
    store.append_message("a", "tool", "ok", tool_name="terminal")
    store.append_message("c", "tool", "page", tool_name="web_search")
    store.append_message("b", "user", "hi")
    store.update_token_counts(
        "a",
        input_tokens=100,
        output_tokens=10,
        cache_read_tokens=5,
        reasoning_tokens=3,
        estimated_cost_usd=0.5,
        actual_cost_usd=0.4,
    )
    store.update_token_counts("c", input_tokens=50, output_tokens=5, estimated_cost_usd=0.25)
    store.update_token_counts("b", input_tokens=7, output_tokens=1, cache_write_tokens=2)
    starts = {"a": LATE, "b": EARLY, "c": EARLY + 60, "d": NEXT, "e": NEXT + 1}
    ends = {"a": LATE + 90, "c": EARLY + 660}

    def backdate(conn: sa.Connection) -> None:
        for session_id, started in starts.items():
            values = {"started_at": started, "ended_at": ends.get(session_id)}
            conn.execute(sa.update(S).where(S.c.id == session_id).values(values))

    store.uow.run(backdate)
    return store


def rows(db: SessionDB, statement: sa.Select) -> list[dict]:  # type: ignore[type-arg]
    with db.uow.connect(write=False) as conn:
        return [dict(row._mapping) for row in conn.execute(statement)]


def test_usage_per_day_buckets_by_utc_day(usage_db: SessionDB) -> None:
    by_day = {r["day"]: r for r in rows(usage_db, analytics.usage_per_day())}
    assert list(by_day) == ["2025-03-01", "2025-03-02", "2025-03-03"]
    assert by_day["2025-03-01"]["sessions"] == 1 and by_day["2025-03-01"]["messages"] == 4
    assert by_day["2025-03-01"]["tool_calls"] == 2
    assert by_day["2025-03-02"]["sessions"] == 2
    assert by_day["2025-03-02"]["input_tokens"] == 57
    assert by_day["2025-03-03"]["estimated_cost_usd"] == 0.0  # never NULL


def test_usage_per_model_and_source(usage_db: SessionDB) -> None:
    by_model = {r["model"]: r for r in rows(usage_db, analytics.usage_per_model())}
    assert set(by_model) == {"claude", "gpt", None}
    claude = by_model["claude"]
    assert (claude["sessions"], claude["input_tokens"], claude["output_tokens"]) == (2, 150, 15)
    assert claude["cache_read_tokens"] == 5 and claude["reasoning_tokens"] == 3
    assert claude["estimated_cost_usd"] == pytest.approx(0.75)
    assert claude["actual_cost_usd"] == pytest.approx(0.4)
    assert by_model["gpt"]["cache_write_tokens"] == 2
    by_source = {r["source"]: r["sessions"] for r in rows(usage_db, analytics.usage_per_source())}
    assert by_source == {"cli": 3, "telegram": 1, "discord": 1}


def test_usage_by_several_dimensions_and_filters(usage_db: SessionDB) -> None:
    pairs = {
        (r["day"], r["model"]): r["sessions"]
        for r in rows(usage_db, analytics.usage(("day", "model")))
    }
    assert pairs == {
        ("2025-03-01", "claude"): 1,
        ("2025-03-02", "gpt"): 1,
        ("2025-03-02", "claude"): 1,
        ("2025-03-03", None): 1,
        ("2025-03-03", "gpt"): 1,
    }
    recent = rows(usage_db, analytics.usage_per_day(since=EARLY, until=NEXT))
    assert [r["day"] for r in recent] == ["2025-03-02"]
    cli_only = rows(usage_db, analytics.totals(source="cli"))
    assert cli_only[0]["sessions"] == 3 and cli_only[0]["messages"] == 5
    with pytest.raises(ValueError, match="unknown dimension"):
        analytics.usage("week")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one"):
        analytics.usage(())


def test_totals_on_an_empty_database(store: SessionDB) -> None:
    [total] = rows(store, analytics.totals())
    assert total["sessions"] == 0 and total["input_tokens"] == 0
    assert total["estimated_cost_usd"] == 0.0


def test_tool_usage(usage_db: SessionDB) -> None:
    tools = rows(usage_db, analytics.tool_usage())
    assert [(t["tool_name"], t["calls"], t["sessions"]) for t in tools] == [
        ("terminal", 2, 1),
        ("web_search", 1, 1),
    ]
    assert tools[0]["first_used"] <= tools[0]["last_used"]
    assert rows(usage_db, analytics.tool_usage(source="telegram")) == []


def test_session_durations(usage_db: SessionDB) -> None:
    durations = {r["id"]: r["duration_s"] for r in rows(usage_db, analytics.session_durations())}
    assert durations == {"a": pytest.approx(90), "c": pytest.approx(600)}
    assert rows(usage_db, analytics.session_durations(source="telegram")) == []


def test_lineage_depth_and_lineages(usage_db: SessionDB) -> None:
    depth = {r["id"]: (r["root_id"], r["depth"]) for r in rows(usage_db, analytics.lineage_depth())}
    assert depth == {"a": ("a", 0), "c": ("a", 1), "d": ("a", 2), "b": ("b", 0), "e": ("e", 0)}
    lineages = rows(usage_db, analytics.lineages(min_sessions=2))
    assert lineages == [{"root_id": "a", "sessions": 3, "max_depth": 2}]


def test_queries_are_refinable_selects(usage_db: SessionDB) -> None:
    statement = analytics.usage_per_model().where(ChatSession.model.is_not(None)).limit(1)
    assert len(rows(usage_db, statement)) == 1


def test_to_dataframe_on_every_kind_of_target(usage_db: SessionDB, tmp_path: Path) -> None:
    pandas = pytest.importorskip("pandas")
    frame = analytics.to_dataframe(analytics.usage_per_model(), usage_db)
    assert isinstance(frame, pandas.DataFrame)
    assert list(frame.columns)[:3] == ["model", "sessions", "messages"]
    assert int(frame["sessions"].sum()) == 5
    with usage_db.engine.connect() as conn:
        assert len(analytics.to_dataframe(analytics.lineage_depth(), conn)) == 5
    assert len(analytics.to_dataframe(analytics.tool_usage(), usage_db.engine)) == 2
    path = tmp_path / "file.db"
    with SessionDB(path) as db:
        db.create_session("x", "cli")
    assert analytics.to_dataframe(analytics.totals(), path)["sessions"].tolist() == [1]


def test_to_dataframe_reads_a_file_in_a_read_only_folder(tmp_path: Path) -> None:
    """An archived copy in a folder nobody may write: read as the store opens it (immutable),
    not failing for want of the ``-shm`` a WAL read would create; nothing appears there."""
    pytest.importorskip("pandas")
    folder = tmp_path / "archive"
    path = archived_database(folder, "x", "kept")
    before = sorted(folder.iterdir())
    with read_only_folder(folder):
        frame = analytics.to_dataframe(analytics.totals(), path)
    assert frame["sessions"].tolist() == [1] and frame["messages"].tolist() == [1]
    assert sorted(folder.iterdir()) == before


def test_to_dataframe_without_pandas_says_what_to_install(
    store: SessionDB, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pandas", None)
    with pytest.raises(ImportError, match=r"hermes-store\[analytics\]"):
        analytics.to_dataframe(analytics.totals(), store)


@pytest.mark.parametrize(
    "bound",
    [
        EARLY - 30,
        int(EARLY - 30),
        datetime(2025, 3, 2, 0, 0, 0),  # naive: UTC
        datetime(2025, 3, 2, 0, 0, 0, tzinfo=UTC),
        datetime(2025, 3, 2, 1, 0, 0, tzinfo=timezone(timedelta(hours=1))),
        date(2025, 3, 2),
    ],
    ids=["float", "int", "naive", "aware-utc", "aware-plus-one", "date"],
)
def test_time_bounds_take_every_kind_of_time(usage_db: SessionDB, bound: object) -> None:
    """A datetime bound filters the same rows as its epoch seconds, on both backends."""
    by_day = rows(usage_db, analytics.usage_per_day(since=bound))  # type: ignore[arg-type]
    assert [row["sessions"] for row in by_day] == [2, 2]
    assert rows(usage_db, analytics.totals(until=bound))[0]["sessions"] == 1  # type: ignore[arg-type]
    tools = rows(usage_db, analytics.tool_usage(since=bound))  # type: ignore[arg-type]
    assert isinstance(tools, list)


def test_a_pandas_timestamp_is_a_time_bound(usage_db: SessionDB) -> None:
    pd = pytest.importorskip("pandas")
    by_day = rows(usage_db, analytics.usage_per_day(since=pd.Timestamp("2025-03-02")))
    assert [row["sessions"] for row in by_day] == [2, 2]
    with pytest.raises(InvalidInputError, match="NaT"):
        analytics.usage_per_day(since=pd.NaT)


@pytest.mark.parametrize("bound", ["2025-03-02", True, float("nan")])
def test_a_bound_that_is_not_a_time_is_refused(bound: object) -> None:
    with pytest.raises(InvalidInputError, match="since"):
        analytics.usage_per_day(since=bound)  # type: ignore[arg-type]
