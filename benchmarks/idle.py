"""An idle worker beside many runs it must not touch: what waiting, and other workers'
runs, cost.

Agent runs spend most of their lives waiting: for an approval, a webhook, a timer. A
worker with nothing to do polls: each of its slots asks the store, twice a second, whether
a run is due, and claims what is. This measures what that costs as the runs it cannot
take pile up: the CPU an idle worker (and, on PostgreSQL, the server) spends per second
beside N runs, against the same worker beside none, in the same run. Two kinds of runs:

* *waiting*: N runs waiting for an event;
* *held*: N runs another worker process holds, each blocked in a step. That process is
  stopped (SIGSTOP) while the idle worker is measured: it renews nothing and costs nothing,
  yet it is alive, so its leases (600 s) stand and the idle worker may take none of them.

    .venv/bin/python benchmarks/idle.py                    # 5,000 of each, 16 slots, 5 s
    .venv/bin/python benchmarks/idle.py --backend sqlite --runs 10000 --seconds 10
    .venv/bin/python benchmarks/idle.py --beside held      # only the held runs
    .venv/bin/python benchmarks/idle.py --quick            # a smoke run

Each measurement checks that the idle worker executed nothing and left every run as it
was: still waiting, or still running under its holder, not written since.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import durably
from benchmarks import floor_app, floor_recovery
from benchmarks.fleet import postgres_cpu_s
from benchmarks.places import (
    DEFAULT_POSTGRES_URL,
    PostgresAdmin,
    PostgresSchema,
    SQLiteFile,
    choose_base,
    environment,
)

BACKENDS = ("sqlite", "postgres")
BESIDE = ("waiting", "held")
HELD_LEASE_S = 600.0
"""The held runs' lease: far longer than a measurement, so none runs out during one."""


class CheckFailed(Exception):
    """A run beside the idle worker was claimed, executed or changed by it."""


def build(url: str) -> durably.App:
    """An App with both kinds' workflows: ``parked``, and the held runs' ``chain``."""
    app = floor_app.build(url)

    @app.workflow()
    async def parked(i: int) -> Any:
        return await durably.wait_for_event("go")

    return app


def park(url: str, runs: int) -> None:
    """``runs`` runs, each executed until it waits for its event."""
    app = build(url)
    try:
        for i in range(runs):
            app.start("parked", i, run_id=f"parked-{i:06d}")
        executed = app.worker(concurrency=64).run(until_idle=True)
        if executed != runs:
            raise CheckFailed(f"{executed} of {runs} runs reached their wait")
    finally:
        app.close()


@contextlib.contextmanager
def held(url: str, runs: int) -> Iterator[None]:
    """``runs`` runs held by a worker process, each blocked in a step; the process is
    stopped (alive, silent) until the block ends, then killed."""
    app = durably.App(url)
    try:
        with (
            tempfile.TemporaryDirectory() as scratch,
            floor_recovery.holding(app, url, runs, HELD_LEASE_S, Path(scratch, "log")) as holder,
        ):
            holder.send_signal(signal.SIGSTOP)
            yield
    except floor_recovery.CheckFailed as exc:
        raise CheckFailed(str(exc)) from exc
    finally:
        app.close()


def idle(
    url: str,
    runs: int,
    status: durably.RunStatus,
    concurrency: int,
    seconds: float,
    postmaster: int | None,
) -> tuple[float, float | None]:
    """CPU seconds per second of an idle worker, and of the PostgreSQL server whose main
    process is ``postmaster`` (None: no server measured), beside the ``runs`` runs in
    ``status``; checks that it left them as they were."""
    app = build(url)

    def server_cpu_s() -> float | None:
        return None if postmaster is None else postgres_cpu_s(postmaster)

    async def go() -> tuple[float, float | None, int]:
        before = {r.run_id: r.updated_at for r in await beside(app, runs, status)}
        worker = app.worker(concurrency=concurrency)
        working = asyncio.create_task(worker.run_async())
        await asyncio.sleep(1.0)  # started: store open, slots idle
        cpu0, server0, t0 = time.process_time(), server_cpu_s(), time.perf_counter()
        await asyncio.sleep(seconds)
        cpu1, server1, t1 = time.process_time(), server_cpu_s(), time.perf_counter()
        worker.stop()
        executed = await working
        after = {r.run_id: r.updated_at for r in await beside(app, runs, status)}
        if after != before:
            raise CheckFailed(f"the idle worker changed a run in {status.value}")
        await app.close_async()
        server = None if server0 is None or server1 is None else (server1 - server0) / (t1 - t0)
        return (cpu1 - cpu0) / (t1 - t0), server, executed

    worker_cpu, server_cpu, executed = asyncio.run(go())
    if executed:
        raise CheckFailed(f"the idle worker executed {executed} runs")
    return worker_cpu, server_cpu


