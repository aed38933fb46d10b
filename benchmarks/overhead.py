#!/usr/bin/env python
"""Per-step and per-effect overhead of durably against raw SQLite commits, in one run.

    python benchmarks/overhead.py [--steps N] [--effects N] [--repeat R] [--json PATH]
                                  [--dir DIR] [--cases A,B] [--keep] [--check]
                                  [--synchronous FULL|NORMAL|OFF] [--profile CASE]

Baseline: stdlib ``sqlite3`` on the same filesystem, WAL, ``synchronous=FULL``, one
``BEGIN IMMEDIATE; INSERT one ~200-byte JSON row; COMMIT`` per operation — the cost of one
durable commit (one fsync of the WAL) with nothing else around it.

durably: a workflow that awaits one step (or tool) N times, sequentially, with distinct
arguments, run by ``app.run``. Per-op cost = (time of the N-call run - time of the same
workflow run with 0 calls) / N, so run creation, claim, journal load and completion are not
counted. Ratios compare it with as many raw commits as durably makes by design (1 per
step, 2 per idempotent/reconcilable effect, 3 per effect with neither).

Every repeat measures a fresh raw baseline just before and just after each durably sample,
in fresh database files in the same directory, and rotates the order of cases, so disk and
CPU drift hit baseline and durably alike. Each ratio is the median over repeats of the
paired ratio; samples taken while another process's I/O disturbed the disk are left out.
See benchmarks/README.md for the figures measured on the development machine.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import platform
import pstats
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import durably

try:
    from importlib.metadata import version as _dist_version

    DURABLY_VERSION = _dist_version("durably")
except Exception:  # not installed as a distribution: running from a checkout
    DURABLY_VERSION = "?"

TARGET_RATIO = 1.5
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "devtmpfs", "shm"})
BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent

Workflow = Callable[[int], Awaitable[int]]
# The workflows below write `_ = await step(...)`: durably's decorators type an awaited
# `async def` step as returning its coroutine, and mypy would flag the bare await.


# -- where the databases live ---------------------------------------------------------------


@dataclass(frozen=True)
class Filesystem:
    path: str
    mount_point: str
    fstype: str
    device: int

    @property
    def in_memory(self) -> bool:
        return self.fstype in MEMORY_FILESYSTEMS

    def describe(self) -> str:
        kind = "IN MEMORY - fsync is free, figures are meaningless" if self.in_memory else "disk"
        return f"{self.path} ({self.fstype} mounted on {self.mount_point}, {kind})"


def _unescape_mount(text: str) -> str:
    # /proc/mounts writes space, tab, newline and backslash as octal escapes.
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        text = text.replace(code, char)
    return text


def filesystem_of(path: Path) -> Filesystem:
    """The mount (longest matching mount point in /proc/mounts) that holds ``path``."""
    real = os.path.realpath(path)
    best, fstype = "/", "unknown"
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        mount = _unescape_mount(parts[1])
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, fstype = mount, parts[2]
    return Filesystem(str(path), best, fstype, os.stat(real).st_dev)


def choose_base(explicit: str | None) -> tuple[Path, Filesystem, str]:
    """The directory for the benchmark's databases, its filesystem and why it was chosen.

    Default: the system temp dir if it is a real disk on the same device as the repo (so
    the numbers are the repo's disk), else a temp dir under ``benchmarks/``.
    """
    if explicit:
        base = Path(explicit).resolve()
        base.mkdir(parents=True, exist_ok=True)
        return base, filesystem_of(base), "given by --dir"
    repo_fs = filesystem_of(REPO_ROOT)
    tmp = Path(tempfile.gettempdir())
    tmp_fs = filesystem_of(tmp)
    if not tmp_fs.in_memory and tmp_fs.device == repo_fs.device:
        why = f"{tmp} is {tmp_fs.fstype} on the same device as the repo ({REPO_ROOT})"
        return tmp, tmp_fs, why
    why = (
        f"{tmp} is {tmp_fs.fstype}"
        + (" (memory)" if tmp_fs.in_memory else " on another device than the repo")
        + f"; using the repo's disk ({repo_fs.fstype})"
    )
    return BENCH_DIR, filesystem_of(BENCH_DIR), why


# -- the raw baseline -----------------------------------------------------------------------


def wal_frames(conn: sqlite3.Connection, db: Path) -> float:
    """Frames in the WAL file of ``db`` (page size + 24-byte frame header each)."""
    wal = Path(f"{db}-wal")
    page_size = int(conn.execute("PRAGMA page_size").fetchone()[0])
    return wal.stat().st_size / (page_size + 24) if wal.exists() else 0.0


def fresh_wal(conn: sqlite3.Connection) -> None:
    """Empty the WAL and stop automatic checkpoints, so its size counts what is written."""
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.execute("PRAGMA wal_autocheckpoint=0")


def raw_commit_us(
    path: Path, n: int, synchronous: str = "FULL", warmup: int = 20, frames: bool = False
) -> float:
    """Microseconds per commit of one ~200-byte JSON row, WAL + ``synchronous``.

    With ``frames``, returns WAL frames written per commit instead (autocheckpoint off).
    """
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={synchronous}")
        conn.execute("CREATE TABLE bench_rows (id INTEGER PRIMARY KEY, body TEXT NOT NULL)")

        def commit(i: int) -> None:
            body = json.dumps(
                {
                    "run_id": "run_0000000000000000000000",
                    "step_id": f"bench_step#{i}",
                    "status": "succeeded",
                    "output": {"i": i, "status": "ok", "note": "a small step result"},
                    "created_at": 1767225600.123456,
                    "pad": "x" * 48,
                },
                separators=(",", ":"),
            )
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("INSERT INTO bench_rows (body) VALUES (?)", (body,))
            conn.execute("COMMIT")

        for i in range(warmup):
            commit(-1 - i)
        if frames:
            fresh_wal(conn)
            for i in range(n):
                commit(i)
            return wal_frames(conn, path) / n
        gc.collect()
        start = time.perf_counter()
        for i in range(n):
            commit(i)
        return (time.perf_counter() - start) / n * 1e6
    finally:
        conn.close()


# -- durably cases --------------------------------------------------------------------------


def _result(i: int) -> dict[str, Any]:
    return {"i": i, "status": "ok", "note": "a small step result"}


def build_step_async(url: str) -> tuple[durably.App, Workflow]:
    app = durably.App(url)

    @app.step()
    async def lookup(i: int, region: str) -> dict[str, Any]:
        return _result(i)

    @app.workflow()
    async def bench(n: int) -> int:
        for i in range(n):
            _ = await lookup(i, "EMEA")
        return n

    return app, bench


def build_step_sync(url: str) -> tuple[durably.App, Workflow]:
    app = durably.App(url)

    @app.step()
    def lookup(i: int, region: str) -> dict[str, Any]:
        return _result(i)

    @app.workflow()
    async def bench(n: int) -> int:
        for i in range(n):
            _ = await lookup(i, "EMEA")
        return n

    return app, bench


def build_tool_idempotent(url: str) -> tuple[durably.App, Workflow]:
    app = durably.App(url)

    @app.tool(idempotent=True)
    async def send(i: int, to: str) -> dict[str, Any]:
        return {**_result(i), "key": durably.idempotency_key()[:12]}

    @app.workflow()
    async def bench(n: int) -> int:
        for i in range(n):
            _ = await send(i, "lead@example.com")
        return n

    return app, bench


def build_tool_idempotent_sync(url: str) -> tuple[durably.App, Workflow]:
    app = durably.App(url)

    @app.tool(idempotent=True)
    def send(i: int, to: str) -> dict[str, Any]:
        return {**_result(i), "key": durably.idempotency_key()[:12]}

    @app.workflow()
    async def bench(n: int) -> int:
        for i in range(n):
            _ = await send(i, "lead@example.com")
        return n

    return app, bench


def build_tool_plain(url: str) -> tuple[durably.App, Workflow]:
    app = durably.App(url)

    @app.tool()
    async def send(i: int, to: str) -> dict[str, Any]:
        return {**_result(i), "key": durably.idempotency_key()[:12]}

    @app.workflow()
    async def bench(n: int) -> int:
        for i in range(n):
            _ = await send(i, "lead@example.com")
        return n

    return app, bench


@dataclass(frozen=True)
class Case:
    key: str
    label: str
    commits: int
    """Commits durably makes per call by design (effects.py docstring)."""
    effect: bool
    """Sized by --effects (tools) rather than --steps."""
    build: Callable[[str], tuple[durably.App, Workflow]]


CASES: tuple[Case, ...] = (
    Case("step_async", "step, async def", 1, False, build_step_async),
    Case("step_sync", "step, def (to_thread)", 1, False, build_step_sync),
    Case("tool_idempotent", "tool idempotent=True, async def", 2, True, build_tool_idempotent),
    Case(
        "tool_idempotent_sync",
        "tool idempotent=True, def (to_thread)",
        2,
        True,
        build_tool_idempotent_sync,
    ),
    Case("tool_plain", "tool plain (3 commits by design)", 3, True, build_tool_plain),
)
CASE_KEYS = [c.key for c in CASES]


def _run(app: durably.App, wf: Workflow, n: int) -> float:
    """Seconds for ``app.run(wf, n)``; checks that the run completed."""
    start = time.perf_counter()
    run = app.run(wf, n)
    elapsed = time.perf_counter() - start
    if run.status is not durably.RunStatus.COMPLETED or run.result != n:
        raise SystemExit(f"benchmark run did not complete: {run.status} {run.error}")
    return elapsed


def _close(app: durably.App) -> None:
    app.close()


def store_connection(app: durably.App) -> sqlite3.Connection:
    """The SQLite store's private connection: a benchmark-only peek, not an API."""
    conn: sqlite3.Connection = vars(app.store)["_conn"]
    return conn


def durably_op_us(
    case: Case, path: Path, n: int, synchronous: str = "FULL", zero_runs: int = 3
) -> tuple[float, float]:
    """Microseconds per call: (N-call run - median 0-call run) / N, on a fresh database.

    Returns (µs per call, µs of the 0-call run).
    """
    app, wf = case.build(f"sqlite:///{path}")
    try:
        _run(app, wf, 0)  # opens the store and applies the migrations
        if synchronous != "FULL":
            store_connection(app).execute(f"PRAGMA synchronous={synchronous}")
        _run(app, wf, 2)  # warms the code paths (and, for def, the thread machinery)
        gc.collect()
        zero = statistics.median(_run(app, wf, 0) for _ in range(zero_runs))
        gc.collect()
        total = _run(app, wf, n)
    finally:
        _close(app)
    return (total - zero) / n * 1e6, zero * 1e6


@dataclass
class Footprint:
    """What one call writes, measured in a separate untimed run."""

    commits: float
    statements: float
    wal_frames: float
    """Pages appended to the WAL (each fsynced at commit); a raw commit writes about 1."""


def footprint(case: Case, path: Path, n: int) -> Footprint:
    """COMMITs, SQL statements and WAL frames per call: (N-call run - 0-call run) / N."""
    app, wf = case.build(f"sqlite:///{path}")
    counts = {"commit": 0, "all": 0}

    def trace(sql: str) -> None:
        counts["all"] += 1
        if sql.strip().upper().startswith("COMMIT"):
            counts["commit"] += 1

    try:
        _run(app, wf, 0)
        conn = store_connection(app)
        fresh_wal(conn)
        conn.set_trace_callback(trace)
        _run(app, wf, 0)
        zero = dict(counts)
        zero_frames = wal_frames(conn, path)
        counts.update(commit=0, all=0)
        fresh_wal(conn)
        _run(app, wf, n)
        frames = wal_frames(conn, path)
        conn.set_trace_callback(None)
    finally:
        _close(app)
    return Footprint(
        commits=(counts["commit"] - zero["commit"]) / n,
        statements=(counts["all"] - zero["all"]) / n,
        wal_frames=(frames - zero_frames) / n,
    )


# -- the run --------------------------------------------------------------------------------


@dataclass
class Pair:
    repeat: int
    raw_us: float
    op_us: float
    zero_run_us: float
    """The same workflow with 0 calls (run creation, claim, load, completion)."""
    raw_before_us: float
    raw_after_us: float
    """raw_us is the mean of the raw baselines measured just before and just after."""
    stable: bool = True
    """False when the disk was disturbed around this sample (see ``mark_disturbed``)."""

    @property
    def ratio_per_commit(self) -> float:
        return self.op_us / self.raw_us


@dataclass
class CaseResult:
    case: Case
    n: int
    pairs: list[Pair] = field(default_factory=list)
    footprint: Footprint | None = None

    @property
    def used(self) -> list[Pair]:
        """The undisturbed pairs, if at least two; else all of them."""
        stable = [p for p in self.pairs if p.stable]
        return stable if len(stable) >= 2 else self.pairs

    @property
    def op_us(self) -> float:
        return statistics.median(p.op_us for p in self.used)

    @property
    def raw_us(self) -> float:
        return statistics.median(p.raw_us for p in self.used)

    def ratio(self, commits: int) -> float:
        """Median over repeats of op / (commits x the raw commit measured around it)."""
        return statistics.median(p.ratio_per_commit / commits for p in self.used)


DISTURBED_SPREAD = 2.0
"""Raw before/after a sample further apart than this factor: the disk changed under it."""
DISTURBED_SLOWDOWN = 3.0
"""A raw commit this many times slower than the fastest one seen: another process's I/O."""


def mark_disturbed(results: list[CaseResult]) -> int:
    """Flag pairs measured while other I/O disturbed the disk; returns how many.

    On a shared machine a burst of fsyncs from another process can make every commit take
    milliseconds for a while; both sides then measure the queue, not durably, and their
    ratio tends to 1. Such pairs are reported but left out of the medians.
    """
    pairs = [p for res in results for p in res.pairs]
    fastest = min(p.raw_us for p in pairs)
    for p in pairs:
        spread = max(p.raw_before_us, p.raw_after_us) / min(p.raw_before_us, p.raw_after_us)
        p.stable = spread <= DISTURBED_SPREAD and p.raw_us <= DISTURBED_SLOWDOWN * fastest
    return sum(not p.stable for p in pairs)


@dataclass(frozen=True)
class Row:
    operation: str
    case: str
    compared_with_commits: int
    per_op_us: float
    raw_commit_us: float
    ratio: float
    ratio_min: float
    ratio_max: float
    target: float | None
    verdict: str
    repeats_used: int
    repeats: int
    commits_per_op: float | None
    statements_per_op: float | None
    wal_frames_per_op: float | None


@dataclass(frozen=True)
class Settings:
    steps: int
    effects: int
    repeat: int
    synchronous: str


def measure(
    cases: list[Case], settings: Settings, work: Path, log: Callable[[str], None]
) -> tuple[list[CaseResult], float]:
    """The paired samples of every case, and the WAL frames per raw commit."""
    steps, effects, repeat, sync = (
        settings.steps,
        settings.effects,
        settings.repeat,
        settings.synchronous,
    )
    results = {c.key: CaseResult(c, effects if c.effect else steps) for c in cases}
    for r in range(repeat):
        rotated = cases[r % len(cases) :] + cases[: r % len(cases)]
        if r % 2:
            rotated.reverse()
        for case in rotated:
            res = results[case.key]
            sample = work / f"r{r}-{case.key}"
            sample.mkdir()
            before = raw_commit_us(sample / "raw-before.db", res.n, sync)
            op, zero = durably_op_us(case, sample / "durably.db", res.n, sync)
            after = raw_commit_us(sample / "raw-after.db", res.n, sync)
            shutil.rmtree(sample)
            raw = (before + after) / 2
            res.pairs.append(Pair(r, raw, op, zero, before, after))
            log(
                f"  repeat {r + 1}/{repeat} {case.key:<22} raw {raw:7.1f} µs/commit  "
                f"durably {op:7.1f} µs/op  ({op / raw / case.commits:.2f}x)  "
                f"0-call run {zero / 1000:.1f} ms"
            )
    sample = work / "footprint"
    sample.mkdir()
    raw_frames = raw_commit_us(sample / "raw.db", max(steps, effects), frames=True)
    for case in cases:
        res = results[case.key]
        res.footprint = footprint(case, sample / f"{case.key}.db", res.n)
    shutil.rmtree(sample)
    return [results[c.key] for c in cases], raw_frames


def rows_of(results: list[CaseResult], synchronous: str = "FULL") -> list[Row]:
    rows: list[Row] = []
    for res in results:
        comparisons: list[tuple[int, float | None]] = [(res.case.commits, TARGET_RATIO)]
        if res.case.commits == 3:
            # The 3-commit tool against the 2-commit floor of the design: informational.
            comparisons.append((2, None))
        fp = res.footprint
        for commits, wanted in comparisons:
            ratios = [p.ratio_per_commit / commits for p in res.used]
            ratio = res.ratio(commits)
            # Without the fsync the ratio is a CPU figure: no target.
            target = wanted if synchronous == "FULL" else None
            verdict = "info" if target is None else "PASS" if ratio <= target else "FAIL"
            label = res.case.label
            if res.case.commits == 3:
                label += " vs 3 commits" if commits == 3 else " vs 2-commit floor"
            rows.append(
                Row(
                    operation=label,
                    case=res.case.key,
                    compared_with_commits=commits,
                    per_op_us=res.op_us,
                    raw_commit_us=res.raw_us,
                    ratio=ratio,
                    ratio_min=min(ratios),
                    ratio_max=max(ratios),
                    target=target,
                    verdict=verdict,
                    repeats_used=len(res.used),
                    repeats=len(res.pairs),
                    commits_per_op=fp.commits if fp else None,
                    statements_per_op=fp.statements if fp else None,
                    wal_frames_per_op=fp.wal_frames if fp else None,
                )
            )
    return rows


def _opt(value: float | None, spec: str) -> str:
    return "?" if value is None else format(value, spec)


def table(rows: list[Row], raw_all: list[float], raw_frames: float, synchronous: str) -> str:
    head = (
        f"{'operation':<54} {'µs/op':>8} {'vs':>9} {'ratio':>6} {'(min-max)':>12} "
        f"{'target':>7} {'result':>6} {'commits':>7} {'stmts':>6} {'pages':>6} {'used':>5}"
    )
    lines = [head, "-" * len(head)]
    raw = statistics.median(raw_all)
    label = f"raw sqlite3 commit (WAL, synchronous={synchronous})"
    lines.append(
        f"{label:<54} {raw:8.1f} {'':>9} {'1.00':>6} "
        f"{'':>12} {'':>7} {'':>6} {'1':>7} {'3':>6} {raw_frames:6.1f}"
    )
    for row in rows:
        versus = f"{row.compared_with_commits}x{row.raw_commit_us:.0f}"
        target = f"<={row.target:.1f}" if row.target is not None else "-"
        commits = _opt(row.commits_per_op, ".2f")
        stmts = _opt(row.statements_per_op, ".1f")
        pages = _opt(row.wal_frames_per_op, ".1f")
        spread = f"{row.ratio_min:.2f}-{row.ratio_max:.2f}"
        used = f"{row.repeats_used}/{row.repeats}"
        lines.append(
            f"{row.operation:<54} {row.per_op_us:8.1f} {versus:>9} {row.ratio:6.2f} "
            f"{spread:>12} {target:>7} {row.verdict:>6} {commits:>7} {stmts:>6} {pages:>6} "
            f"{used:>5}"
        )
    return "\n".join(lines)


def profile(case: Case, n: int, work: Path, limit: int) -> str:
    """cProfile of one N-call run (after warm-up): where the time beyond the fsync goes."""
    sample = work / f"profile-{case.key}"
    sample.mkdir()
    app, wf = case.build(f"sqlite:///{sample / 'durably.db'}")
    profiler = cProfile.Profile()
    try:
        _run(app, wf, 0)
        _run(app, wf, 2)
        profiler.enable()
        _run(app, wf, n)
        profiler.disable()
    finally:
        _close(app)
        shutil.rmtree(sample)
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.strip_dirs()
    out.write(f"== {case.key}: {n} calls, sorted by own time (tottime) ==\n")
    stats.sort_stats("tottime").print_stats(limit)
    out.write(f"== {case.key}: sorted by cumulative time ==\n")
    stats.sort_stats("cumulative").print_stats(limit)
    return out.getvalue()


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[Case]]:
    parser = argparse.ArgumentParser(
        description="durably per-step / per-effect overhead vs raw SQLite commits"
    )
    parser.add_argument("--steps", type=int, default=400, help="step calls per run (400)")
    parser.add_argument("--effects", type=int, default=200, help="tool calls per run (200)")
    parser.add_argument("--repeat", type=int, default=7, help="repeats; medians reported (7)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    parser.add_argument("--dir", help="where to create the temp databases (a real disk)")
    parser.add_argument(
        "--cases", default=",".join(CASE_KEYS), help=f"comma list of {','.join(CASE_KEYS)}"
    )
    parser.add_argument("--keep", action="store_true", help="keep the temp directory")
    parser.add_argument("--check", action="store_true", help="exit 1 if a row FAILs")
    parser.add_argument(
        "--profile",
        choices=CASE_KEYS,
        help="instead of the table: cProfile one run of this case and print hot spots",
    )
    parser.add_argument("--profile-lines", type=int, default=30)
    parser.add_argument(
        "--synchronous",
        choices=["FULL", "NORMAL", "OFF"],
        default="FULL",
        help="SQLite synchronous for both sides (FULL). OFF removes the fsync: the figures "
        "are then CPU + write() cost only, for finding where the time beyond it goes",
    )
    args = parser.parse_args(argv)
    if args.steps < 1 or args.effects < 1 or args.repeat < 1:
        parser.error("--steps, --effects and --repeat must be at least 1")
    wanted = [k.strip() for k in args.cases.split(",") if k.strip()]
    unknown = sorted(set(wanted) - set(CASE_KEYS))
    if unknown:
        parser.error(f"unknown cases {unknown}; choose from {CASE_KEYS}")
    return args, [c for c in CASES if c.key in wanted]


def environment(work: Path, fs: Filesystem, why: str) -> dict[str, Any]:
    return {
        "directory": str(work),
        "filesystem": asdict(fs),
        "chosen_because": why,
        "python": platform.python_version(),
        "sqlite": sqlite3.sqlite_version,
        "durably": DURABLY_VERSION,
        "cpus": os.cpu_count(),
        "machine": f"{platform.machine()} {platform.system()}",
        "load_average_at_start": _load(),
    }


def print_environment(env: dict[str, Any], fs: Filesystem) -> None:
    print(f"databases in {env['directory']}")
    print(f"  filesystem: {fs.describe()}")
    print(f"  chosen because: {env['chosen_because']}")
    if fs.in_memory:
        print("  WARNING: memory filesystem; pass --dir on a real disk", file=sys.stderr)
    print(
        f"python {env['python']}, sqlite {env['sqlite']}, durably {env['durably']}, "
        f"{env['cpus']} CPUs, {env['machine']}, load average {env['load_average_at_start']}"
    )


LEGEND = (
    "µs/op: median over repeats of (run with N calls - run with 0 calls) / N.  "
    "vs: commits compared x median raw µs.\nratio: median over repeats of µs/op / "
    "(commits x raw commit measured around it: mean of just before and just after); "
    "min-max over repeats.\ncommits/stmts/pages: COMMITs, SQL statements and WAL pages "
    "written per call, from a separate untimed run.  used: repeats in the medians "
    "(undisturbed).\ntool plain: neither idempotent=True nor reconcile=."
)


def main(argv: list[str] | None = None) -> int:
    args, cases = parse_args(argv)
    base, fs, why = choose_base(args.dir)
    work = Path(tempfile.mkdtemp(prefix="durably-bench-", dir=base))
    env = environment(work, fs, why)
    print_environment(env, fs)
    started = time.perf_counter()
    try:
        if args.profile:
            case = next(c for c in CASES if c.key == args.profile)
            n = args.effects if case.effect else args.steps
            print(profile(case, n, work, args.profile_lines))
            return 0
        print(
            f"steps={args.steps} effects={args.effects} repeat={args.repeat} "
            f"synchronous={args.synchronous}; raw baseline measured just before and after "
            "every durably sample"
        )
        if args.synchronous != "FULL":
            print("  synchronous != FULL: no fsync; ratios are CPU figures, no PASS/FAIL")
        settings = Settings(args.steps, args.effects, args.repeat, args.synchronous)
        results, raw_frames = measure(cases, settings, work, print)
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    elapsed = time.perf_counter() - started
    disturbed = mark_disturbed(results)
    rows = rows_of(results, args.synchronous)
    raw_all = [p.raw_us for res in results for p in res.used]
    print()
    print(table(rows, raw_all, raw_frames, args.synchronous))
    print()
    print(LEGEND)
    if disturbed:
        print(
            f"WARNING: {disturbed} sample(s) measured while the disk was disturbed (raw commit "
            f">{DISTURBED_SLOWDOWN}x the fastest, or raw before/after >{DISTURBED_SPREAD}x "
            "apart) are left out of the medians; see 'used'. Rerun on a quieter machine."
        )
    print(f"total {elapsed:.1f} s")
    if args.json:
        document = {
            "command": " ".join(
                ["benchmarks/overhead.py", *(sys.argv[1:] if argv is None else argv)]
            ),
            **env,
            "steps": args.steps,
            "effects": args.effects,
            "repeat": args.repeat,
            "target_ratio": TARGET_RATIO,
            "synchronous": args.synchronous,
            "raw_commit_us": statistics.median(raw_all),
            "raw_wal_frames_per_commit": raw_frames,
            "disturbed_samples": disturbed,
            "rows": [asdict(r) for r in rows],
            "samples": {res.case.key: [asdict(p) for p in res.pairs] for res in results},
            "seconds": elapsed,
        }
        Path(args.json).write_text(json.dumps(document, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.check and any(r.verdict == "FAIL" for r in rows):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
