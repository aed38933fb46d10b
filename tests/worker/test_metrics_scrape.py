"""A worker process serves its own /metrics; the ledger's figures are the same from any
process, the counters of events only in the process that saw them."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

import durably
from durably import RunStatus, exposition
from durably.cli import cli
from durably.server import create_server
from tests.worker import metricsapp
from tests.worker.test_shutdown import durably_cli

APP = "tests.worker.metricsapp:app"
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def samples(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(found: Samples, name: str, **labels: str) -> float | None:
    return found.get((name, frozenset(labels.items())))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(url: str) -> Samples | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            assert response.headers["Content-Type"] == CONTENT_TYPE_LATEST
            return samples(response.read().decode())
    except OSError:
        return None  # not listening yet


def stop(worker: subprocess.Popen[str]) -> str:
    worker.send_signal(signal.SIGTERM)
    try:
        _, stderr = worker.communicate(timeout=20)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.communicate()
    assert worker.returncode == 0, stderr
    return stderr


def settled(app: durably.App, *run_ids: str) -> list[RunStatus]:
    """The runs' statuses once none is queued or running any more (the worker's counters
    are incremented before the commit that settles a run)."""
    deadline = time.monotonic() + 30
    while True:
        statuses = [app.get_run(r).status for r in run_ids]
        if not {RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.RECONCILING} & set(statuses):
            return statuses
        assert time.monotonic() < deadline, statuses
        time.sleep(0.05)


def test_a_worker_in_another_process_is_scraped(database_url: str) -> None:
    app = metricsapp.app
    app.database_url = database_url
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    worker = durably_cli(database_url, "worker", "--metrics-port", str(port), app=APP)
    try:
        paid = app.start(metricsapp.checkout, "ann")
        lost = app.start(metricsapp.deliver, "o-1")
        assert settled(app, paid, lost) == [RunStatus.COMPLETED, RunStatus.PAUSED]
        seen = scrape(url)
        deadline = time.monotonic() + 30
        while seen is None and worker.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # served from the worker's start, which we may have overtaken
            seen = scrape(url)
        assert seen is not None, f"the worker never served {url}"
        app.close()  # the console opens the store on its own loop
        with TestClient(create_server(app), base_url="http://127.0.0.1") as client:
            console = samples(client.get("/metrics").text)
        with pytest.raises(urllib.error.HTTPError) as other_path:
            urllib.request.urlopen(url.replace("/metrics", "/runs"), timeout=5)
        other_path.value.close()
        assert other_path.value.code == 404
    finally:
        stderr = stop(worker)
        app.close()
    assert f"metrics at {url}" in stderr

    # Events this worker saw: its own counters.
    assert value(seen, "agent_tool_unknown_total", tool="issue") == 1
    assert value(seen, "agent_tool_unknown_total", tool="ship") == 1
    assert value(seen, "agent_tool_reconciliation_total", result="succeeded") == 1
    assert value(seen, "agent_tool_idempotency_hit_total", tool="issue") == 1
    assert value(seen, "agent_tool_idempotency_hit_total", tool="charge") == 0
    assert (value(seen, "agent_checkpoint_after_tool_lag_seconds_count") or 0) >= 1
    # Facts of the ledger, read from the store at the scrape.
    assert value(seen, "agent_ledger_up") == 1
    assert value(seen, "agent_duplicate_side_effect_total", tool="issue") == 1
    assert value(seen, "agent_tool_unknown_unresolved", tool="ship") == 1
    # Another process (the console here) sees the same facts, but none of the events.
    assert value(console, "agent_ledger_up") == 1
    assert value(console, "agent_duplicate_side_effect_total", tool="issue") == 1
    assert value(console, "agent_tool_unknown_unresolved", tool="ship") == 1
    assert value(console, "agent_tool_unknown_total", tool="ship") == 0
    assert value(console, "agent_tool_reconciliation_total", result="succeeded") is None


def test_a_taken_metrics_port_is_an_error(database_url: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(
            cli,
            [
                "--app",
                APP,
                "--db",
                database_url,
                "worker",
                "--until-idle",
                "--metrics-port",
                str(port),
            ],
        )
    assert result.exit_code != 0
    assert f"error: cannot serve metrics on 127.0.0.1:{port}" in result.output
    assert "metrics at" not in result.output  # never announced where nothing is served


def test_a_store_that_does_not_answer_still_gets_the_counters_served(tmp_path: Path) -> None:
    app = durably.App(f"sqlite:///{tmp_path}/missing-dir/ledger.db")
    app.metrics.lease_expired.inc()
    text = asyncio.run(exposition.scrape(app.engine)).decode()
    found = samples(text)
    assert value(found, "agent_ledger_up") == 0
    assert value(found, "agent_step_lease_expired_total") == 1
    assert value(found, "agent_tool_unknown_unresolved", tool="ship") is None
