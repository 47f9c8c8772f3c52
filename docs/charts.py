"""Draws the charts of ``docs/analytics.md`` from a generated sample database.

    python docs/charts.py            # rewrites docs/images/*.png

The sample is made up and seeded, so the pictures only change when the charts do: 600
sessions over 21 days from three sources and four models, with tool calls and costs.
"""

from __future__ import annotations

import random
import sys
import tempfile
from datetime import UTC, datetime, timedelta
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
from matplotlib import pyplot
from sqlalchemy import update

from hermes_store import SessionDB, charts
from hermes_store.models import sessions_table

IMAGES = Path(__file__).resolve().parent / "images"
CHARTS = {
    "cost_per_day": charts.cost_per_day,
    "tokens_per_day": charts.tokens_per_day,
    "usage_per_model": charts.usage_per_model,
    "sessions_per_source": charts.sessions_per_source,
    "tool_usage": charts.tool_usage,
}
MODELS = {"claude-sonnet-4.5": 3e-6, "gpt-5": 2.5e-6, "gemini-2.5-pro": 2e-6, "qwen3": 4e-7}
SOURCES = {"cli": 5, "telegram": 3, "discord": 2}
TOOLS = ["terminal", "read_file", "web_search", "write_file", "browser", "memory"]


def build_sample(path: Path, sessions: int = 600, seed: int = 7) -> None:
    """``sessions`` sessions over the 21 days before 2026-12-01 (UTC)."""
    rng = random.Random(seed)
    start = datetime(2026, 11, 10, tzinfo=UTC)
    with SessionDB(path) as db:
        for number in range(sessions):
            session_id = f"sample-{number:04d}"
            model = rng.choice(list(MODELS))
            source = rng.choices(list(SOURCES), weights=list(SOURCES.values()))[0]
            db.create_session(session_id, source, model=model)
            messages = [{"role": "user", "content": "please look into it"}]
            for _ in range(rng.randint(0, 6)):
                tool = rng.choices(TOOLS, weights=[9, 7, 4, 3, 2, 1])[0]
                messages.append({"role": "tool", "content": "ok", "tool_name": tool})
            db.append_messages(session_id, messages)
            tokens_in, tokens_out = rng.randint(2_000, 60_000), rng.randint(200, 6_000)
            cost = (tokens_in + 4 * tokens_out) * MODELS[model]
            db.update_token_counts(
                session_id,
                input_tokens=tokens_in,
                output_tokens=tokens_out,
                cache_read_tokens=rng.randint(0, tokens_in),
                reasoning_tokens=rng.randint(0, tokens_out),
                estimated_cost_usd=cost,
                actual_cost_usd=cost * rng.uniform(0.7, 1.0),
            )
            started = (start + timedelta(days=rng.random() * 21)).timestamp()
            backdate = (
                update(sessions_table)
                .where(sessions_table.c.id == session_id)
                .values(started_at=started)
            )
            db.uow.run(lambda conn, statement=backdate: conn.execute(statement))


def draw(folder: Path, sessions: int = 600) -> list[Path]:
    """Every chart of a sample of ``sessions`` sessions as ``folder/NAME.png``."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory() as scratch:
        sample = Path(scratch) / "sample.db"
        build_sample(sample, sessions)
        for name, chart in CHARTS.items():
            ax = chart(sample)
            target = folder / f"{name}.png"
            ax.figure.savefig(target, dpi=80, metadata={"Software": None})
            pyplot.close(ax.figure)
            written.append(target)
    return written


if __name__ == "__main__":
    for image in draw(Path(sys.argv[1]) if len(sys.argv) > 1 else IMAGES):
        print(image)
