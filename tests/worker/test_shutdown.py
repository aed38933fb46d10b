"""A worker stopped with SIGTERM releases its run at a call boundary; another finishes it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from durably import RunStatus
from tests.worker import drainapp

APP = "tests.worker.drainapp:app"


def durably_cli(
    url: str, *args: str, app: str = APP, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    env = {**os.environ, "DURABLY_DATABASE_URL": url, **(env or {})}
    return subprocess.Popen(
        [sys.executable, "-m", "durably", "--app", app, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[2],
    )


def sigkill_once_started(worker: subprocess.Popen[str], ledgers: list[Path]) -> None:
    """SIGKILL ``worker`` once each run has started (written its ledger file)."""
    try:
        deadline = time.monotonic() + 20
        while not all(drainapp.started(ledger) for ledger in ledgers):
            assert time.monotonic() < deadline, "the worker never started every run"
            time.sleep(0.02)
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.communicate(timeout=20)


def test_sigterm_releases_the_run_at_a_boundary(database_url: str, tmp_path: Path) -> None:
    ledger = tmp_path / "executions.txt"
    app = drainapp.app
    app.database_url = database_url
    try:
        run_id = app.start(drainapp.three_slow_steps, str(ledger))
        worker = durably_cli(database_url, "worker", "--lease-ttl", "30")
        try:
            deadline = time.monotonic() + 20
            while not drainapp.started(ledger) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert drainapp.started(ledger), "the worker never started the run"
            worker.send_signal(signal.SIGTERM)
            _, stderr = worker.communicate(timeout=20)
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.communicate()
        assert worker.returncode == 0, stderr

        released = app.get_run(run_id)
        assert released.status is RunStatus.RUNNING
        types = [e.type for e in app.events(run_id)]
        assert "run_released" in types
        done_before = types.count("step_succeeded")
        assert 1 <= done_before < 3

        # The lease was released, not left to expire: a new worker starts at once.
        finisher = durably_cli(database_url, "worker", "--until-idle")
        _, stderr = finisher.communicate(timeout=30)
        assert finisher.returncode == 0, stderr
        finished = app.get_run(run_id)
        assert finished.status is RunStatus.COMPLETED
        assert finished.result == [0, 1, 2]
        assert "run_recovered" not in [e.type for e in app.events(run_id)]
        assert sorted(ledger.read_text().split()) == ["0", "1", "2"]
    finally:
        app.close()
