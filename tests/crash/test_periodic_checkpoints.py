"""A long run of steps is checkpointed every CHECKPOINT_EVERY results, not at every commit.

The results settled after the newest checkpoint are verified against the events that
recorded them, so a crash between checkpoints loses nothing and repeats nothing, and a
result altered there is still caught.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from durably.checkpoint import CHECKPOINT_EVERY, CHECKPOINTS_KEPT
from tests.conftest import execute_sql, fetch_sql
from tests.crash.conftest import Harness
from tests.crash.crashapp import STEP_LOG_ENV

pytestmark = pytest.mark.crash

STEPS = CHECKPOINT_EVERY + 13
CRASH_AFTER = CHECKPOINT_EVERY + 8
"""The crash comes after this many results: 8 of them after the periodic checkpoint."""


def executions(log: Path) -> Counter[int]:
    return Counter(int(line) for line in log.read_text().split())


def newest_checkpoint(h: Harness, run_id: str) -> dict[str, object]:
    rows = fetch_sql(
        h.database_url,
        "SELECT payload_json FROM durably_checkpoints WHERE run_id = ? "
        "ORDER BY state_version DESC LIMIT 1",
        (run_id,),
    )
    payload: dict[str, object] = json.loads(rows[0][0])
    return payload


def crashed_between_checkpoints(
    h: Harness, run_id: str, log: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(STEP_LOG_ENV, str(log))
    crashed = h.start("long_steps", run_id, crash_at=f"step.after_record:{CRASH_AFTER}", n=STEPS)
    assert crashed.code == 77, crashed.explain()
    snapshot = newest_checkpoint(h, run_id)["state_snapshot"]
    assert isinstance(snapshot, dict)
    assert snapshot["journal_length"] == CHECKPOINT_EVERY


def test_a_crash_between_checkpoints_repeats_no_step(
    harness: Harness, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "ticks.log"
    crashed_between_checkpoints(harness, "long-1", log, monkeypatch)

    done = harness.recover("long_steps", "long-1", n=STEPS)
    assert done.run is not None, done.explain()
    assert done.run["status"] == "completed"
    assert done.run["result"] == sum(i * i for i in range(1, STEPS + 1))
    assert executions(log) == Counter(range(1, STEPS + 1))
    # The final checkpoint covers every result and prunes all but the newest few.
    snapshot = newest_checkpoint(harness, "long-1")["state_snapshot"]
    assert isinstance(snapshot, dict)
    assert snapshot["journal_length"] == STEPS
    kept = fetch_sql(
        harness.database_url,
        "SELECT count(*) FROM durably_checkpoints WHERE run_id = ?",
        ("long-1",),
    )
    assert kept[0][0] == CHECKPOINTS_KEPT


def test_a_result_altered_after_the_newest_checkpoint_is_caught(
    harness: Harness, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "ticks.log"
    crashed_between_checkpoints(harness, "long-2", log, monkeypatch)
    altered = f"tick#{CHECKPOINT_EVERY + 4}"
    execute_sql(
        harness.database_url,
        "UPDATE durably_steps SET output_json = ? WHERE run_id = ? AND step_id = ?",
        ('{"i": 0, "square": 0}', "long-2", altered),
    )

    again = harness.recover("long_steps", "long-2", n=STEPS)
    assert again.run is not None, again.explain()
    assert again.run["status"] == "paused"
    assert again.run["status_reason"] == "checkpoint_corrupted"
    assert altered in json.dumps(again.run["error"])
    # Nothing after the crash was executed from the altered state.
    assert executions(log) == Counter(range(1, CRASH_AFTER + 1))
