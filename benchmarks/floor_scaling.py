"""PostgreSQL scaling: steps/s of W2-style runs (3 steps each) worked by 1, 2, 4 worker
processes sharing one database, every step verified to have run exactly once.

The parent (:func:`measure`) queues the runs, then launches P children of this module
(``work URL CONCURRENCY``). Each imports durably, opens its store and prints ``ready``;
once all are ready each gets ``go`` on stdin and works like ``durably worker --until-idle``
with ``CONCURRENCY`` runs at once. The figure is from "go" to the last child's exit. Step
bodies append ``<run> <step> <pid>`` to a shared log (``floor_app``), so a step run twice, by
the same process or two, is caught.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import durably
from benchmarks import floor_app
from benchmarks.floor_measure import CheckFailed
from benchmarks.places import REPO_ROOT

STEPS = 3


@dataclass(frozen=True)
class Scaling:
    processes: int
    concurrency: int
    """Runs at once in each process."""
    runs: int
    seconds: float
    cpu_s: float
    """CPU of the worker processes while they worked (the server's is not counted)."""

    @property
    def steps_per_s(self) -> float:
        return self.runs * STEPS / self.seconds


def measure(url: str, runs: int, processes: int, concurrency: int, log: Path) -> Scaling:
    """One measurement on the (fresh) database ``url``."""
    app = floor_app.build(url)
    try:
        for i in range(runs):
            app.start(floor_app.WORKFLOW, i, STEPS, run_id=floor_app.run_id(i))
    finally:
        app.close()
    env = {**os.environ, floor_app.LOG_ENV: str(log)}
    env.pop("DURABLY_DATABASE_URL", None)
    env.pop(floor_app.BLOCK_ENV, None)
    command = [sys.executable, "-m", "benchmarks.floor_scaling", "work", url, str(concurrency)]
    with contextlib.ExitStack() as stack:
        children = []
        for _ in range(processes):
            child = subprocess.Popen(
                command, cwd=REPO_ROOT, env=env, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            stack.callback(child.kill)
            children.append(child)
        for child in children:
            assert child.stdout is not None
            if child.stdout.readline().strip() != "ready":
                raise CheckFailed(f"scaling: a worker did not start ({child.wait()})")
        started = time.perf_counter()
        for child in children:
            assert child.stdin is not None
            child.stdin.write("go\n")
            child.stdin.flush()
        reports = [child.communicate(timeout=600)[0] for child in children]
        seconds = time.perf_counter() - started
    if any(child.returncode != 0 for child in children):
        raise CheckFailed(f"scaling: workers exited {[c.returncode for c in children]}")
    done = [json.loads(report.strip().splitlines()[-1]) for report in reports]
    _verify(url, runs, log, sum(d["executed"] for d in done))
    return Scaling(processes, concurrency, runs, seconds, sum(d["cpu_s"] for d in done))


def _verify(url: str, runs: int, log: Path, executed: int) -> None:
    """Each run completed once, at epoch 1, and each of its steps executed exactly once."""
    problems: list[str] = []
    if executed != runs:
        problems.append(f"the workers executed {executed} runs for {runs}")
    app = durably.App(url)
    try:
        done = app.list_runs(status=durably.RunStatus.COMPLETED, limit=runs + 10)
        results = {r.run_id: r.result for r in done}
        for i in range(runs):
            want = {"i": i, "steps": STEPS, "lease_epoch": 1}
            if results.get(floor_app.run_id(i)) != want:
                problems.append(f"{floor_app.run_id(i)}: {results.get(floor_app.run_id(i))}")
    finally:
        app.close()
    counts = Counter((int(i), int(k)) for i, k, _ in (ln.split() for ln in log.open()))
    wanted = Counter({(i, k): 1 for i in range(runs) for k in range(1, STEPS + 1)})
    if counts != wanted:
        problems.append(
            f"step bodies: {len(counts - wanted)} ran twice, {len(wanted - counts)} never ran"
        )
    if problems:
        raise CheckFailed(f"scaling: {len(problems)} problems, e.g. {problems[:3]}")


def work(url: str, concurrency: int) -> None:
    app = floor_app.build(url)
    app.list_runs(limit=1)  # opens the store and its connection pool before the clock
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        raise SystemExit(2)
    cpu = time.process_time()
    executed = app.worker(concurrency=concurrency).run(until_idle=True)
    cpu = time.process_time() - cpu
    app.close()
    print(json.dumps({"executed": executed, "cpu_s": cpu}), flush=True)


if __name__ == "__main__":
    verb, db, level = sys.argv[1:]
    work(db, int(level))
