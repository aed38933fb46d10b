"""How the benchmarks print: fixed-width tables with their legends, and the JSON documents
``--json`` writes."""

from __future__ import annotations

import statistics
from dataclasses import asdict
from typing import Any

from benchmarks.backends import Backend, SQLiteBackend
from benchmarks.stats import (
    DISTURBED_SLOWDOWN,
    DISTURBED_SPREAD,
    TARGET_RATIO,
    BackendResult,
    Measurement,
    Summary,
)

# -- overhead -------------------------------------------------------------------------------

OVERHEAD_LEGEND = (
    "µs/op: median over repeats of (run with N calls - run with 0 calls) / N.  "
    "vs: commits compared x median raw µs.\nratio: median over repeats of µs/op / "
    "(commits x raw commit measured around it: mean of just before and just after); "
    "min-max over repeats.\ncommits/stmts/RTs: COMMITs, statements (BEGIN/COMMIT included) "
    "and client-server round trips per call, from a separate\nuntimed run. pages: SQLite WAL "
    "pages written per call. WAL B: PostgreSQL WAL bytes per call (cluster-wide LSN delta:\n"
    "another session writing at the same time inflates it).  used: repeats in the medians "
    "(undisturbed).\ntool plain: neither idempotent=True nor reconcile=."
)


def _opt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _written(value: float | None, unit: str) -> str:
    return _opt(value, ".0f" if unit == "WAL B" else ".1f")


def backend_lines(backend: Backend, info: dict[str, Any]) -> tuple[list[str], list[str]]:
    """What a backend measures on: lines for stdout, and warnings for stderr."""
    lines: list[str] = []
    warnings: list[str] = []
    if isinstance(backend, SQLiteBackend):
        lines.append(f"sqlite {info['sqlite']}: databases in {info['directory']}")
        lines.append(f"  filesystem: {backend.fs.describe()}")
        lines.append(f"  chosen because: {info['chosen_because']}")
        if not backend.durable:
            warnings.append(
                "  memory filesystem: fsync is free; ratios are CPU figures, no PASS/FAIL "
                "(pass --dir on a real disk for durable commits)"
            )
        return lines, warnings
    fs = info["data_filesystem"]
    where = f" ({fs['fstype']} mounted on {fs['mount_point']})" if fs else ""
    lines.append(
        f"postgresql {info['server']} at {info['url']}: a fresh schema per measurement; "
        f"synchronous_commit={info['synchronous_commit']} (server default "
        f"{info['synchronous_commit_server_default']}), fsync={info['fsync']}, "
        f"wal_sync_method={info['wal_sync_method']}, data in {info['data_directory']}{where}"
    )
    lines.append(
        f"  psycopg {info['psycopg']} ({info['psycopg_impl']}, libpq {info['libpq']}); "
        f"baseline: {info['baseline']}"
    )
    if not backend.durable:
        lines.append("  synchronous_commit=off: no WAL flush wait; ratios are CPU figures")
    return lines, warnings


def overhead_table(done: BackendResult) -> str:
    unit = done.backend.written_unit
    head = (
        f"{'operation':<58} {'µs/op':>8} {'vs':>9} {'ratio':>6} {'(min-max)':>12} "
        f"{'target':>7} {'result':>6} {'commits':>7} {'stmts':>6} {'RTs':>5} {unit:>6} "
        f"{'used':>5}"
    )
    lines = [head, "-" * len(head)]
    raw = statistics.median(done.raw_all)
    fp = done.raw_footprint
    lines.append(
        f"{done.backend.raw_label:<58} {raw:8.1f} {'':>9} {'1.00':>6} {'':>12} {'':>7} "
        f"{'':>6} {fp.commits:7.2f} {fp.statements:6.1f} {_opt(fp.round_trips, '5.1f'):>5} "
        f"{_written(fp.written, unit):>6}"
    )
    for row in done.rows:
        versus = f"{row.compared_with_commits}x{row.raw_commit_us:.0f}"
        target = f"<={row.target:.1f}" if row.target is not None else "-"
        spread = f"{row.ratio_min:.2f}-{row.ratio_max:.2f}"
        lines.append(
            f"{row.operation:<58} {row.per_op_us:8.1f} {versus:>9} {row.ratio:6.2f} "
            f"{spread:>12} {target:>7} {row.verdict:>6} {_opt(row.commits_per_op, '.2f'):>7} "
            f"{_opt(row.statements_per_op, '.1f'):>6} {_opt(row.round_trips_per_op, '.1f'):>5} "
            f"{_written(row.written_per_op, unit):>6} {row.repeats_used}/{row.repeats}"
        )
    return "\n".join(lines)


