"""How the overhead benchmark takes its samples.

Every repeat measures a fresh raw baseline just before and just after each durably sample,
each on a fresh database, and rotates the order of the cases, so disk and CPU drift hit
baseline and durably alike. A sample broken or disturbed by a server restart is taken
again. The footprints (commits, statements, round trips, WAL) come from separate, untimed
runs.
"""

from __future__ import annotations

import cProfile
import io
import pstats
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from benchmarks.backends import Backend, Footprint
from benchmarks.places import ATTEMPTS
from benchmarks.stats import BackendResult, CaseResult, Pair, mark_disturbed, rows_of
from benchmarks.workloads import Case, SampleFailed, op_us, profiled_run

T = TypeVar("T")


def attempt(backend: Backend, what: str, fn: Callable[[], T], log: Callable[[str], None]) -> T:
    """``fn()``, again (up to ATTEMPTS times) if it fails or the server restarts meanwhile.

    Another session restarting a shared PostgreSQL server breaks a sample midway (a
    StoreUnavailable, a dropped connection) or, worse, slows it: both are thrown away.
    """
    for n in range(1, ATTEMPTS + 1):
        before = backend.epoch()
        try:
            result = fn()
        except Exception as exc:
            if n == ATTEMPTS:
                raise
            reason = f"failed ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
        else:
            if backend.epoch() == before:
                return result
            reason = "was disturbed: the database server restarted meanwhile"
            if n == ATTEMPTS:
                raise SampleFailed(f"{what} {reason}, {ATTEMPTS} times")
        log(f"  {backend.key} {what} {reason}; retrying")
        backend.recover()
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class Settings:
    steps: int
    effects: int
    repeat: int


def measure(
    backend: Backend, cases: list[Case], settings: Settings, log: Callable[[str], None]
) -> BackendResult:
    """The paired samples of every case, and the footprints (separate, untimed runs)."""
    steps, effects, repeat = settings.steps, settings.effects, settings.repeat
    results = {c.key: CaseResult(c, effects if c.effect else steps) for c in cases}
    for r in range(repeat):
        rotated = cases[r % len(cases) :] + cases[: r % len(cases)]
        if r % 2:
            rotated.reverse()
        for case in rotated:
            res = results[case.key]
            name = f"r{r}-{case.key}"

            def sample(
                case: Case = case, res: CaseResult = res, name: str = name, r: int = r
            ) -> Pair:
                with backend.place(f"{name}-before") as place:
                    before = backend.raw_us(place, res.n)
                with backend.place(f"{name}-durably") as place:
                    op, zero = op_us(case, place, res.n)
                with backend.place(f"{name}-after") as place:
                    after = backend.raw_us(place, res.n)
                return Pair(r, (before + after) / 2, op, zero, before, after)

            pair = attempt(backend, f"repeat {r + 1} {case.key}", sample, log)
            res.pairs.append(pair)
            log(
                f"  {backend.key} repeat {r + 1}/{repeat} {case.key:<22} raw {pair.raw_us:7.1f} "
                f"µs/commit  durably {pair.op_us:7.1f} µs/op  "
                f"({pair.op_us / pair.raw_us / case.commits:.2f}x)  "
                f"0-call run {pair.zero_run_us / 1000:.1f} ms"
            )

    def raw_footprint() -> Footprint:
        with backend.place("footprint-raw") as place:
            return backend.raw_footprint(place, max(steps, effects))

    raw_fp = attempt(backend, "raw footprint", raw_footprint, log)
    for case in cases:
        res = results[case.key]

        def case_footprint(case: Case = case, res: CaseResult = res) -> Footprint:
            with backend.place(f"footprint-{case.key}") as place:
                return backend.footprint(case, place, res.n)

        res.footprint = attempt(backend, f"{case.key} footprint", case_footprint, log)
    done = BackendResult(backend, [results[c.key] for c in cases], raw_fp)
    done.disturbed = mark_disturbed(done.results)
    done.rows = rows_of(done)
    return done


def profile(case: Case, backend: Backend, n: int, limit: int) -> str:
    """cProfile of one N-call run (after warm-up), and the statements per call: where the
    time beyond the commit goes."""
    profiler = cProfile.Profile()
    with backend.place(f"profile-{case.key}") as place:
        profiled_run(case, place, n, profiler)
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.strip_dirs()
    out.write(f"== {backend.key} {case.key}: {n} calls, sorted by own time (tottime) ==\n")
    stats.sort_stats("tottime").print_stats(limit)
    out.write(f"== {backend.key} {case.key}: sorted by cumulative time ==\n")
    stats.sort_stats("cumulative").print_stats(limit)
    with backend.place(f"profile-footprint-{case.key}") as place:
        fp = backend.footprint(case, place, n)
    trips = "-" if fp.round_trips is None else f"{fp.round_trips:.2f}"
    written = f"{fp.written:.0f}" if backend.written_unit == "WAL B" else f"{fp.written:.1f}"
    out.write(
        f"== {backend.key} {case.key}: per call {fp.commits:.2f} commits, "
        f"{fp.statements:.2f} statements, {trips} round trips, "
        f"{written} {backend.written_unit} ==\n"
    )
    for kind, count in sorted(fp.kinds.items(), key=lambda kv: (-kv[1], kv[0])):
        out.write(f"  {count:6.2f}  {kind}\n")
    return out.getvalue()
