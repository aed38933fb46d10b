"""A store outage while a tool's outcome is being recorded: waited out, not guessed."""

from __future__ import annotations

import threading
from collections import Counter
from datetime import timedelta

import pytest

import durably
from durably import RunStatus
from tests.scale.cluster import Cluster

pytestmark = pytest.mark.scale


def test_an_outcome_is_recorded_after_the_database_comes_back(pg_cluster: Cluster) -> None:
    """The tool took effect and PostgreSQL went down before the result was recorded.

    The tool has neither an idempotency key nor a reconcile function, so if the outcome
    were dropped the run could only pause for a person. The worker holds the outcome and
    retries the record while its lease lasts; the run completes with one effect.
    """
    app = durably.App(pg_cluster.url, lease_ttl=timedelta(seconds=30))
    calls = Counter[str]()
    restarts: list[threading.Timer] = []

    @app.tool()
    def notify(customer: str) -> dict[str, str]:
        calls["notify"] += 1
        stopped = pg_cluster.pg_ctl("stop", "-m", "immediate")
        assert stopped.returncode == 0, stopped.stderr
        restart = threading.Timer(12.0, lambda: pg_cluster.pg_ctl("start"))
        restarts.append(restart)
        restart.start()  # past the pool timeout (10 s)
        return {"notified": customer}

    @app.workflow()
    async def wf(customer: str) -> dict[str, str]:
        return await notify(customer)

    try:
        run = app.run(wf, "c-1")
        assert run.status is RunStatus.COMPLETED
        assert run.result == {"notified": "c-1"}
        assert calls["notify"] == 1
        effect = app.describe(run.run_id)["effects"][0]
        assert effect["status"] == "succeeded"
    finally:
        for restart in restarts:  # never start the server after its teardown
            restart.cancel()
            restart.join()
        app.close()
