#!/usr/bin/env python
"""Throughput of durably worker processes on a many-run workload, PostgreSQL and SQLite.

    python benchmarks/throughput.py [--runs 200] [--processes 1,2,4] [--concurrency 4]
                                    [--repeat 3] [--postgres-url URL] [--no-sqlite]
                                    [--dir DIR] [--json PATH]

Each measurement uses a fresh database (PostgreSQL: a schema created and dropped here;
SQLite: a file). It starts every run first (``app.start`` in a loop: ``--runs`` runs of
``benchmarks.bench_app``'s ``job``, 2 steps and 2 idempotent effects each), then launches N
``python -m durably --app benchmarks.bench_app:app --db URL worker --until-idle
--concurrency C`` processes at once and times them until all have exited. Then it checks
that every run completed exactly once: status ``completed``, claimed once (``lease_epoch``
1), no ``run_recovered`` event, 2 steps and 2 succeeded operations per run, and the tool
bodies' own log shows each of the 2 effects of every run executed exactly once.

Throughput is given over two windows: ``wall`` (launch to last exit: includes process start,
imports and connecting, about 0.3 s per process) and ``busy`` (from the first step recorded
to the last run completed, by the database's clock: the steady state). CPU figures come
from the kernel: the worker processes' own (``getrusage`` of the children) and the
PostgreSQL server's (every ``postgres`` process's CPU in /proc, the postmaster's reaped
children included; other sessions on the same server would be counted too).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import resource
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
if str(REPO_ROOT) not in sys.path:  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(REPO_ROOT))

import durably  # noqa: E402
from benchmarks import bench_app  # noqa: E402
from benchmarks.overhead import (  # noqa: E402
    ATTEMPTS,
    DEFAULT_POSTGRES_URL,
    choose_base,
    drop_stale_schemas,
    reconnect,
    server_epoch,
    with_pg_options,
)

APP_SPEC = "benchmarks.bench_app:app"
SCHEMA_PREFIX = "durably_tput_"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


# -- databases ------------------------------------------------------------------------------


class Database:
    """A fresh database per measurement, and the SQL the checks need."""

    key = ""

    def url(self) -> str:
        raise NotImplementedError

    def query(self, sql: str) -> list[tuple[Any, ...]]:
        raise NotImplementedError

    def drop(self) -> None:
        raise NotImplementedError

    def epoch(self) -> str | None:
        """Changes when the database server restarts."""
        return None


class PostgresServer:
    """The admin connection, re-opened if another session restarted the server."""

    def __init__(self, url: str) -> None:
        import psycopg

        self.url = url
        try:
            self._conn = psycopg.connect(url, autocommit=True, connect_timeout=5)
        except psycopg.OperationalError as exc:
            raise SystemExit(
                f"cannot connect to PostgreSQL at {url} ({exc}); pass --postgres-url or "
                "--no-postgres"
            ) from exc
        drop_stale_schemas(self._conn, url, SCHEMA_PREFIX)

    def conn(self) -> Any:
        self._conn = reconnect(self._conn, self.url)
        return self._conn

    def epoch(self) -> str | None:
        return server_epoch(self._conn)

    def close(self) -> None:
        self._conn.close()


class PostgresDatabase(Database):
    key = "postgres"

    def __init__(self, server: PostgresServer, schema: str) -> None:
        self.server = server
        self.schema = schema
        server.conn().execute(f'CREATE SCHEMA "{schema}"')

    def url(self) -> str:
        return with_pg_options(self.server.url, f"search_path={self.schema}")

    def query(self, sql: str) -> list[tuple[Any, ...]]:
        rows: list[tuple[Any, ...]] = (
            self.server.conn()
            .execute(sql.replace("durably_", f'"{self.schema}".durably_'))
            .fetchall()
        )
        return rows

    def drop(self) -> None:
        self.server.conn().execute(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE')

    def epoch(self) -> str | None:
        return self.server.epoch()


class SQLiteDatabase(Database):
    key = "sqlite"

    def __init__(self, base: Path) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="durably-throughput-", dir=base))
        self.path = self.dir / "bench.db"

    def url(self) -> str:
        return f"sqlite:///{self.path}"

    def query(self, sql: str) -> list[tuple[Any, ...]]:
        with contextlib.closing(sqlite3.connect(self.path)) as conn:
            return list(conn.execute(sql).fetchall())

    def drop(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


# -- CPU accounting -------------------------------------------------------------------------


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def postgres_cpu_s() -> float | None:
    """CPU seconds of every process named ``postgres``, with the children they reaped."""
    total, seen = 0.0, False
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        name = text[text.find("(") + 1 : text.rfind(")")]
        if name != "postgres":
            continue
        fields = text[text.rfind(")") + 2 :].split()
        # utime, stime, cutime, cstime: fields 14-17 of /proc/<pid>/stat.
        total += sum(int(v) for v in fields[11:15]) / CLOCK_TICKS
        seen = True
    return total if seen else None


# -- one measurement ------------------------------------------------------------------------


@dataclass
class Measurement:
    backend: str
    processes: int
    concurrency: int
    runs: int
    repeat: int
    start_s: float
    """Starting every run (app.start in a loop), before the workers are launched."""
    wall_s: float
    busy_s: float
    worker_cpu_s: float
    server_cpu_s: float | None
    executed: list[int]
    """Run executions reported by each worker process."""
    checks: dict[str, Any] = field(default_factory=dict)

    @property
    def runs_per_s(self) -> float:
        return self.runs / self.busy_s

    @property
    def wall_runs_per_s(self) -> float:
        return self.runs / self.wall_s


class CheckFailed(Exception):
    pass


def start_runs(url: str, runs: int) -> float:
    """Queue ``runs`` runs of the benchmark workflow; seconds taken."""
    app = bench_app.build(url)
    try:
        app.run(bench_app.WORKFLOW, -1)  # migrates, and checks the app works here
        started = time.perf_counter()
        for i in range(runs):
            app.start(bench_app.WORKFLOW, i, run_id=f"bench-{i:06d}")
        return time.perf_counter() - started
    finally:
        app.close()


EXECUTED = re.compile(r"executed (\d+) run")
LAUNCHERS = ("runner", "cli")
Launched = tuple[float, float, float | None, list[int]]
"""Wall seconds, worker CPU seconds, server CPU seconds, run executions of each worker."""


def no_cpu() -> float | None:
    return None


def _delta(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else after - before


def worker_env(effect_log: Path) -> dict[str, str]:
    env = {**os.environ, bench_app.EFFECT_LOG_ENV: str(effect_log)}
    env.pop("DURABLY_DATABASE_URL", None)
    return env


def launch_cli(
    url: str,
    processes: int,
    concurrency: int,
    effect_log: Path,
    logs: Path,
    server_cpu: Callable[[], float | None],
) -> Launched:
    """N ``python -m durably ... worker --until-idle`` processes, timed from launch to exit.

    Returns (wall seconds, the processes' CPU seconds including start-up, executions each).
    """
    command = [
        sys.executable,
        "-m",
        "durably",
        "--app",
        APP_SPEC,
        "--db",
        url,
        "worker",
        "--until-idle",
        "--concurrency",
        str(concurrency),
    ]
    cpu_before, server_before = children_cpu_s(), server_cpu()
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        workers = []
        for p in range(processes):
            err = stack.enter_context((logs / f"worker-{p}.err").open("w+"))
            proc = subprocess.Popen(
                command,
                cwd=REPO_ROOT,
                env=worker_env(effect_log),
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
            workers.append((proc, err))
        codes = [proc.wait() for proc, _ in workers]
        wall = time.perf_counter() - started
        server = _delta(server_before, server_cpu())
        executed: list[int] = []
        for (_, err), code in zip(workers, codes, strict=True):
            err.seek(0)
            text = err.read()
            match = EXECUTED.search(text)
            if code != 0 or match is None:
                raise CheckFailed(f"a worker exited with {code}:\n{text[-2000:]}")
            executed.append(int(match.group(1)))
    return wall, children_cpu_s() - cpu_before, server, executed


def launch_runners(
    url: str,
    processes: int,
    concurrency: int,
    effect_log: Path,
    logs: Path,
    server_cpu: Callable[[], float | None],
) -> Launched:
    """N gated worker processes (``run_worker``): all started, imported and connected
    before any begins, so that start-up does not compete with the measured work.

    Returns (wall seconds from "go" to the last exit, the CPU seconds the workers used
    while working, executions each).
    """
    command = [sys.executable, str(Path(__file__).resolve()), "--run-worker", url]
    command.append(str(concurrency))
    with contextlib.ExitStack() as stack:
        workers = []
        for p in range(processes):
            err = stack.enter_context((logs / f"worker-{p}.err").open("w+"))
            proc = subprocess.Popen(
                command,
                cwd=REPO_ROOT,
                env=worker_env(effect_log),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
            stack.callback(proc.kill)
            workers.append((proc, err))
        for proc, err in workers:
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != "ready":
                proc.wait()
                err.seek(0)
                raise CheckFailed(f"a worker did not start:\n{err.read()[-2000:]}")
        server_before = server_cpu()
        started = time.perf_counter()
        for proc, _ in workers:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        reports = [proc.communicate()[0] for proc, _ in workers]
        wall = time.perf_counter() - started
        server = _delta(server_before, server_cpu())
        cpu, executed = 0.0, []
        for (proc, err), report in zip(workers, reports, strict=True):
            if proc.returncode != 0:
                err.seek(0)
                raise CheckFailed(f"a worker exited with {proc.returncode}:\n{err.read()[-2000:]}")
            done = json.loads(report.strip().splitlines()[-1])
            cpu += float(done["cpu_s"])
            executed.append(int(done["executed"]))
    return wall, cpu, server, executed


def run_worker(url: str, concurrency: int) -> int:
    """The gated worker: import and connect, print ``ready``, wait for ``go`` on stdin, then
    work like ``durably worker --until-idle`` and print what it did as JSON."""
    app = bench_app.app
    app.database_url = url
    app.list_runs(limit=1)  # opens the store and its connection pool
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 2
    cpu = time.process_time()
    executed = app.worker(concurrency=concurrency).run(until_idle=True)
    cpu = time.process_time() - cpu
    app.close()
    print(json.dumps({"executed": executed, "cpu_s": cpu}), flush=True)
    return 0


def check(db: Database, runs: int, effect_log: Path, executed: list[int]) -> dict[str, Any]:
    """Every run completed exactly once, with its 2 steps and 2 effects; raises if not."""
    ids = [f"bench-{i:06d}" for i in range(runs)]
    status = Counter(
        dict(
            db.query(
                "SELECT status, count(*) FROM durably_runs WHERE run_id LIKE 'bench-%' "
                "GROUP BY status"
            )
        )
    )
    epochs = Counter(
        dict(
            db.query(
                "SELECT lease_epoch, count(*) FROM durably_runs WHERE run_id LIKE 'bench-%' "
                "GROUP BY lease_epoch"
            )
        )
    )
    recovered = db.query("SELECT count(*) FROM durably_events WHERE type = 'run_recovered'")[0][0]
    kinds = {
        (run_id, kind): count
        for run_id, kind, count in db.query(
            "SELECT run_id, kind, count(*) FROM durably_steps WHERE run_id LIKE 'bench-%' "
            "GROUP BY run_id, kind"
        )
    }
    ops = dict(
        db.query(
            "SELECT run_id, count(*) FROM durably_tool_operations WHERE status = 'succeeded' "
            "AND run_id LIKE 'bench-%' GROUP BY run_id"
        )
    )
    effects: Counter[tuple[int, str]] = Counter()
    lines = effect_log.read_text().splitlines() if effect_log.exists() else []
    for line in lines:
        i, channel, _key, _pid = line.split()
        effects[(int(i), channel)] += 1
    problems: list[str] = []
    if status != Counter({"completed": runs}):
        problems.append(f"run statuses {dict(status)}, expected {runs} completed")
    if epochs != Counter({1: runs}):
        problems.append(f"lease epochs {dict(epochs)}: a run was claimed more than once")
    if recovered:
        problems.append(f"{recovered} run_recovered events")
    bad_steps = [
        r
        for r in ids
        if kinds.get((r, "step")) != bench_app.STEPS_PER_RUN
        or kinds.get((r, "tool")) != bench_app.EFFECTS_PER_RUN
    ]
    if bad_steps:
        problems.append(f"{len(bad_steps)} runs without 2 steps + 2 tools, e.g. {bad_steps[:3]}")
    bad_ops = [r for r in ids if ops.get(r) != bench_app.EFFECTS_PER_RUN]
    if bad_ops:
        problems.append(f"{len(bad_ops)} runs without 2 succeeded operations: {bad_ops[:3]}")
    expected = {(i, c) for i in range(runs) for c in bench_app.CHANNELS}
    twice = sorted(k for k, n in effects.items() if n > 1)
    missing = sorted(expected - set(effects))
    if twice:
        problems.append(f"{len(twice)} effects executed more than once, e.g. {twice[:3]}")
    if missing:
        problems.append(f"{len(missing)} effects never executed, e.g. {missing[:3]}")
    if sum(executed) != runs:
        problems.append(f"the workers report {sum(executed)} run executions for {runs} runs")
    if problems:
        raise CheckFailed("; ".join(problems))
    return {
        "runs_completed": status["completed"],
        "claimed_once": epochs[1],
        "run_recovered_events": recovered,
        "effects_executed": len(lines),
        "effects_per_run": len(lines) / runs,
        "executions_per_worker": executed,
    }


def busy_window(db: Database) -> float:
    """First step recorded to last run completed, in the database's clock (seconds)."""
    first = db.query("SELECT min(created_at) FROM durably_steps WHERE run_id LIKE 'bench-%'")
    last = db.query(
        "SELECT max(updated_at) FROM durably_runs WHERE run_id LIKE 'bench-%' "
        "AND status = 'completed'"
    )
    return float(last[0][0]) - float(first[0][0])


def measure_one(
    db: Database,
    processes: int,
    concurrency: int,
    runs: int,
    repeat: int,
    work: Path,
    launcher: str,
) -> Measurement:
    tag = f"{db.key}-p{processes}-r{repeat}"
    logs = work / tag
    logs.mkdir()
    effect_log = logs / "effects.log"
    start_s = start_runs(db.url(), runs)
    launch = launch_runners if launcher == "runner" else launch_cli
    server_cpu = postgres_cpu_s if db.key == "postgres" else no_cpu
    wall, worker_cpu, server, executed = launch(
        db.url(), processes, concurrency, effect_log, logs, server_cpu
    )
    checks = check(db, runs, effect_log, executed)
    return Measurement(
        backend=db.key,
        processes=processes,
        concurrency=concurrency,
        runs=runs,
        repeat=repeat,
        start_s=start_s,
        wall_s=wall,
        busy_s=busy_window(db),
        worker_cpu_s=worker_cpu,
        server_cpu_s=server,
        executed=executed,
        checks=checks,
    )


# -- report ---------------------------------------------------------------------------------


@dataclass
class Summary:
    backend: str
    processes: int
    concurrency: int
    runs: int
    samples: int
    runs_per_s: float
    wall_runs_per_s: float
    steps_per_s: float
    effects_per_s: float
    scaling: float | None
    wall_scaling: float | None
    worker_cpu_ms_per_run: float
    server_cpu_ms_per_run: float | None
    cpu_busy: float | None
    """(worker + server CPU) / (wall x cores): how much of the machine was used."""
    start_runs_per_s: float


def summarise(measurements: list[Measurement], cores: int) -> list[Summary]:
    groups: dict[tuple[str, int], list[Measurement]] = {}
    for m in measurements:
        groups.setdefault((m.backend, m.processes), []).append(m)
    summaries: list[Summary] = []
    for (backend, processes), ms in groups.items():
        runs = ms[0].runs
        rate = statistics.median(m.runs_per_s for m in ms)
        wall_rate = statistics.median(m.wall_runs_per_s for m in ms)
        base = groups.get((backend, 1))
        scaling = wall_scaling = None
        if base:
            scaling = rate / statistics.median(m.runs_per_s for m in base)
            wall_scaling = wall_rate / statistics.median(m.wall_runs_per_s for m in base)
        server = [m.server_cpu_s for m in ms if m.server_cpu_s is not None]
        server_ms = statistics.median(server) / runs * 1000 if server else None
        worker_ms = statistics.median(m.worker_cpu_s for m in ms) / runs * 1000
        cpu_busy = None
        if server:
            cpu_busy = statistics.median(
                (m.worker_cpu_s + (m.server_cpu_s or 0.0)) / (m.wall_s * cores) for m in ms
            )
        summaries.append(
            Summary(
                backend=backend,
                processes=processes,
                concurrency=ms[0].concurrency,
                runs=runs,
                samples=len(ms),
                runs_per_s=rate,
                wall_runs_per_s=wall_rate,
                steps_per_s=rate * bench_app.STEPS_PER_RUN,
                effects_per_s=rate * bench_app.EFFECTS_PER_RUN,
                scaling=scaling,
                wall_scaling=wall_scaling,
                worker_cpu_ms_per_run=worker_ms,
                server_cpu_ms_per_run=server_ms,
                cpu_busy=cpu_busy,
                start_runs_per_s=statistics.median(m.runs / m.start_s for m in ms),
            )
        )
    return summaries


def _f(value: float | None, spec: str, unit: str = "") -> str:
    """``value`` formatted with its unit, or a dash as wide (no value for this backend)."""
    width = len(format(0.0, spec) + unit)
    return "-".rjust(width) if value is None else format(value, spec) + unit


def table(summaries: list[Summary]) -> str:
    head = (
        f"{'backend':<9} {'procs':>5} {'conc':>4} {'runs/s':>7} {'steps/s':>8} "
        f"{'effects/s':>9} {'scaling':>7} {'wall runs/s':>11} {'wall scal.':>10} "
        f"{'worker CPU':>10} {'server CPU':>10} {'CPU busy':>8} {'starts/s':>8}"
    )
    lines = [head, "-" * len(head)]
    for s in summaries:
        lines.append(
            f"{s.backend:<9} {s.processes:>5} {s.concurrency:>4} {s.runs_per_s:7.1f} "
            f"{s.steps_per_s:8.1f} {s.effects_per_s:9.1f} {_f(s.scaling, '6.2f', 'x')} "
            f"{s.wall_runs_per_s:11.1f} {_f(s.wall_scaling, '9.2f', 'x')} "
            f"{s.worker_cpu_ms_per_run:7.1f} ms {_f(s.server_cpu_ms_per_run, '7.1f', ' ms')} "
            f"{_f(None if s.cpu_busy is None else s.cpu_busy * 100, '7.0f', '%')} "
            f"{s.start_runs_per_s:8.0f}"
        )
    return "\n".join(lines)


LEGEND = (
    "runs/s, steps/s, effects/s: over the busy window (first step recorded -> last run "
    "completed, database clock); median of the repeats.\nscaling: runs/s with N processes / "
    "runs/s with 1.  wall: go (runner) or launch (cli: process start and imports "
    "included) -> last worker exited.\nworker CPU, server CPU: CPU time per run of the worker "
    "processes (runner: while working; cli: with start-up) and of the PostgreSQL server.\n"
    "CPU busy: (worker + server CPU) / (wall x cores).  starts/s: app.start() calls per "
    "second while queueing the runs (one process, sequential)."
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="durably worker throughput, many runs")
    parser.add_argument("--runs", type=int, default=200, help="runs per measurement (200)")
    parser.add_argument(
        "--processes", default="1,2,4", help="worker process counts for PostgreSQL (1,2,4)"
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
    parser.add_argument("--repeat", type=int, default=3, help="measurements per setting (3)")
    parser.add_argument("--postgres-url", default=DEFAULT_POSTGRES_URL)
    parser.add_argument("--no-sqlite", action="store_true", help="skip the SQLite reference")
    parser.add_argument("--no-postgres", action="store_true", help="only the SQLite reference")
    parser.add_argument("--dir", help="where the SQLite databases go (a real disk)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    args.process_counts = sorted({int(p) for p in args.processes.split(",") if p.strip()})
    if args.runs < 1 or args.repeat < 1 or args.concurrency < 1 or not args.process_counts:
        parser.error("--runs, --repeat, --concurrency and --processes must be at least 1")
    if min(args.process_counts) < 1:
        parser.error("--processes must be at least 1")
    return args


def measure_retrying(
    args: argparse.Namespace, backend: str, processes: int, r: int, work: Path, server: Any
) -> Measurement:
    """One measurement; taken again if the server restarted under it (another session's
    doing on a shared server: a restart can legitimately make durably recover a run, which
    the checks would then report, so such a measurement proves nothing either way)."""
    for n in range(1, ATTEMPTS + 1):
        db: Database
        if backend == "postgres":
            db = PostgresDatabase(server, f"{SCHEMA_PREFIX}{os.getpid()}_{processes}_{r}_{n}")
        else:
            db = SQLiteDatabase(args.sqlite_base)
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
    with contextlib.ExitStack() as stack:
        server = None
        if not args.no_postgres:
            server = PostgresServer(args.postgres_url)
            stack.callback(server.close)
            sync = server.conn().execute("SHOW synchronous_commit").fetchone()[0]
            print(f"postgresql at {args.postgres_url}, synchronous_commit={sync}")
        if not args.no_sqlite:
            args.sqlite_base, fs, _ = choose_base(args.dir)
            print(
                f"sqlite in {args.sqlite_base} ({fs.fstype} on {fs.mount_point}), synchronous=FULL"
            )
        for r in range(args.repeat):
            # Alternate the order so that slow drift does not favour one setting.
            for backend, processes in plan if r % 2 == 0 else list(reversed(plan)):
                m = measure_retrying(args, backend, processes, r, work, server)
                measurements.append(m)
                print(
                    f"  {backend:<8} {processes} proc x {args.concurrency}: "
                    f"{m.runs_per_s:6.1f} runs/s busy ({m.busy_s:.2f} s), wall "
                    f"{m.wall_s:.2f} s, executions per worker {m.executed}, "
                    f"effects/run {m.checks['effects_per_run']:.2f}, every run once: ok"
                )
    return measurements


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    if raw[:1] == ["--run-worker"]:
        return run_worker(raw[1], int(raw[2]))
    args = parse_args(argv)
    cores = os.cpu_count() or 1
    print(
        f"python {platform.python_version()}, durably {durably_version()}, {cores} CPUs, "
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
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
    summaries = summarise(measurements, cores)
    print()
    print(table(summaries))
    print(LEGEND)
    print(f"total {time.perf_counter() - started:.1f} s")
    if args.json:
        document = {
            "command": " ".join(
                ["benchmarks/throughput.py", *(sys.argv[1:] if argv is None else argv)]
            ),
            "cpus": cores,
            "python": platform.python_version(),
            "durably": durably_version(),
            "summaries": [asdict(s) for s in summaries],
            "measurements": [asdict(m) for m in measurements],
        }
        Path(args.json).write_text(json.dumps(document, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def durably_version() -> str:
    try:
        from importlib.metadata import version

        return version("durably")
    except Exception:
        return getattr(durably, "__version__", "?")


if __name__ == "__main__":
    sys.exit(main())
