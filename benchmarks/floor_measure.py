"""The floor benchmark's in-process measurements (W1, W2, per effect) and their raw
baselines, each on a fresh SQLite file or PostgreSQL schema, each verified.

A measurement returns a :class:`Sample`: wall seconds, the process's CPU seconds (every
thread: durably executes on the App's loop thread) and how many units (steps, runs,
commits) they cover. Verification reads the journal back through durably's public API
and compares it with the step bodies' own count (``floor_app.EXECUTED``).
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import durably
from benchmarks import floor_app
from benchmarks.baselines import WARMUP, PgFloorWriter, SQLiteRawWriter
from benchmarks.workloads import CASES, op_us


class CheckFailed(Exception):
    """A run, a step or a commit did not happen exactly once."""


@dataclass(frozen=True)
class Sample:
    seconds: float
    cpu_s: float
    units: int
    wal_bytes: int | None = None
    """PostgreSQL: growth of the cluster's WAL insert position over the measurement."""

    @property
    def ms_per_unit(self) -> float:
        return self.seconds / self.units * 1e3

    @property
    def cpu_ms_per_unit(self) -> float:
        return self.cpu_s / self.units * 1e3

    @property
    def per_s(self) -> float:
        return self.units / self.seconds


WalReader = Callable[[], int] | None


@contextmanager
def clock(units: int, wal: WalReader, out: list[Sample]) -> Iterator[None]:
    """Time the block (wall, CPU, WAL) and append its Sample to ``out``."""
    gc.collect()
    wal0 = wal() if wal else None
    cpu0, t0 = time.process_time(), time.perf_counter()
    yield
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    wal_bytes = wal() - wal0 if wal and wal0 is not None else None
    out.append(Sample(seconds, cpu, units, wal_bytes))


# -- raw baselines --------------------------------------------------------------------------


def raw_sqlite(path: Path, commits: int) -> Sample:
    """``commits`` raw SQLite commits, one after another (see ``SQLiteRawWriter``)."""
    writer = SQLiteRawWriter(path)
    out: list[Sample] = []
    try:
        writer.warm_up()
        with clock(commits, None, out):
            for i in range(commits):
                writer.commit(i)
    finally:
        writer.close()
    _check_rows(commits, writer.path)
    return out[0]


def _check_rows(commits: int, path: Path) -> None:
    import sqlite3

    conn = sqlite3.connect(path)
    try:
        rows = conn.execute("SELECT count(*) FROM bench_rows").fetchone()[0] - WARMUP
    finally:
        conn.close()
    if rows != commits:
        raise CheckFailed(f"raw SQLite: {rows} rows after {commits} commits")


def raw_postgres(url: str, commits: int, wal: WalReader) -> Sample:
    """``commits`` one-round-trip raw PostgreSQL commits (see ``PgFloorWriter``)."""
    out: list[Sample] = []

    async def go() -> None:
        writer = PgFloorWriter(url)
        try:
            await writer.open()
            await writer.warm_up()
            with clock(commits, wal, out):
                for i in range(commits):
                    await writer.commit(i)
            cur = await writer.conn.execute("SELECT count(*) FROM bench_rows")
            row = await cur.fetchone()
            if row is None or row[0] != commits + WARMUP:
                raise CheckFailed(f"raw PostgreSQL: {row} rows after {commits} + warm-up commits")
        finally:
            await writer.close()

    asyncio.run(go())
    return out[0]


# -- durably --------------------------------------------------------------------------------


def _verify(app: durably.App, indexes: range, steps: int, epoch: int = 1) -> None:
    """Each run completed once (its fencing token is ``epoch``), with ``steps`` steps in its
    journal, and every step body executed exactly once in this process."""
    problems: list[str] = []
    expected = {"steps": steps, "lease_epoch": epoch}
    for i in indexes:
        run = app.get_run(floor_app.run_id(i))
        if run.status is not durably.RunStatus.COMPLETED or run.result != {"i": i, **expected}:
            problems.append(f"{run.run_id}: {run.status} {run.result} {run.error}")
            continue
        kinds = Counter(step["kind"] for step in app.describe(run.run_id)["steps"])
        if kinds != Counter(step=steps):
            problems.append(f"{run.run_id}: journal holds {dict(kinds)}")
    wanted = Counter({(i, k): 1 for i in indexes for k in range(1, steps + 1)})
    if wanted != floor_app.EXECUTED:
        extra = floor_app.EXECUTED - wanted
        missing = wanted - floor_app.EXECUTED
        problems.append(f"step bodies: {len(extra)} ran twice, {len(missing)} never ran")
    if problems:
        raise CheckFailed(f"{len(problems)} problems, e.g. {problems[:3]}")


def _warmed(url: str, sync_step: bool = False) -> durably.App:
    """An App whose store is open, migrated and warm; the step bodies' count is reset."""
    app = floor_app.build(url, sync_step=sync_step)
    for i in range(3):
        app.run(floor_app.WORKFLOW, -1 - i, 3, run_id=f"warm-{i}")
    floor_app.EXECUTED.clear()
    return app


def w1(url: str, steps: int, wal: WalReader, *, sync_step: bool = False) -> Sample:
    """W1: one run of ``steps`` sequential steps, start to completion."""
    app = _warmed(url, sync_step)
    out: list[Sample] = []
    try:
        with clock(steps, wal, out):
            app.run(floor_app.WORKFLOW, 0, steps, run_id=floor_app.run_id(0))
        _verify(app, range(1), steps)
    finally:
        app.close()
    return out[0]


def w2_sequential(url: str, runs: int, steps: int) -> Sample:
    """W2: ``runs`` runs of ``steps`` steps, each started and executed to completion in
    turn by this process (``app.run``)."""
    app = _warmed(url)
    out: list[Sample] = []
    try:
        with clock(runs, None, out):
            for i in range(runs):
                app.run(floor_app.WORKFLOW, i, steps, run_id=floor_app.run_id(i))
        _verify(app, range(runs), steps)
    finally:
        app.close()
    return out[0]


def w2_concurrent(url: str, runs: int, steps: int, concurrency: int) -> Sample:
    """W2 with ``concurrency`` runs at once in one worker: ``runs`` runs are queued first
    (not timed), then the worker executes them until none is left. Units: steps."""
    app = _warmed(url)
    out: list[Sample] = []
    try:
        for i in range(runs):
            app.start(floor_app.WORKFLOW, i, steps, run_id=floor_app.run_id(i))
        worker = app.worker(concurrency=concurrency)
        with clock(runs * steps, None, out):
            executed = worker.run(until_idle=True)
        if executed != runs:
            raise CheckFailed(f"the worker executed {executed} runs for {runs}")
        _verify(app, range(runs), steps)
    finally:
        app.close()
    return out[0]


def effect_us(url: str, effects: int) -> float:
    """µs per ``@app.tool(idempotent=True)`` call (``overhead.py``'s case, which checks
    that its run completed)."""
    case = next(c for c in CASES if c.key == "tool_idempotent")
    return op_us(case, url, effects)[0]
