"""The scale benchmark (``bench/scale.py``) at a smoke size: its reads and backup on the full
file, each store in a process of its own beside the writer, and the table that shows them."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_reads_run_both_stores_beside_a_writer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from bench import exports, scale

    source = tmp_path / "state.db"
    scale.build(source, 40, 2040, exports.tool_share(4, 2040), time.time())
    copy = tmp_path / "copy.db"
    shutil.copyfile(source, copy)

    reads = scale.read_steps(copy, tmp_path, ours_first=False)

    labels = list(reads)
    assert len(labels) == 6
    assert labels[0].startswith("cold open") and labels[-1].startswith("backup")
    assert all(set(reads[label]) == {scale.OURS, scale.ORIGINAL} for label in labels[:-1])
    assert set(reads[labels[-1]]) == {scale.OURS}  # the original store has no backup
    steps = [step for by_kind in reads.values() for step in by_kind.values()]
    assert [(s.name, s.exit_code, s.errors, s.lost) for s in steps] == [
        (s.name, 0, [], 0) for s in steps
    ], [s.output for s in steps]
    assert all(s.seconds > 0 for s in steps)
    for label in labels[1:4]:  # the searches: both stores find the same number of rows
        ours, original = reads[label][scale.OURS], reads[label][scale.ORIGINAL]
        assert ours.hits == original.hits and ours.hits is not None and ours.hits > 0, label
    rare = reads[labels[2]]
    assert rare[scale.OURS].hits == 1
    assert not list(tmp_path.glob("backup.db*"))  # the backup's copy is removed

    run = scale.Run(0.0, 1, reads, scale.Step("prune"), scale.Step("optimize"), 1)
    scale.read_report([run])
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert len(table) == 2 + len(labels)
    assert table[-1].startswith("| backup (`hermes-store backup`) |") and "no backup" in table[-1]
    assert all(line.count(" / ") >= 3 for line in table[2:-1])  # ours / original per figure
