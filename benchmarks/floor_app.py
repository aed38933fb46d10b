"""The floor benchmark's workflow: a run of ``n`` sequential steps, every body counted.

``chain(i, n, block_at)`` awaits the step ``work(i, k)`` for k = 1..n. Each step returns a
small dict, about the ~200-byte row the raw baselines commit. Every execution of a step
body is counted, so that the benchmark can prove that every step ran exactly once:

* in this process, in :data:`EXECUTED` (the in-process workloads, W1 and W2);
* when ``$DURABLY_FLOOR_LOG`` names a file, also as one line ``<i> <k> <pid>`` appended
  with a single ``O_APPEND`` write (W3, whose steps run in other processes).

When ``$DURABLY_FLOOR_BLOCK`` is set, step ``block_at`` never returns: it awaits an event
that nothing sets. W3's first process runs with it, to hold its runs in step 6 until it
is killed; the recovering process runs without it.
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from typing import Any

import durably

LOG_ENV = "DURABLY_FLOOR_LOG"
BLOCK_ENV = "DURABLY_FLOOR_BLOCK"
WORKFLOW = "chain"

EXECUTED: Counter[tuple[int, int]] = Counter()
"""Step body executions in this process, by (run index, step number)."""
_log_fds: dict[str, int] = {}


def _record(i: int, k: int) -> None:
    EXECUTED[(i, k)] += 1
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    fd = _log_fds.get(path)
    if fd is None:
        fd = _log_fds[path] = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, f"{i} {k} {os.getpid()}\n".encode())


def _output(i: int, k: int) -> dict[str, Any]:
    return {"i": i, "k": k, "status": "ok", "note": "a small step result", "pad": "x" * 48}


def build(url: str, *, sync_step: bool = False) -> durably.App:
    """An App on ``url`` with the workflow ``chain``; ``sync_step``: a plain ``def`` step."""
    app = durably.App(url)
    blocking = bool(os.environ.get(BLOCK_ENV))

    if sync_step:

        @app.step()
        def work(i: int, k: int, block: bool) -> dict[str, Any]:
            _record(i, k)
            return _output(i, k)

    else:

        @app.step()
        async def work(i: int, k: int, block: bool) -> dict[str, Any]:
            _record(i, k)
            if block and blocking:
                await asyncio.Event().wait()  # held here until the process is killed
            return _output(i, k)

    @app.workflow()
    async def chain(i: int, n: int, block_at: int = 0) -> dict[str, Any]:
        # `_ =`: durably's decorators type an awaited `async def` step as its coroutine.
        for k in range(1, n + 1):
            _ = await work(i, k, k == block_at)
        return {"i": i, "steps": n, "lease_epoch": durably.fencing_token()}

    return app


def run_id(i: int) -> str:
    return f"floor-{i:06d}"
