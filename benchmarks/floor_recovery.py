"""W3: a process holding many runs, each blocked in step 6 of 10, is killed; a fresh
process recovers and completes them all. How long does that take, and is every step of
every run recorded exactly once?

The parent (:func:`measure`) launches two child processes of this module:

* ``hold URL RUNS [TTL]`` starts RUNS runs of ``chain(i, 10, block_at=6)`` and works on
  all of them at once, with ``$DURABLY_FLOOR_BLOCK`` set: step 6 never returns. The parent
  waits until every run is in step 6 (the step bodies' log says it entered, the store says
  the run is running with its first 5 steps recorded), then SIGKILLs it.
* ``recover URL RUNS CONCURRENCY`` runs a worker until every run is completed.

The figure is from the recovering process's launch to the last run's completion (the
database's ``updated_at``, same host). A dead owner's lease is waited out: a run becomes
claimable when its lease expires (``--lease-ttl``, default the worker's).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import durably
from benchmarks import floor_app
from benchmarks.floor_measure import CheckFailed
from benchmarks.places import REPO_ROOT

STEPS, BLOCK_AT = 10, 6
HOLD_TIMEOUT_S = 180.0
PROFILE_ENV = "DURABLY_FLOOR_PROFILE"
"""When set, the recovering process runs under cProfile and writes its stats there."""


@dataclass(frozen=True)
class Recovery:
    runs: int
    lease_ttl_s: float
    blocked_s: float
    """Launch of the holding process to every run blocked in step 6."""
    total_s: float
    """Launch of the recovering process to the last run completed: the W3 figure."""
    first_claim_s: float
    """Launch of the recovering process to its first recovery (mostly the lease wait)."""
    last_claim_s: float
    """... to its last recovery: the dead owner's leases expire as spread out as they were
    taken and renewed."""
    cpu_s: float
    """CPU of the recovering process (start-up included)."""


def _env(log: Path) -> dict[str, str]:
    """A child's environment: its step bodies logged to ``log``, on the URL it is given."""
    env = {**os.environ, floor_app.LOG_ENV: str(log)}
    env.pop("DURABLY_DATABASE_URL", None)
    return env


def _child(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "benchmarks.floor_recovery", *args]
    return subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, text=True)


def _read_log(log: Path) -> list[tuple[int, int, int]]:
    if not log.exists():
        return []
    return [
        (int(i), int(k), int(pid))
        for i, k, pid in (line.split() for line in log.read_text().splitlines())
    ]


