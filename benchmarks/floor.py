#!/usr/bin/env python
"""durably at the physical floor: W1, W2 and W3 against the cheapest correct
raw durable commit, measured in the same run, on SQLite and PostgreSQL.

    python benchmarks/floor.py [--backend sqlite,postgres] [--postgres-url URL] [--dir DIR]
                               [--steps N] [--runs N] [--concurrency 1,4,16] [--effects N]
                               [--recover-runs N] [--recover-concurrency C] [--lease-ttl S]
                               [--scale-runs N] [--scale-processes 1,2,4]
                               [--scale-concurrency C] [--repeat R]
                               [--workloads w1,w2,effect,w3,scale] [--quick] [--json PATH]

Every measurement verifies its runs (each completed once, every step exactly once) and
the command exits 1 if one does not. See benchmarks/README.md for what is measured.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from benchmarks import floor_measure as fm
from benchmarks import floor_recovery, floor_scaling
from benchmarks.floor_render import W2_STEPS, Figures, render
from benchmarks.places import (
    ATTEMPTS,
    DEFAULT_POSTGRES_URL,
    PostgresAdmin,
    PostgresSchema,
    SQLiteFile,
    choose_base,
    environment,
)

T = TypeVar("T")
BACKENDS = ("sqlite", "postgres")
WORKLOADS = ("w1", "w2", "effect", "w3", "scale")
FULL: dict[str, Any] = {
    "steps": 200, "runs": 200, "effects": 100, "recover_runs": 500, "repeat": 5,
    "lease_ttl": None, "scale_runs": 600,
}  # fmt: skip
QUICK: dict[str, Any] = {
    "steps": 40, "runs": 20, "effects": 10, "recover_runs": 20, "repeat": 1,
    "lease_ttl": 1.0, "scale_runs": 30,
}  # fmt: skip
"""--quick: every workload on every backend, with its checks; figures too rough to quote.
Its W3 uses a 1 s lease so that it does not wait out the default 30 s."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--backend", default=",".join(BACKENDS), help="sqlite,postgres (both)")
    p.add_argument("--postgres-url", default=DEFAULT_POSTGRES_URL)
    p.add_argument("--dir", help="where the SQLite databases go (default: a real disk)")
    p.add_argument("--steps", type=int, help=f"W1: steps in the run ({FULL['steps']})")
    p.add_argument("--runs", type=int, help=f"W2: runs of 3 steps ({FULL['runs']})")
    p.add_argument("--concurrency", default="1,4,16", help="W2: runs at once in one worker")
    p.add_argument("--effects", type=int, help=f"idempotent tool calls ({FULL['effects']})")
    p.add_argument("--recover-runs", type=int, help=f"W3: runs ({FULL['recover_runs']})")
    p.add_argument("--recover-concurrency", type=int, default=16, help="W3: fresh worker's")
    p.add_argument("--lease-ttl", type=float, help="W3: lease seconds (the worker's default)")
    p.add_argument("--scale-runs", type=int, help=f"scale: runs ({FULL['scale_runs']})")
    p.add_argument("--scale-processes", default="1,2,4", help="scale: worker processes")
    p.add_argument("--scale-concurrency", type=int, default=8, help="scale: runs at once each")
    p.add_argument("--repeat", type=int, help=f"W1/W2/effect repeats ({FULL['repeat']})")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="a subset of these")
    p.add_argument("--quick", action="store_true", help="a smoke run (rough figures)")
    p.add_argument("--json", metavar="PATH", help="also write every sample as JSON")
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.backends = [b for b in args.backend.split(",") if b]
    args.levels = [int(c) for c in args.concurrency.split(",") if c]
    args.chosen = [w for w in args.workloads.split(",") if w]
    args.fleet = [int(n) for n in args.scale_processes.split(",") if n]
    unknown = {*args.backends} - {*BACKENDS} | {*args.chosen} - {*WORKLOADS}
    if unknown:
        p.error(f"unknown backend or workload: {', '.join(sorted(unknown))}")
    return args


class Places:
    """Fresh databases: a SQLite file under ``base`` or a PostgreSQL schema."""

    def __init__(self, base: Path, admin: PostgresAdmin | None) -> None:
        self.base, self.admin, self.retries = base, admin, 0
        self.serial = 0

    def attempt(self, backend: str, fn: Callable[[Any], T]) -> T:
        """``fn(place)`` on a fresh place; again if the PostgreSQL server restarted under it
        (another session's doing, which legitimately makes durably recover runs)."""
        for n in range(ATTEMPTS):
            self.serial += 1
            place: Any
            if backend == "sqlite":
                place = SQLiteFile(self.base, f"floor{self.serial}")
            else:
                assert self.admin is not None
                place = PostgresSchema(self.admin, self.admin.schema_name("floor", self.serial))
            epoch = place.epoch()
            try:
                return fn(place)
            except Exception:
                if place.epoch() == epoch or n == ATTEMPTS - 1:
                    raise
                self.retries += 1
            finally:
                place.drop()
        raise AssertionError("unreachable")


