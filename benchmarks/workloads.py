"""The overhead benchmark's workloads: a workflow that awaits one kind of call N times.

Each case builds its own App on a fresh database. The per-call cost is (time of the
N-call run - time of the same workflow with 0 calls) / N, so run creation, the claim, the
journal load and completion are not counted. Everything here is durably's public API.
"""

from __future__ import annotations

import asyncio
import cProfile
import gc
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import durably

Workflow = Callable[[int], Awaitable[int]]
# The workflows below write `_ = await call(...)`: durably's decorators type an awaited
# `async def` step as returning its coroutine, and mypy would flag the bare await.


def _result(i: int) -> dict[str, Any]:
    return {"i": i, "status": "ok", "note": "a small step result"}


def _calling(
    url: str, register: Callable[[durably.App], Callable[..., Any]], argument: str
) -> tuple[durably.App, Workflow]:
    """An App whose ``bench(n)`` workflow makes ``n`` calls of what ``register`` adds."""
    app = durably.App(url)
    call = register(app)

    @app.workflow()
    async def bench(n: int) -> int:
        for i in range(n):
            _ = await call(i, argument)
        return n

    return app, bench


def build_step_async(url: str) -> tuple[durably.App, Workflow]:
    def register(app: durably.App) -> Callable[..., Any]:
        @app.step()
        async def lookup(i: int, region: str) -> dict[str, Any]:
            return _result(i)

        return lookup

    return _calling(url, register, "EMEA")


def build_step_sync(url: str) -> tuple[durably.App, Workflow]:
    def register(app: durably.App) -> Callable[..., Any]:
        @app.step()
        def lookup(i: int, region: str) -> dict[str, Any]:
            return _result(i)

        return lookup

    return _calling(url, register, "EMEA")


def _sent(i: int) -> dict[str, Any]:
    return {**_result(i), "key": durably.idempotency_key()[:12]}


def build_tool_idempotent(url: str) -> tuple[durably.App, Workflow]:
    def register(app: durably.App) -> Callable[..., Any]:
        @app.tool(idempotent=True)
        async def send(i: int, to: str) -> dict[str, Any]:
            return _sent(i)

        return send

    return _calling(url, register, "lead@example.com")


def build_tool_idempotent_sync(url: str) -> tuple[durably.App, Workflow]:
    def register(app: durably.App) -> Callable[..., Any]:
        @app.tool(idempotent=True)
        def send(i: int, to: str) -> dict[str, Any]:
            return _sent(i)

        return send

    return _calling(url, register, "lead@example.com")


def build_tool_plain(url: str) -> tuple[durably.App, Workflow]:
    def register(app: durably.App) -> Callable[..., Any]:
        @app.tool()
        async def send(i: int, to: str) -> dict[str, Any]:
            return _sent(i)

        return send

    return _calling(url, register, "lead@example.com")


@dataclass(frozen=True)
class Case:
    key: str
    label: str
    commits: int
    """Commits durably makes per call by design (docs/architecture.md#the-effect-protocol)."""
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


class SampleFailed(Exception):
    """A measurement that could not be taken (e.g. the server restarted under it)."""


def check_run(run: durably.Run, n: int) -> None:
    if run.status is not durably.RunStatus.COMPLETED or run.result != n:
        raise SampleFailed(f"benchmark run did not complete: {run.status} {run.error}")


def run_once(app: durably.App, wf: Workflow, n: int) -> float:
    """Seconds for ``app.run(wf, n)``; checks that the run completed."""
    start = time.perf_counter()
    run = app.run(wf, n)
    elapsed = time.perf_counter() - start
    check_run(run, n)
    return elapsed


def op_us(case: Case, url: str, n: int, zero_runs: int = 3) -> tuple[float, float]:
    """Microseconds per call on a fresh database: (N-call run - median 0-call run) / N.

    Returns (µs per call, µs of the 0-call run).
    """
    app, wf = case.build(url)
    try:
        run_once(app, wf, 0)  # opens the store and applies the migrations
        run_once(app, wf, 2)  # warms the code paths (and, for def, the thread machinery)
        gc.collect()
        zero = statistics.median(run_once(app, wf, 0) for _ in range(zero_runs))
        gc.collect()
        total = run_once(app, wf, n)
    finally:
        app.close()
    return (total - zero) / n * 1e6, zero * 1e6


def profiled_run(case: Case, url: str, n: int, profiler: cProfile.Profile) -> None:
    """One N-call run (after warm-up) with ``profiler`` enabled.

    cProfile sees only the thread that enables it, and ``app.run`` executes on the App's
    own loop thread; so the run goes through ``app.run_async`` on this thread's loop.
    Work sent to ``asyncio.to_thread`` (plain ``def`` bodies) is not seen.
    """
    app, wf = case.build(url)

    async def go() -> None:
        try:
            check_run(await app.run_async(wf, 0), 0)
            check_run(await app.run_async(wf, 2), 2)
            profiler.enable()
            try:
                run = await app.run_async(wf, n)
            finally:
                profiler.disable()
            check_run(run, n)
        finally:
            await app.close_async()

    try:
        asyncio.run(go())
    finally:
        app.close()
