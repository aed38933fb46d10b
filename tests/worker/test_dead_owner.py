"""A worker killed on this machine: a new worker recovers its runs at once, not after the lease.

The lease is 60 s, far beyond the test's patience: a worker that waited it out would fail.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from durably import RunStatus, owners
from tests.conftest import fetch_sql
from tests.worker import drainapp
from tests.worker.test_shutdown import durably_cli, sigkill_once_started

LEASE_TTL_S = 60


def test_the_runs_of_a_killed_worker_are_recovered_without_waiting_out_its_lease(
    database_url: str, tmp_path: Path
) -> None:
    ledgers = [tmp_path / f"executions-{i}.txt" for i in range(2)]
    app = drainapp.app
    app.database_url = database_url
    try:
        run_ids = [app.start(drainapp.three_slow_steps, str(ledger)) for ledger in ledgers]
        worker = durably_cli(
            database_url, "worker", "--lease-ttl", str(LEASE_TTL_S), "--concurrency", "2"
        )
        sigkill_once_started(worker, ledgers)
        held = {
            run_id: (status, owner, until)
            for run_id, status, owner, until in fetch_sql(
                database_url, "SELECT run_id, status, lease_owner, lease_until FROM durably_runs"
            )
        }
        for status, owner, until in held.values():
            assert status == "running"
            assert owner is not None
            assert until > time.time() + LEASE_TTL_S / 2

        started = time.monotonic()
        finisher = durably_cli(database_url, "worker", "--until-idle")
        _, stderr = finisher.communicate(timeout=LEASE_TTL_S / 2)
        assert finisher.returncode == 0, stderr
        assert time.monotonic() - started < LEASE_TTL_S / 2
        for run_id, ledger in zip(run_ids, ledgers, strict=True):
            done = app.get_run(run_id)
            assert done.status is RunStatus.COMPLETED, done
            assert done.result == [0, 1, 2]
            recovered = [e for e in app.events(run_id) if e.type == "run_recovered"]
            assert [e.payload["previous_owner"] for e in recovered] == [held[run_id][1]]
            # A step the killed worker had not recorded runs again; a recorded one does not.
            recorded = [e.step_id for e in app.events(run_id) if e.type == "step_succeeded"]
            executions = ledger.read_text().split()
            assert sorted(set(executions)) == ["0", "1", "2"]
            assert len(executions) <= len(recorded) + 1
    finally:
        app.close()


def spawn_sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def owner_of(pid: int, machine: str | None = None) -> str:
    return f"worker:host:{pid}:0123abcd:{machine or owners.machine()}"


def test_only_a_process_that_is_provably_gone_is_judged_dead() -> None:
    assert owners.machine() is not None, "this test needs Linux's /proc"
    alive = spawn_sleeper()
    zombie = spawn_sleeper()
    reaped = spawn_sleeper()
    try:
        zombie.send_signal(signal.SIGKILL)
        reaped.send_signal(signal.SIGKILL)
        reaped.wait()
        deadline = time.monotonic() + 10
        while not owners.dead([owner_of(zombie.pid)]):  # killed, not reaped yet: a zombie
            assert time.monotonic() < deadline, "the killed child never became a zombie"
            time.sleep(0.01)
        assert owners.dead([owner_of(reaped.pid)]) == [owner_of(reaped.pid)]
        assert owners.dead([owner_of(alive.pid), owner_of(os.getpid())]) == []
        # Another machine's (or container's) pid means nothing here; nor an unknown format.
        assert owners.dead([owner_of(reaped.pid, "ffffffffffff")]) == []
        assert owners.dead([f"worker:host:{reaped.pid}:0123abcd", "someone"]) == []
    finally:
        alive.kill()
        alive.wait()
        zombie.wait()


@pytest.mark.parametrize("kind", ["worker", "inproc"])
def test_owner_names_carry_this_machine(kind: str) -> None:
    name = owners.owner_name(kind)
    assert name.startswith(f"{kind}:")
    assert name.endswith(f":{owners.machine()}")
    assert owners.dead([name]) == []