def raw(places: Places, backend: str, commits: int, wal: fm.WalReader) -> fm.Sample:
    if backend == "sqlite":
        return places.attempt(backend, lambda p: fm.raw_sqlite(p.path, commits))
    return places.attempt(backend, lambda p: fm.raw_postgres(p.url(), commits, wal))


def _concurrent(runs: int, concurrency: int) -> Callable[[Any], fm.Sample]:
    return lambda place: fm.w2_concurrent(place.url(), runs, W2_STEPS, concurrency)


def one_round(args: argparse.Namespace, places: Places, backend: str, figs: Figures) -> None:
    """One repeat of W1, W2 and the effect, each raw baseline just before its durably side."""
    wal = places.admin.wal_lsn if backend == "postgres" and places.admin else None
    at = places.attempt
    if "w1" in args.chosen:
        figs.add("raw W1", raw(places, backend, args.steps, wal))
        figs.add("W1 async", at(backend, lambda p: fm.w1(p.url(), args.steps, wal)))
        figs.add("W1 def", at(backend, lambda p: fm.w1(p.url(), args.steps, wal, sync_step=True)))
    if "w2" in args.chosen:
        figs.add("raw W2", raw(places, backend, args.runs * W2_STEPS, None))
        figs.add("W2 seq", at(backend, lambda p: fm.w2_sequential(p.url(), args.runs, W2_STEPS)))
        for c in args.levels:
            figs.add(f"W2 c{c}", at(backend, _concurrent(args.runs, c)))
    if "effect" in args.chosen:
        figs.add("raw effect", raw(places, backend, args.effects * 2, None))
        figs.add_value("effect us", at(backend, lambda p: fm.effect_us(p.url(), args.effects)))


def recovery(args: argparse.Namespace, places: Places, backend: str, figs: Figures) -> None:
    runs = args.recover_runs
    figs.add("raw W3", raw(places, backend, runs * (floor_recovery.STEPS - 5), None))

    def go(place: Any) -> floor_recovery.Recovery:
        with tempfile.TemporaryDirectory(prefix="floor-w3-") as tmp:
            log = Path(tmp) / "steps.log"
            url = place.url()
            return floor_recovery.measure(url, runs, args.recover_concurrency, args.lease_ttl, log)

    figs.recoveries.append(places.attempt(backend, go))


def scaling(args: argparse.Namespace, places: Places, figs: Figures) -> None:
    """PostgreSQL steps/s with each number of worker processes (one measurement each)."""
    runs = args.scale_runs
    figs.add("raw scale", raw(places, "postgres", runs * floor_scaling.STEPS, None))
    for processes in args.fleet:

        def go(place: Any, processes: int = processes) -> floor_scaling.Scaling:
            with tempfile.TemporaryDirectory(prefix="floor-scale-") as tmp:
                log = Path(tmp) / "steps.log"
                level = args.scale_concurrency
                return floor_scaling.measure(place.url(), runs, processes, level, log)

        figs.scalings.append(places.attempt("postgres", go))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    base, fs, why = choose_base(args.dir)
    admin = None
    if "postgres" in args.backends:
        admin = PostgresAdmin(args.postgres_url, "durably_floor_", hint="or --backend sqlite")
    places = Places(base, admin)
    print(f"environment: {json.dumps(environment())}")
    print(f"SQLite databases in {fs.describe()}: {why}")
    if admin is not None:
        settings = ", ".join(f"{n}={admin.show(n)}" for n in ("synchronous_commit", "fsync"))
        print(f"PostgreSQL {admin.show('server_version')} at {args.postgres_url}: {settings}")
    figures = {b: Figures(b) for b in args.backends}
    try:
        for r in range(args.repeat):
            order = args.backends if r % 2 == 0 else args.backends[::-1]
            for backend in order:
                one_round(args, places, backend, figures[backend])
        if "w3" in args.chosen:
            for backend in args.backends:
                recovery(args, places, backend, figures[backend])
        if "scale" in args.chosen and "postgres" in figures:
            scaling(args, places, figures["postgres"])
    except fm.CheckFailed as exc:
        print(f"CHECK FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        if admin is not None:
            admin.close()
    print(render(list(figures.values()), args, time.perf_counter() - started))
    if fs.in_memory and "sqlite" in args.backends:
        print("SQLite on a memory filesystem: fsync is free, its targets do not apply")
    if places.retries:
        print(f"{places.retries} measurements taken again: the server restarted under them")
    if args.json:
        document = {"args": args.__dict__, "figures": [f.document() for f in figures.values()]}
        Path(args.json).write_text(json.dumps(document, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
