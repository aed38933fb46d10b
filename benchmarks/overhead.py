#!/usr/bin/env python
"""Per-step and per-effect overhead of durably against raw commits, on SQLite and PostgreSQL.

    python benchmarks/overhead.py [--backend sqlite,postgres] [--postgres-url URL]
                                  [--steps N] [--effects N] [--repeat R] [--quick]
                                  [--json PATH] [--dir DIR] [--cases A,B] [--keep]
                                  [--check] [--pg-synchronous-commit on|off]
                                  [--profile CASE]

The raw baselines are in ``baselines.py``, the workloads in ``workloads.py``, how samples
are taken in ``sampling.py``, how they become figures in ``stats.py`` and how those print
in ``render.py``. Everything durably-side goes through durably's public API. See
benchmarks/README.md for what is measured and the figures from the development machine.
"""

from __future__ import annotations

import argparse
import json
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

from benchmarks.backends import Backend, SQLiteBackend, make_backend
from benchmarks.places import DEFAULT_POSTGRES_URL, environment
from benchmarks.render import (
    OVERHEAD_LEGEND,
    backend_lines,
    disturbed_warning,
    overhead_document,
    overhead_table,
    wire_table,
)
from benchmarks.sampling import Settings, measure, profile
from benchmarks.stats import BackendResult
from benchmarks.workloads import CASE_KEYS, CASES, Case, SampleFailed

BACKENDS = ("sqlite", "postgres")
FULL = {"steps": 400, "effects": 200, "repeat": 7}
QUICK = {"steps": 40, "effects": 20, "repeat": 2}
"""--quick: shows that every case runs on every backend; the figures are rough."""


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[Case], list[str]]:
    parser = argparse.ArgumentParser(
        description="durably per-step / per-effect overhead vs raw SQLite and PostgreSQL commits"
    )
    parser.add_argument(
        "--backend",
        default=",".join(BACKENDS),
        help="comma list of sqlite,postgres (default: both)",
    )
    parser.add_argument(
        "--postgres-url",
        default=DEFAULT_POSTGRES_URL,
        help=f"database to create the per-measurement schemas in ({DEFAULT_POSTGRES_URL})",
    )
    parser.add_argument("--steps", type=int, help=f"step calls per run ({FULL['steps']})")
    parser.add_argument("--effects", type=int, help=f"tool calls per run ({FULL['effects']})")
    parser.add_argument("--repeat", type=int, help=f"repeats; medians reported ({FULL['repeat']})")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: steps {steps}, effects {effects}, repeat {repeat} (rough figures)"
        "".format(**QUICK),
    )
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    parser.add_argument(
        "--dir",
        help="where to create the SQLite temp databases (a real disk; a memory filesystem "
        "such as /dev/shm makes fsync free: CPU figures, no PASS/FAIL)",
    )
    parser.add_argument(
        "--cases", default=",".join(CASE_KEYS), help=f"comma list of {','.join(CASE_KEYS)}"
    )
    parser.add_argument("--keep", action="store_true", help="keep the temp directory")
    parser.add_argument("--check", action="store_true", help="exit 1 if a row FAILs")
    parser.add_argument(
        "--profile",
        choices=CASE_KEYS,
        help="instead of the table: cProfile one run of this case on each backend, print "
        "hot spots and the statements per call",
    )
    parser.add_argument("--profile-lines", type=int, default=30)
    parser.add_argument(
        "--pg-synchronous-commit",
        choices=["on", "off"],
        help="PostgreSQL synchronous_commit for both sides (default: the server's). off "
        "removes the wait for the WAL flush: CPU + round trips only, no PASS/FAIL",
    )
    args = parser.parse_args(argv)
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.steps < 1 or args.effects < 1 or args.repeat < 1:
        parser.error("--steps, --effects and --repeat must be at least 1")
    wanted = [k.strip() for k in args.cases.split(",") if k.strip()]
    unknown = sorted(set(wanted) - set(CASE_KEYS))
    if unknown:
        parser.error(f"unknown cases {unknown}; choose from {CASE_KEYS}")
    backends = [b.strip() for b in args.backend.split(",") if b.strip()]
    if not backends or set(backends) - set(BACKENDS):
        parser.error(f"--backend: choose from {','.join(BACKENDS)}")
    return args, [c for c in CASES if c.key in wanted], list(dict.fromkeys(backends))


def main(argv: list[str] | None = None) -> int:
    args, cases, backend_keys = parse_args(argv)
    env = environment()
    print(
        f"python {env['python']}, durably {env['durably']}, {env['cpus']} CPUs, "
        f"{env['machine']}, load average {env['load_average_at_start']}"
    )
    work = Path(tempfile.mkdtemp(prefix="durably-bench-trace-"))
    backends: list[Backend] = []
    infos: dict[str, dict[str, Any]] = {}
    done: list[BackendResult] = []
    started = time.perf_counter()
    try:
        for key in backend_keys:
            backend = make_backend(
                key, args.dir, args.postgres_url, args.pg_synchronous_commit, work
            )
            backends.append(backend)
            infos[key] = backend.describe()
            lines, warnings = backend_lines(backend, infos[key])
            print("\n".join(lines))
            for warning in warnings:
                print(warning, file=sys.stderr)
        if args.profile:
            case = next(c for c in CASES if c.key == args.profile)
            n = args.effects if case.effect else args.steps
            for backend in backends:
                print(profile(case, backend, n, args.profile_lines))
            return 0
        print(
            f"steps={args.steps} effects={args.effects} repeat={args.repeat}; raw baseline "
            "measured just before and after every durably sample"
        )
        settings = Settings(args.steps, args.effects, args.repeat)
        for backend in backends:
            done.append(measure(backend, cases, settings, print))
    except SampleFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        for backend in backends:
            backend.close()
            if isinstance(backend, SQLiteBackend):
                if args.keep:
                    print(f"kept {backend.work}")
                else:
                    shutil.rmtree(backend.work, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    elapsed = time.perf_counter() - started
    for result in done:
        print()
        print(overhead_table(result))
        if result.backend.key == "postgres":
            print(wire_table(result))
        if result.disturbed:
            print(disturbed_warning(result))
    print()
    print(OVERHEAD_LEGEND)
    print(f"total {elapsed:.1f} s")
    if args.json:
        command = " ".join(["benchmarks/overhead.py", *(sys.argv[1:] if argv is None else argv)])
        sizes = {"steps": args.steps, "effects": args.effects, "repeat": args.repeat}
        document = overhead_document(command, env, sizes, infos, done, elapsed)
        Path(args.json).write_text(json.dumps(document, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.check and any(row.verdict == "FAIL" for r in done for row in r.rows):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
