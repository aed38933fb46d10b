"""A worker dies holding a batch of claimed runs: another worker recovers every one of them,
and every step of every run is executed once (a step cut short by the kill, twice)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from durably import RunStatus
from durably.faults import CRASH_EXIT_CODE
from tests.conftest import fetch_sql
from tests.worker import drainapp
from tests.worker.test_shutdown import durably_cli, sigkill_once_started

RUNS = 6
LEASE_TTL_S = 60
"""Far beyond the test's patience: the dead worker's leases are ended, not waited out."""


def _leases(url: str) -> dict[str, tuple[str, str, int]]:
    rows = fetch_sql(url, "SELECT run_id, status, lease_owner, lease_epoch FROM durably_runs")
    return {run_id: (status, owner, epoch) for run_id, status, owner, epoch in rows}


@pytest.mark.parametrize("death", ["after_claim", "sigkill_in_steps"])
def test_a_batch_held_by_a_dead_worker_is_recovered_run_by_run(
    database_url: str, tmp_path: Path, death: str
) -> None:
    ledgers = [tmp_path / f"executions-{i}.txt" for i in range(RUNS)]
    app = drainapp.app
    app.database_url = database_url
    try:
        run_ids = [app.start(drainapp.three_slow_steps, str(ledger)) for ledger in ledgers]
        args = ["worker", "--lease-ttl", str(LEASE_TTL_S), "--concurrency", str(RUNS)]
        if death == "after_claim":
            # Exits (os._exit, as a SIGKILL would leave it) once its first batch committed.
            worker = durably_cli(
                database_url, *args, env={"DURABLY_CRASH_AT": "worker.after_claim"}
            )
            _, stderr = worker.communicate(timeout=30)
            assert worker.returncode == CRASH_EXIT_CODE, stderr
            assert not any(ledger.exists() for ledger in ledgers)
        else:
            sigkill_once_started(durably_cli(database_url, *args), ledgers)
        held = _leases(database_url)
        # One claim took them all: every run leased once, by the dead worker.
        owners = {owner for _, owner, _ in held.values()}
        assert len(owners) == 1, held
        assert None not in owners, held
        assert {(status, epoch) for status, _, epoch in held.values()} == {("running", 1)}

        started = time.monotonic()
        finisher = durably_cli(database_url, "worker", "--until-idle", "--concurrency", "4")
        _, stderr = finisher.communicate(timeout=LEASE_TTL_S / 2)
        assert finisher.returncode == 0, stderr
        assert time.monotonic() - started < LEASE_TTL_S / 2
        after = _leases(database_url)
        for run_id, ledger in zip(run_ids, ledgers, strict=True):
            assert after[run_id][2] == 2  # the dead worker's epoch, then the finisher's
            done = app.get_run(run_id)
            assert done.status is RunStatus.COMPLETED, done
            assert done.result == [0, 1, 2]
            recovered = [e for e in app.events(run_id) if e.type == "run_recovered"]
            assert [e.payload["previous_owner"] for e in recovered] == list(owners)
            executions = ledger.read_text().split()
            if death == "after_claim":
                assert executions == ["0", "1", "2"]  # nothing ran before the kill
            else:
                # The step cut short by the kill (unrecorded) runs again; no other does.
                assert sorted(set(executions)) == ["0", "1", "2"]
                assert len(executions) == 4
                assert executions == sorted(executions)
    finally:
        app.close()
