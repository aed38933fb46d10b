"""The throughput benchmark's worker processes, and the CPU they and the server use.

Two launchers: ``runner`` (the default) starts N gated processes that import durably and
open their store before the clock starts, then all get ``go`` at once; ``cli`` launches N
``python -m durably ... worker --until-idle`` and times them from launch to exit.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks import bench_app
from benchmarks.checks import CheckFailed
from benchmarks.places import BENCH_DIR, REPO_ROOT

APP_SPEC = "benchmarks.bench_app:app"
LAUNCHERS = ("runner", "cli")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
EXECUTED = re.compile(r"executed (\d+) run")
Launched = tuple[float, float, float | None, list[int]]
"""Wall seconds, worker CPU seconds, server CPU seconds, run executions of each worker."""
ServerCPU = Callable[[], float | None]


# -- CPU accounting -------------------------------------------------------------------------


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def postgres_cpu_s(postmaster: int | None = None) -> float | None:
    """CPU seconds of every process named ``postgres``, with the children they reaped;
    with ``postmaster``, of that server's processes only."""
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
        if postmaster is not None and postmaster not in (int(stat.parent.name), int(fields[1])):
            continue
        # utime, stime, cutime, cstime: fields 14-17 of /proc/<pid>/stat.
        total += sum(int(v) for v in fields[11:15]) / CLOCK_TICKS
        seen = True
    return total if seen else None


def no_cpu() -> float | None:
    return None


def _delta(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else after - before


# -- launching ------------------------------------------------------------------------------


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
    server_cpu: ServerCPU,
) -> Launched:
    """N ``python -m durably ... worker --until-idle`` processes, timed from launch to exit.

    Their CPU time includes start-up (imports, connecting).
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
    server_cpu: ServerCPU,
) -> Launched:
    """N gated worker processes (``run_worker``): all started, imported and connected
    before any begins, so that start-up does not compete with the measured work.

    The wall time runs from "go" to the last exit; the CPU time is what the workers used
    while working.
    """
    command = [sys.executable, str(BENCH_DIR / "throughput.py"), "--run-worker", url]
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
    app = bench_app.build(url)
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
