"""An idle worker beside many waiting runs: what waiting costs.

Agent runs spend most of their lives waiting: for an approval, a webhook, a timer. A
worker with nothing to do polls: each of its slots asks the store, twice a second, whether
a run is due, and claims what is. This measures what that costs as the waiting runs pile
up: the CPU an idle worker (and, on PostgreSQL, the server) spends per second beside N
runs waiting for an event, against the same worker beside none, in the same run.

    .venv/bin/python benchmarks/idle.py                    # 5,000 waiting, 16 slots, 5 s
    .venv/bin/python benchmarks/idle.py --backend sqlite --waiting 10000 --seconds 10
    .venv/bin/python benchmarks/idle.py --quick            # a smoke run

Each measurement checks that every waiting run is still waiting when the worker stops, its
journal as it was: the worker claimed and executed nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import durably
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


class CheckFailed(Exception):
    """A waiting run was claimed, executed or changed by the idle worker."""


def build(url: str) -> durably.App:
    app = durably.App(url)

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


def idle(
    url: str, runs: int, concurrency: int, seconds: float, postmaster: int | None
) -> tuple[float, float | None]:
    """CPU seconds per second of an idle worker, and of the PostgreSQL server whose main
    process is ``postmaster`` (None: no server measured), beside the ``runs`` parked runs;
    checks that it left them as they were."""
    app = build(url)

    def server_cpu_s() -> float | None:
        return None if postmaster is None else postgres_cpu_s(postmaster)

    async def go() -> tuple[float, float | None, int]:
        before = {r.run_id: r.updated_at for r in await parked(app, runs)}
        worker = app.worker(concurrency=concurrency)
        working = asyncio.create_task(worker.run_async())
        await asyncio.sleep(1.0)  # started: store open, slots idle
        cpu0, server0, t0 = time.process_time(), server_cpu_s(), time.perf_counter()
        await asyncio.sleep(seconds)
        cpu1, server1, t1 = time.process_time(), server_cpu_s(), time.perf_counter()
        worker.stop()
        executed = await working
        after = {r.run_id: r.updated_at for r in await parked(app, runs)}
        if after != before:
            raise CheckFailed("the idle worker changed a waiting run")
        await app.close_async()
        server = None if server0 is None or server1 is None else (server1 - server0) / (t1 - t0)
        return (cpu1 - cpu0) / (t1 - t0), server, executed

    worker_cpu, server_cpu, executed = asyncio.run(go())
    if executed:
        raise CheckFailed(f"the idle worker executed {executed} runs")
    return worker_cpu, server_cpu


async def parked(app: durably.App, runs: int) -> list[durably.Run]:
    waiting = await app.list_runs_async(status=durably.RunStatus.WAITING_EXTERNAL, limit=runs + 1)
    if len(waiting) != runs:
        raise CheckFailed(f"{len(waiting)} runs wait, not {runs}")
    return waiting


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--backend", default=",".join(BACKENDS), help="sqlite,postgres (both)")
    p.add_argument("--postgres-url", default=DEFAULT_POSTGRES_URL)
    p.add_argument("--dir", help="where the SQLite databases go (default: a real disk)")
    p.add_argument("--waiting", type=int, help="runs waiting for an event (5000)")
    p.add_argument("--concurrency", type=int, default=16, help="the idle worker's slots (16)")
    p.add_argument("--seconds", type=float, help="how long it is measured idle (5)")
    p.add_argument("--quick", action="store_true", help="a smoke run (rough figures)")
    args = p.parse_args(argv)
    waiting = args.waiting or (50 if args.quick else 5000)
    seconds = args.seconds or (1.0 if args.quick else 5.0)
    backends = [b for b in args.backend.split(",") if b]
    if not backends or set(backends) - set(BACKENDS):
        p.error(f"--backend: one or both of {','.join(BACKENDS)}")
    base, fs, why = choose_base(args.dir)
    print(f"environment: {json.dumps(environment())}")
    print(f"SQLite databases in {fs.describe()}: {why}")
    admin = None
    if "postgres" in backends:
        admin = PostgresAdmin(args.postgres_url, "durably_idle_", hint="or --backend sqlite")
    print(
        f"an idle worker of {args.concurrency} slots, measured {seconds:g} s beside 0 and "
        f"{waiting:,} runs waiting for an event"
    )
    print(f"{'backend':8} {'waiting':>8} {'worker CPU':>11} {'server CPU':>11} {'vs none':>8}")
    try:
        for backend in backends:
            alone = None
            for runs in (0, waiting):
                place: Any
                postmaster = None
                if backend == "sqlite":
                    place = SQLiteFile(base, "idle")
                else:
                    assert admin is not None
                    place = PostgresSchema(admin, admin.schema_name("idle", runs))
                    postmaster = admin.postmaster_pid()
                try:
                    park(place.url(), runs)
                    worker, server = idle(place.url(), runs, args.concurrency, seconds, postmaster)
                finally:
                    place.drop()
                total = worker + (server or 0.0)
                alone = total if alone is None else alone
                shown = "-" if server is None else f"{server * 1e3:.1f} ms"
                print(
                    f"{backend:8} {runs:>8,} {worker * 1e3:>8.1f} ms {shown:>11} "
                    f"{total / alone:>7.2f}x"
                )
    except CheckFailed as exc:
        print(f"CHECK FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        if admin is not None:
            admin.close()
    print(
        "worker CPU, server CPU: CPU seconds per second of the idle worker's process and of "
        "the PostgreSQL server's processes (other sessions' included; '-': not on this "
        "machine), in ms/s. vs none: worker + server against the same worker beside no "
        "waiting run."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
