"""Ready-made charts of the usage figures, for notebooks: each runs one query of
:mod:`hermes_store.analytics` and draws it on a matplotlib ``Axes``, which it returns.

Needs the analytics extra (``pip install 'hermes-store[analytics]'``: pandas and matplotlib).
Pass ``ax`` to draw into a figure of your own; without it a new pyplot figure is made, which a
notebook shows as the cell's output. ``target`` is anything
:func:`hermes_store.analytics.to_dataframe` takes (a ``SessionDB``, an Engine, a URL, a path).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hermes_store import analytics
from hermes_store.analytics import Sources, When
from hermes_store.errors import extras_named

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from hermes_store.analytics import Target

__all__ = [
    "cost_per_day",
    "sessions_per_source",
    "tokens_per_day",
    "tool_usage",
    "usage_per_model",
]

#: The token counters drawn per day, bottom to top, with their legend labels.
TOKEN_SERIES = {
    "input_tokens": "input",
    "output_tokens": "output",
    "cache_read_tokens": "cache read",
    "cache_write_tokens": "cache write",
    "reasoning_tokens": "reasoning",
}


def _axes(ax: Axes | None) -> Axes:
    if ax is not None:
        return ax
    with extras_named():
        pyplot: Any = importlib.import_module("matplotlib.pyplot")
    _, made = pyplot.subplots(figsize=(8, 4), layout="constrained")
    return made  # type: ignore[no-any-return]


def cost_per_day(
    target: Target,
    *,
    since: When | None = None,
    until: When | None = None,
    source: Sources = None,
    ax: Axes | None = None,
) -> Axes:
    """Estimated and actual cost (USD) per UTC day, as bars side by side."""
    ax = _axes(ax)
    daily, days = _per_day(target, since, until, source)
    positions = list(range(len(days)))
    ax.bar([p - 0.2 for p in positions], daily["estimated_cost_usd"], 0.4, label="estimated")
    ax.bar([p + 0.2 for p in positions], daily["actual_cost_usd"], 0.4, label="actual")
    _day_ticks(ax, days)
    ax.set_ylabel("USD")
    ax.set_title("Cost per day (UTC)")
    ax.legend()
    return ax


def tokens_per_day(
    target: Target,
    *,
    since: When | None = None,
    until: When | None = None,
    source: Sources = None,
    ax: Axes | None = None,
) -> Axes:
    """The five token counters per UTC day, stacked."""
    ax = _axes(ax)
    daily, days = _per_day(target, since, until, source)
    bottom = [0] * len(days)
    for column, label in TOKEN_SERIES.items():
        values = daily[column].tolist()
        ax.bar(range(len(days)), values, 0.8, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    _day_ticks(ax, days)
    ax.set_ylabel("tokens")
    ax.set_title("Tokens per day (UTC)")
    ax.legend()
    return ax


def usage_per_model(
    target: Target,
    *,
    figure: str = "estimated_cost_usd",
    since: When | None = None,
    until: When | None = None,
    source: Sources = None,
    ax: Axes | None = None,
) -> Axes:
    """One of the usage figures (default: estimated cost) per model, largest on top."""
    ax = _axes(ax)
    frame = analytics.to_dataframe(
        analytics.usage_per_model(since=since, until=until, source=source), target
    )
    if figure not in frame.columns or figure == "model":
        raise ValueError(f"figure must be one of {', '.join(frame.columns[1:])}")
    frame = frame.sort_values(figure)
    labels = frame["model"].astype(object).fillna("(no model)").astype(str).tolist()
    ax.barh(labels, frame[figure])
    ax.set_xlabel(figure.replace("_", " "))
    ax.set_title(f"{figure.replace('_', ' ').capitalize()} per model")
    return ax


def sessions_per_source(
    target: Target,
    *,
    since: When | None = None,
    until: When | None = None,
    ax: Axes | None = None,
) -> Axes:
    """Sessions per source (cli, telegram, ...), largest first."""
    ax = _axes(ax)
    frame = analytics.to_dataframe(analytics.usage_per_source(since=since, until=until), target)
    frame = frame.sort_values("sessions", ascending=False)
    ax.bar(frame["source"].astype(str).tolist(), frame["sessions"])
    ax.set_ylabel("sessions")
    ax.set_title("Sessions per source")
    return ax


def tool_usage(
    target: Target,
    *,
    top: int = 15,
    since: When | None = None,
    source: Sources = None,
    ax: Axes | None = None,
) -> Axes:
    """The ``top`` busiest tools by calls, busiest on top."""
    ax = _axes(ax)
    frame = analytics.to_dataframe(analytics.tool_usage(since=since, source=source), target)
    frame = frame.head(top).iloc[::-1]
    ax.barh([str(t) for t in frame["tool_name"]], frame["calls"])
    ax.set_xlabel("calls")
    ax.set_title(f"Tool calls (top {top})")
    return ax


def _per_day(
    target: Target, since: When | None, until: When | None, source: Sources
) -> tuple[Any, list[str]]:
    """The usage per UTC day as a frame, and its days as labels."""
    daily = analytics.to_dataframe(
        analytics.usage_per_day(since=since, until=until, source=source), target
    )
    return daily, daily["day"].dt.strftime("%Y-%m-%d").tolist()


def _day_ticks(ax: Axes, days: list[str]) -> None:
    """Day labels under the bars: every one when few, else about ten of them."""
    step = max(1, len(days) // 10)
    ax.set_xticks(range(0, len(days), step), days[::step], rotation=45, ha="right")