async def beside(app: durably.App, runs: int, status: durably.RunStatus) -> list[durably.Run]:
    found = await app.list_runs_async(status=status, limit=runs + 1)
    if len(found) != runs:
        raise CheckFailed(f"{len(found)} runs in {status.value}, not {runs}")
    return found


@contextlib.contextmanager
def populated(url: str, kind: str, runs: int) -> Iterator[durably.RunStatus]:
    """``runs`` runs of ``kind`` on ``url`` for as long as the block lasts; their status."""
    if kind == "waiting":
        park(url, runs)
        yield durably.RunStatus.WAITING_EXTERNAL
    elif runs == 0:
        yield durably.RunStatus.RUNNING
    else:
        with held(url, runs):
            yield durably.RunStatus.RUNNING


def measure(
    backend: str,
    kinds: list[str],
    runs: int,
    concurrency: int,
    seconds: float,
    base: Path,
    admin: PostgresAdmin | None,
) -> None:
    """Print one row beside no run, then one for ``runs`` runs of each kind."""
    alone = None
    for kind, count in [(kinds[0], 0), *((k, runs) for k in kinds)]:
        place: Any
        postmaster = None
        if backend == "sqlite":
            place = SQLiteFile(base, "idle")
        else:
            assert admin is not None
            place = PostgresSchema(admin, admin.schema_name("idle", kind, count))
            postmaster = admin.postmaster_pid()
        try:
            with populated(place.url(), kind, count) as status:
                worker, server = idle(place.url(), count, status, concurrency, seconds, postmaster)
        finally:
            place.drop()
        total = worker + (server or 0.0)
        alone = total if alone is None else alone
        shown = "-" if server is None else f"{server * 1e3:.1f} ms"
        label = "none" if count == 0 else f"{count:,} {kind}"
        print(f"{backend:8} {label:>14} {worker * 1e3:>8.1f} ms {shown:>11} {total / alone:>7.2f}x")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--backend", default=",".join(BACKENDS), help="sqlite,postgres (both)")
    p.add_argument("--postgres-url", default=DEFAULT_POSTGRES_URL)
    p.add_argument("--dir", help="where the SQLite databases go (default: a real disk)")
    p.add_argument("--beside", default=",".join(BESIDE), help="waiting,held (both)")
    p.add_argument("--runs", type=int, help="runs of each kind beside the worker (5000)")
    p.add_argument("--concurrency", type=int, default=16, help="the idle worker's slots (16)")
    p.add_argument("--seconds", type=float, help="how long it is measured idle (5)")
    p.add_argument("--quick", action="store_true", help="a smoke run (rough figures)")
    args = p.parse_args(argv)
    runs = args.runs or (50 if args.quick else 5000)
    seconds = args.seconds or (1.0 if args.quick else 5.0)
    backends = [b for b in args.backend.split(",") if b]
    if not backends or set(backends) - set(BACKENDS):
        p.error(f"--backend: one or both of {','.join(BACKENDS)}")
    kinds = [k for k in args.beside.split(",") if k]
    if not kinds or set(kinds) - set(BESIDE):
        p.error(f"--beside: one or both of {','.join(BESIDE)}")
    base, fs, why = choose_base(args.dir)
    print(f"environment: {json.dumps(environment())}")
    print(f"SQLite databases in {fs.describe()}: {why}")
    admin = None
    if "postgres" in backends:
        admin = PostgresAdmin(args.postgres_url, "durably_idle_", hint="or --backend sqlite")
    print(
        f"an idle worker of {args.concurrency} slots, measured {seconds:g} s beside no run, "
        f"then beside {runs:,} runs {' / '.join(kinds)}"
    )
    print(f"{'backend':8} {'beside':>14} {'worker CPU':>11} {'server CPU':>11} {'vs none':>8}")
    try:
        for backend in backends:
            measure(backend, kinds, runs, args.concurrency, seconds, base, admin)
    except CheckFailed as exc:
        print(f"CHECK FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        if admin is not None:
            admin.close()
    print(
        "worker CPU, server CPU: CPU seconds per second of the idle worker's process and of "
        "the PostgreSQL server's processes (other sessions' included; '-': not on this "
        "machine), in ms/s. vs none: worker + server against the same worker beside no run."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
