"""The contract's Trajectories section: JSONL samples and the scratchpad helpers."""

from __future__ import annotations

import json
import logging
from datetime import datetime
from pathlib import Path

import pytest

import hermes_store
from hermes_store.trajectory import (
    convert_scratchpad_to_think,
    has_incomplete_scratchpad,
    save_trajectory,
)

CONVERSATION = [
    {"from": "human", "value": "数据库迁移完成了吗？ 🚀"},
    {"from": "gpt", "value": "<think>check</think> 是的。"},
]


def test_reexported_from_the_package() -> None:
    assert hermes_store.save_trajectory is save_trajectory
    assert hermes_store.convert_scratchpad_to_think is convert_scratchpad_to_think
    assert hermes_store.has_incomplete_scratchpad is has_incomplete_scratchpad


def test_default_files_by_outcome(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    before = datetime.now()
    save_trajectory(CONVERSATION, "anthropic/claude-sonnet-4.5", True)
    save_trajectory(CONVERSATION, "gpt", True)
    save_trajectory([], None, False)
    done = (tmp_path / "trajectory_samples.jsonl").read_text(encoding="utf-8").splitlines()
    failed = (tmp_path / "failed_trajectories.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(done) == 2 and len(failed) == 1
    entry = json.loads(done[0])
    assert list(entry) == ["conversations", "timestamp", "model", "completed"]
    assert entry["conversations"] == CONVERSATION
    assert entry["model"] == "anthropic/claude-sonnet-4.5" and entry["completed"] is True
    stamp = datetime.fromisoformat(entry["timestamp"])
    assert stamp.tzinfo is None and stamp >= before.replace(microsecond=0)  # local, ISO
    assert "数据库迁移完成了吗" in done[0]  # ensure_ascii=False: CJK and emoji kept as is
    failure = json.loads(failed[0])
    assert failure["completed"] is False and failure["model"] is None
    assert failure["conversations"] == []


def test_explicit_filename_appends(tmp_path: Path) -> None:
    target = tmp_path / "custom.jsonl"
    save_trajectory(CONVERSATION, "m", False, filename=str(target))
    save_trajectory(CONVERSATION, "m", False, filename=target)
    assert len(target.read_text(encoding="utf-8").splitlines()) == 2


def test_a_non_finite_number_is_written_as_null(tmp_path: Path) -> None:
    """``Infinity`` and ``NaN`` are not JSON (jq refuses the whole file): written as null."""
    target = tmp_path / "samples.jsonl"
    turns = [{"from": "gpt", "value": "x", "score": float("inf"), "scores": [float("nan"), 1.5]}]
    save_trajectory(turns, "m", True, filename=target)

    def refuse(name: str) -> None:
        raise AssertionError(f"not JSON: {name}")

    [line] = target.read_text(encoding="utf-8").splitlines()
    entry = json.loads(line, parse_constant=refuse)
    assert entry["conversations"] == [
        {"from": "gpt", "value": "x", "score": None, "scores": [None, 1.5]}
    ]


def test_errors_are_logged_and_swallowed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="hermes_store.trajectory"):
        save_trajectory(CONVERSATION, "m", True, filename=tmp_path)  # a directory
        save_trajectory([{"not json": object()}], "m", True, filename=tmp_path / "x.jsonl")
    assert len(caplog.records) == 2
    assert not (tmp_path / "x.jsonl").exists()


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("<REASONING_SCRATCHPAD>plan</REASONING_SCRATCHPAD>answer", "<think>plan</think>answer"),
        ("<REASONING_SCRATCHPAD>cut off", "<think>cut off"),
        ("no tags here", "no tags here"),
        ("stray </REASONING_SCRATCHPAD> only", "stray </REASONING_SCRATCHPAD> only"),
        ("", ""),
        (None, None),
    ],
)
def test_convert_scratchpad_to_think(content: str | None, expected: str | None) -> None:
    assert convert_scratchpad_to_think(content) == expected


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("<REASONING_SCRATCHPAD>thinking...", True),
        ("<REASONING_SCRATCHPAD>done</REASONING_SCRATCHPAD>", False),
        ("</REASONING_SCRATCHPAD>", False),
        ("plain", False),
        ("", False),
        (None, False),
    ],
)
def test_has_incomplete_scratchpad(content: str | None, expected: bool) -> None:
    assert has_incomplete_scratchpad(content) is expected
