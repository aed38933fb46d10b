#!/usr/bin/env python
"""Throughput of durably worker processes on a many-run workload, PostgreSQL and SQLite.

    python benchmarks/throughput.py [--runs 200] [--processes 1,2,4] [--concurrency 4]
                                    [--repeat 3] [--quick] [--launcher runner|cli]
                                    [--postgres-url URL] [--no-sqlite] [--no-postgres]
                                    [--dir DIR] [--json PATH]

Each measurement uses a fresh database (PostgreSQL: a schema created and dropped here;
SQLite: a file). It starts every run first (``app.start`` in a loop: ``--runs`` runs of
``benchmarks.bench_app``'s ``job``, 2 steps and 2 idempotent effects each), then launches N
worker processes at once (``fleet.py``) and times them until all have exited. Then it
checks that every run completed exactly once (``checks.py``).

Throughput is given over two windows: ``wall`` (go or launch to last exit) and ``busy``
(from the first step recorded to the last run completed, by the database's clock: the
steady state). CPU figures come from the kernel: the worker processes' own and the
PostgreSQL server's (every ``postgres`` process's CPU in /proc, the postmaster's reaped
children included; other sessions on the same server would be counted too).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run as a script: import the benchmark modules as the `benchmarks` package, and let
    # no module of this directory shadow a top-level one.
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from benchmarks import bench_app
from benchmarks.checks import CheckFailed, check, read_back
from benchmarks.fleet import (
    APP_SPEC,
    LAUNCHERS,
    launch_cli,
    launch_runners,
    no_cpu,
    postgres_cpu_s,
    run_worker,
)
from benchmarks.places import (
    ATTEMPTS,
    DEFAULT_POSTGRES_URL,
    PostgresAdmin,
    PostgresSchema,
    SQLiteFile,
    choose_base,
    environment,
)
from benchmarks.render import (
    THROUGHPUT_LEGEND,
    measurement_line,
    throughput_document,
    throughput_table,
)
from benchmarks.stats import Measurement, summarise

SCHEMA_PREFIX = "durably_tput_"
FULL = {"runs": 200, "processes": "1,2,4", "repeat": 3}
QUICK = {"runs": 40, "processes": "1,2", "repeat": 1}
"""--quick: shows that every setting runs and passes its checks; the figures are rough."""

Database = SQLiteFile | PostgresSchema


def start_runs(url: str, runs: int) -> float:
    """Queue ``runs`` runs of the benchmark workflow; seconds taken."""
    app = bench_app.build(url)
    try:
        app.run(bench_app.WORKFLOW, -1)  # migrates, and checks the app works here
        started = time.perf_counter()
        for i in range(runs):
            app.start(bench_app.WORKFLOW, i, run_id=bench_app.run_id(i))
        return time.perf_counter() - started
    finally:
        app.close()


def measure_one(
    db: Database,
    processes: int,
    concurrency: int,
    runs: int,
    repeat: int,
    work: Path,
    launcher: str,
) -> Measurement:
    logs = work / f"{db.key}-p{processes}-r{repeat}"
    logs.mkdir()
    effect_log = logs / "effects.log"
    start_s = start_runs(db.url(), runs)
    launch = launch_runners if launcher == "runner" else launch_cli
    server_cpu = postgres_cpu_s if db.key == "postgres" else no_cpu
    wall, worker_cpu, server, executed = launch(
        db.url(), processes, concurrency, effect_log, logs, server_cpu
    )
    seen = read_back(db.url(), runs)
    checks = check(seen, runs, effect_log, executed)
    return Measurement(
        backend=db.key,
        processes=processes,
        concurrency=concurrency,
        runs=runs,
        repeat=repeat,
        start_s=start_s,
        wall_s=wall,
        busy_s=seen.busy_s,
        worker_cpu_s=worker_cpu,
        server_cpu_s=server,
        executed=executed,
        checks=checks,
    )


def measure_retrying(
    args: argparse.Namespace,
    backend: str,
    processes: int,
    r: int,
    work: Path,
    admin: PostgresAdmin | None,
) -> Measurement:
    """One measurement; taken again if the server restarted under it (another session's
    doing on a shared server: a restart can legitimately make durably recover a run, which
    the checks would then report, so such a measurement proves nothing either way)."""
    for n in range(1, ATTEMPTS + 1):
        db: Database
        if admin is not None and backend == "postgres":
            db = PostgresSchema(admin, admin.schema_name(processes, r, n))
        else:
            db = SQLiteFile(args.sqlite_base, "durably-throughput")
        epoch = db.epoch()
        failure: Exception | None = None
        try:
            m = measure_one(db, processes, args.concurrency, args.runs, r, work, args.launcher)
        except Exception as exc:
            failure = exc
        finally:
            db.drop()
        restarted = db.epoch() != epoch
        if failure is None and not restarted:
            return m
        if not restarted or n == ATTEMPTS:
            raise failure or CheckFailed(f"the server restarted during {ATTEMPTS} attempts")
        print(f"  {backend} {processes} proc: the server restarted meanwhile; measuring again")
    raise AssertionError("unreachable")


def measure_all(args: argparse.Namespace, work: Path) -> list[Measurement]:
    """Every (backend, processes) setting, ``--repeat`` times, in alternating order."""
    plan: list[tuple[str, int]] = []
    if not args.no_postgres:
        plan += [("postgres", p) for p in args.process_counts]
    if not args.no_sqlite:
        plan.append(("sqlite", 1))
    measurements: list[Measurement] = []
    admin = None
    if not args.no_postgres:
        admin = PostgresAdmin(
            args.postgres_url, SCHEMA_PREFIX, hint="pass --postgres-url or --no-postgres"
        )
        print(
            f"postgresql at {args.postgres_url}, "
            f"synchronous_commit={admin.show('synchronous_commit')}"
        )
    try:
        if not args.no_sqlite:
            args.sqlite_base, fs, _ = choose_base(args.dir)
            print(
                f"sqlite in {args.sqlite_base} ({fs.fstype} on {fs.mount_point}), synchronous=FULL"
            )
        for r in range(args.repeat):
            # Alternate the order so that slow drift does not favour one setting.
            for backend, processes in plan if r % 2 == 0 else list(reversed(plan)):
                m = measure_retrying(args, backend, processes, r, work, admin)
                measurements.append(m)
                print(measurement_line(m))
    finally:
        if admin is not None:
            admin.close()
    return measurements


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="durably worker throughput, many runs")
    parser.add_argument("--runs", type=int, help=f"runs per measurement ({FULL['runs']})")
    parser.add_argument(
        "--processes", help=f"worker process counts for PostgreSQL ({FULL['processes']})"
    )
    parser.add_argument(
        "--concurrency", type=int, default=4, help="runs each worker executes at once (4)"
    )
    parser.add_argument(
        "--launcher",
        choices=LAUNCHERS,
        default="runner",
        help="runner (default): gated worker processes, started and connected before the "
        "clock starts; cli: python -m durably ... worker --until-idle, timed from launch",
    )
    parser.add_argument("--repeat", type=int, help=f"measurements per setting ({FULL['repeat']})")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: runs {runs}, processes {processes}, repeat {repeat} "
        "(rough figures)".format(**QUICK),
    )
    parser.add_argument("--postgres-url", default=DEFAULT_POSTGRES_URL)
    parser.add_argument("--no-sqlite", action="store_true", help="skip the SQLite reference")
    parser.add_argument("--no-postgres", action="store_true", help="only the SQLite reference")
    parser.add_argument("--dir", help="where the SQLite databases go (a real disk)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.process_counts = sorted({int(p) for p in args.processes.split(",") if p.strip()})
    if args.runs < 1 or args.repeat < 1 or args.concurrency < 1 or not args.process_counts:
        parser.error("--runs, --repeat, --concurrency and --processes must be at least 1")
    if min(args.process_counts) < 1:
        parser.error("--processes must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    if raw[:1] == ["--run-worker"]:
        return run_worker(raw[1], int(raw[2]))
    args = parse_args(argv)
    env = environment()
    cores = os.cpu_count() or 1
    print(
        f"python {env['python']}, durably {env['durably']}, {cores} CPUs, "
        f"load average {env['load_average_at_start']}"
    )
    how = (
        f"python -m durably --app {APP_SPEC} --db URL worker --until-idle "
        f"--concurrency {args.concurrency}, timed from launch"
        if args.launcher == "cli"
        else f"gated runners (app.worker(concurrency={args.concurrency}).run(until_idle=True)), "
        "started and connected before the clock starts"
    )
    print(
        f"workload: {args.runs} runs x (2 steps + 2 idempotent effects, trivial async bodies); "
        f"workers: {how}"
    )
    if max(args.process_counts) > cores:
        print(
            f"note: {cores} CPU cores for the workers AND the database server: more processes "
            "than cores cannot scale linearly; what matters is that throughput holds and "
            "every run executes exactly once"
        )
    work = Path(tempfile.mkdtemp(prefix="durably-throughput-"))
    started = time.perf_counter()
    try:
        measurements = measure_all(args, work)
    except CheckFailed as exc:
        print(f"CHECK FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summaries = summarise(measurements, cores, bench_app.STEPS_PER_RUN, bench_app.EFFECTS_PER_RUN)
    print()
    print(throughput_table(summaries))
    print(THROUGHPUT_LEGEND)
    print(f"total {time.perf_counter() - started:.1f} s")
    if args.json:
        command = " ".join(["benchmarks/throughput.py", *raw])
        document: dict[str, Any] = throughput_document(
            command, cores, env["python"], env["durably"], summaries, measurements
        )
        Path(args.json).write_text(json.dumps(document, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