def wire_table(done: BackendResult) -> str:
    """PostgreSQL: statements per call by kind, from the libpq trace."""
    lines = ["statements per call, by kind (libpq trace):"]
    for res in done.results:
        if res.footprint is None or not res.footprint.kinds:
            continue
        kinds = sorted(res.footprint.kinds.items(), key=lambda kv: (-kv[1], kv[0]))
        text = ", ".join(f"{kind} {count:.2f}" for kind, count in kinds)
        lines.append(f"  {res.case.key:<22} {text}")
    return "\n".join(lines)


def disturbed_warning(done: BackendResult) -> str:
    return (
        f"WARNING: {done.disturbed} {done.backend.key} sample(s) measured while the "
        f"disk was disturbed (raw commit >{DISTURBED_SLOWDOWN}x the fastest, or raw "
        f"before/after >{DISTURBED_SPREAD}x apart) are left out of the medians; see "
        "'used'. Rerun on a quieter machine."
    )


def overhead_document(
    command: str,
    env: dict[str, Any],
    settings: dict[str, int],
    infos: dict[str, dict[str, Any]],
    done: list[BackendResult],
    seconds: float,
) -> dict[str, Any]:
    return {
        "command": command,
        **env,
        **settings,
        "target_ratio": TARGET_RATIO,
        "backends": {
            r.backend.key: {
                **infos[r.backend.key],
                "raw_label": r.backend.raw_label,
                "raw_commit_us": statistics.median(r.raw_all),
                "raw_footprint": asdict(r.raw_footprint),
                "disturbed_samples": r.disturbed,
                "rows": [asdict(row) for row in r.rows],
                "footprints": {
                    res.case.key: asdict(res.footprint) if res.footprint else None
                    for res in r.results
                },
                "samples": {res.case.key: [asdict(p) for p in res.pairs] for res in r.results},
            }
            for r in done
        },
        "seconds": seconds,
    }


# -- throughput -----------------------------------------------------------------------------

THROUGHPUT_LEGEND = (
    "runs/s, steps/s, effects/s: over the busy window (first step recorded -> last run "
    "completed, database clock); median of the repeats.\nscaling: runs/s with N processes / "
    "runs/s with 1.  wall: go (runner) or launch (cli: process start and imports "
    "included) -> last worker exited.\nworker CPU, server CPU: CPU time per run of the worker "
    "processes (runner: while working; cli: with start-up) and of the PostgreSQL server.\n"
    "CPU busy: (worker + server CPU) / (wall x cores).  starts/s: app.start() calls per "
    "second while queueing the runs (one process, sequential)."
)


def _f(value: float | None, spec: str, unit: str = "") -> str:
    """``value`` formatted with its unit, or a dash as wide (no value for this backend)."""
    width = len(format(0.0, spec) + unit)
    return "-".rjust(width) if value is None else format(value, spec) + unit


def throughput_table(summaries: list[Summary]) -> str:
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


def measurement_line(m: Measurement) -> str:
    return (
        f"  {m.backend:<8} {m.processes} proc x {m.concurrency}: "
        f"{m.runs_per_s:6.1f} runs/s busy ({m.busy_s:.2f} s), wall "
        f"{m.wall_s:.2f} s, executions per worker {m.executed}, "
        f"effects/run {m.checks['effects_per_run']:.2f}, every run once: ok"
    )


def throughput_document(
    command: str,
    cores: int,
    python: str,
    durably_version: str,
    summaries: list[Summary],
    measurements: list[Measurement],
) -> dict[str, Any]:
    return {
        "command": command,
        "cpus": cores,
        "python": python,
        "durably": durably_version,
        "summaries": [asdict(s) for s in summaries],
        "measurements": [asdict(m) for m in measurements],
    }