def _wait_blocked(app: durably.App, log: Path, runs: int, holder: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + HOLD_TIMEOUT_S
    blocked: set[str] = set()
    with contextlib.ExitStack() as stack:
        # Read as it grows (10,000 runs write 60,000 lines), not again from the start.
        tail, partial = None, ""
        while len(blocked) < runs:
            if holder.poll() is not None or time.monotonic() > deadline:
                raise CheckFailed("W3: the holding process did not get every run to step 6")
            time.sleep(0.05)
            if tail is None and log.exists():
                tail = stack.enter_context(log.open())
            text = partial + (tail.read() if tail is not None else "")
            *lines, partial = text.split("\n")  # a line being written is kept for later
            blocked.update(i for i, k, _ in (ln.split() for ln in lines) if int(k) == BLOCK_AT)
    running = app.list_runs(status=durably.RunStatus.RUNNING, limit=runs + 10)
    if len(running) != runs:
        raise CheckFailed(f"W3: {len(running)} runs running before the kill, expected {runs}")
    for run in running:
        done = [s for s in app.describe(run.run_id)["steps"] if s["status"] == "succeeded"]
        if len(done) != BLOCK_AT - 1:
            raise CheckFailed(f"W3: {run.run_id} has {len(done)} steps recorded before the kill")


def _verify(app: durably.App, log: Path, runs: int, holder: int, fresh: int) -> tuple[float, float]:
    """Every run completed at epoch 2 with 10 steps and one recovery; steps 1-5 ran once
    in the holder, 7-10 once in the fresh process, 6 once in each. Returns when the
    fresh process recovered its first and its last run (database clock)."""
    problems: list[str] = []
    recoveries: list[float] = []
    for i in range(runs):
        run = app.get_run(floor_app.run_id(i))
        if run.result != {"i": i, "steps": STEPS, "lease_epoch": 2}:
            problems.append(f"{run.run_id}: {run.status} {run.result} {run.error}")
            continue
        steps = [s for s in app.describe(run.run_id)["steps"] if s["status"] == "succeeded"]
        recovered = [e for e in app.events(run.run_id) if e.type == "run_recovered"]
        if len(steps) != STEPS or len(recovered) != 1:
            problems.append(f"{run.run_id}: {len(steps)} steps, {len(recovered)} recoveries")
        recoveries += [e.created_at for e in recovered]
    by_step: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i, k, pid in _read_log(log):
        by_step[(i, k)].append(pid)
    for i in range(runs):
        for k in range(1, STEPS + 1):
            want = [holder, fresh] if k == BLOCK_AT else [holder] if k < BLOCK_AT else [fresh]
            if by_step.get((i, k)) != want:
                problems.append(f"step {k} of run {i} executed by {by_step.get((i, k))}")
    if problems:
        raise CheckFailed(f"W3: {len(problems)} problems, e.g. {problems[:3]}")
    return min(recoveries), max(recoveries)


@contextlib.contextmanager
def holding(
    app: durably.App, url: str, runs: int, lease_ttl_s: float | None, log: Path
) -> Iterator[subprocess.Popen[str]]:
    """A process holding ``runs`` new runs of ``chain``, each blocked in step 6 (its step
    bodies logged to ``log``), from when all are blocked until the block ends: then it is
    SIGKILLed. ``app``: on the same database, to check them."""
    ttl = [] if lease_ttl_s is None else [str(lease_ttl_s)]
    env = {**_env(log), floor_app.BLOCK_ENV: "1"}
    holder = _child(["hold", url, str(runs), *ttl], env)
    try:
        _wait_blocked(app, log, runs, holder)
        yield holder
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()


def measure(
    url: str, runs: int, concurrency: int, lease_ttl_s: float | None, log: Path
) -> Recovery:
    """One W3 measurement on the (fresh) database ``url``."""
    app = durably.App(url)
    try:
        started = time.time()
        with holding(app, url, runs, lease_ttl_s, log) as holder:
            blocked = time.time() - started
        launched = time.time()
        fresh = _child(["recover", url, str(runs), str(concurrency)], _env(log))
        out, _ = fresh.communicate(timeout=(lease_ttl_s or 30.0) + HOLD_TIMEOUT_S)
        if fresh.returncode != 0:
            raise CheckFailed(f"W3: the recovering process exited {fresh.returncode}")
        cpu_s = float(out.split()[-1])
        first, last_claim = _verify(app, log, runs, holder.pid, fresh.pid)
        completed = app.list_runs(status=durably.RunStatus.COMPLETED, limit=runs + 10)
        last = max(r.updated_at for r in completed)
        ttl_s = app.lease_ttl.total_seconds() if lease_ttl_s is None else lease_ttl_s
    finally:
        app.close()
    return Recovery(
        runs, ttl_s, blocked, last - launched, first - launched, last_claim - launched, cpu_s
    )


# -- the child processes --------------------------------------------------------------------


def hold(url: str, runs: int, lease_ttl_s: float | None) -> None:
    app = floor_app.build(url)
    for i in range(runs):
        app.start(floor_app.WORKFLOW, i, STEPS, BLOCK_AT, run_id=floor_app.run_id(i))
    ttl = None if lease_ttl_s is None else timedelta(seconds=lease_ttl_s)
    app.worker(concurrency=runs, lease_ttl=ttl).run()  # until SIGKILLed


def recover(url: str, runs: int, concurrency: int) -> None:
    app = floor_app.build(url)

    async def go() -> None:
        worker = app.worker(concurrency=concurrency)
        working = asyncio.create_task(worker.run_async())
        done = durably.RunStatus.COMPLETED
        # Polled in the measured process: a cheap probe (is any run still running?) before
        # the full count, which would decode every run 10 times a second (~12% of its CPU).
        while not working.done():
            await asyncio.sleep(0.1)
            if await app.list_runs_async(status=durably.RunStatus.RUNNING, limit=1):
                continue
            if len(await app.list_runs_async(status=done, limit=runs + 10)) >= runs:
                break
        worker.stop()
        await working
        await app.close_async()

    profile_to = os.environ.get(PROFILE_ENV)
    if profile_to:
        import cProfile

        cProfile.runctx("asyncio.run(go())", globals(), {"go": go}, profile_to)
    else:
        asyncio.run(go())
    cpu = os.times()
    print(cpu.user + cpu.system, flush=True)


if __name__ == "__main__":
    verb, db, count, *rest = sys.argv[1:]
    if verb == "hold":
        hold(db, int(count), float(rest[0]) if rest else None)
    else:
        recover(db, int(count), int(rest[0]))
