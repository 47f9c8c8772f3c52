"""Notebook frames and charts: the same dtypes and drawings on SQLite and PostgreSQL."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from hermes_store import SessionDB, analytics

pd = pytest.importorskip("pandas")
matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
from matplotlib import pyplot  # noqa: E402

from hermes_store import charts  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
UTC_NS = "datetime64[ns, UTC]"


@pytest.fixture
def filled(store: SessionDB) -> SessionDB:
    for n, (source, model) in enumerate(
        [("cli", "claude"), ("cli", "gpt"), ("telegram", None), ("cli", "claude")]
    ):
        sid = f"c{n}"
        store.create_session(sid, source, model=model)
        store.append_message(sid, "user", "hi")
        store.append_message(sid, "tool", "ok", tool_name="terminal" if n % 2 else "web_search")
        store.update_token_counts(sid, input_tokens=100 * (n + 1), estimated_cost_usd=0.5 * n)
    return store


def test_frames_have_the_same_dtypes_full_and_empty(filled: SessionDB) -> None:
    for since in (None, 4e9):  # everything, and nothing (after 2096)
        daily = analytics.to_dataframe(analytics.usage_per_day(since=since), filled)
        assert str(daily["day"].dtype) == UTC_NS
        assert daily["sessions"].dtype == "int64" and daily["input_tokens"].dtype == "int64"
        assert daily["estimated_cost_usd"].dtype == "float64"
        tools = analytics.to_dataframe(analytics.tool_usage(since=since), filled)
        assert str(tools["first_used"].dtype) == UTC_NS and tools["calls"].dtype == "int64"
    durations = analytics.to_dataframe(analytics.session_durations(), filled)
    assert str(durations["started_at"].dtype) == UTC_NS
    assert durations["message_count"].dtype == "int64"
    daily = analytics.to_dataframe(analytics.usage_per_day(), filled)
    assert daily["sessions"].sum() == 4
    assert daily["day"].iloc[0] == pd.Timestamp.now(tz="UTC").normalize()


def test_sessions_without_a_model_come_last_on_every_backend(filled: SessionDB) -> None:
    models = analytics.to_dataframe(analytics.usage_per_model(), filled)["model"]
    assert models.tolist()[:2] == ["claude", "gpt"] and pd.isna(models.iloc[2])


def test_each_chart_draws_the_figures(filled: SessionDB) -> None:
    ax = charts.usage_per_model(filled, figure="input_tokens")
    widths = {
        t.get_text(): p.get_width() for t, p in zip(ax.get_yticklabels(), ax.patches, strict=True)
    }
    assert widths == {"(no model)": 300, "gpt": 200, "claude": 500}
    ax = charts.sessions_per_source(filled)
    heights = {
        t.get_text(): p.get_height() for t, p in zip(ax.get_xticklabels(), ax.patches, strict=True)
    }
    assert heights == {"cli": 3, "telegram": 1}
    ax = charts.tool_usage(filled, top=1)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["terminal"] or [
        t.get_text() for t in ax.get_yticklabels()
    ] == ["web_search"]
    assert len(ax.patches) == 1 and ax.patches[0].get_width() == 2
    ax = charts.cost_per_day(filled)
    assert sum(p.get_height() for p in ax.patches[:1]) == pytest.approx(3.0)  # estimated
    ax = charts.tokens_per_day(filled)
    assert len(ax.patches) == 5  # one day, five stacked counters
    assert ax.patches[0].get_height() == 1000  # input tokens of the day
    _, mine = pyplot.subplots()
    assert charts.sessions_per_source(filled, ax=mine) is mine
    pyplot.close("all")


def test_a_bad_figure_is_refused(filled: SessionDB) -> None:
    with pytest.raises(ValueError, match="figure must be one of"):
        charts.usage_per_model(filled, figure="nonsense")
    pyplot.close("all")


@pytest.mark.slow
def test_the_docs_images_come_from_the_script(tmp_path: Path) -> None:
    """docs/charts.py draws every image docs/analytics.md shows (on a smaller sample here)."""
    spec = importlib.util.spec_from_file_location("doc_charts", ROOT / "docs" / "charts.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    written = {p.name for p in script.draw(tmp_path, sessions=40)}
    page = (ROOT / "docs" / "analytics.md").read_text(encoding="utf-8")
    shown = set(re.findall(r"\]\(images/([\w.]+\.png)\)", page))
    assert shown == written
    assert all((ROOT / "docs" / "images" / name).is_file() for name in shown)
    assert all((tmp_path / name).stat().st_size > 5000 for name in written)
