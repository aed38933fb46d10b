"""A worker started while its PostgreSQL is down (restarting, or deployed at the same
moment) waits for it instead of exiting, then does its work."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import durably
from durably import RunStatus
from tests.scale.cluster import Cluster
from tests.worker import drainapp
from tests.worker.test_shutdown import durably_cli


def test_a_worker_started_during_an_outage_waits_for_the_database(
    pg_cluster: Cluster, tmp_path: Path
) -> None:
    ledger = tmp_path / "executions.txt"
    app = drainapp.app
    app.database_url = pg_cluster.url
    try:
        run_id = app.start(drainapp.three_slow_steps, str(ledger))
    finally:
        app.close()
    stopped = pg_cluster.pg_ctl("stop", "-m", "fast")
    assert stopped.returncode == 0, stopped.stderr

    worker = durably_cli(pg_cluster.url, "worker", "--lease-ttl", "30")
    try:
        time.sleep(2.0)  # several attempts to open the store, all refused
        assert worker.poll() is None, f"the worker exited: {worker.communicate()[1][-2000:]}"
        pg_cluster.ensure_up()
        checker = durably.App(pg_cluster.url)
        try:
            deadline = time.monotonic() + 60
            while checker.get_run(run_id).status is not RunStatus.COMPLETED:
                assert time.monotonic() < deadline, "the run was not completed after the outage"
                assert worker.poll() is None, worker.communicate()[1][-2000:]
                time.sleep(0.1)
        finally:
            checker.close()
    finally:
        worker.send_signal(signal.SIGTERM)
        _, stderr = worker.communicate(timeout=30)
    assert worker.returncode == 0, stderr[-2000:]
    assert "the store is unavailable" in stderr
    assert ledger.read_text().split() == ["0", "1", "2"]  # each step once
