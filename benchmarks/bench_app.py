"""The throughput benchmark's app: each run makes 2 steps and 2 idempotent effects.

Workers load it from the repository root::

    python -m durably --app benchmarks.bench_app:app --db URL worker --until-idle

The step and tool bodies are trivial ``async def`` functions (no network), so the figures
measure durably and its database, not a service. When ``$DURABLY_BENCH_EFFECT_LOG`` names a
file, every execution of a tool body appends one line ``<run index> <channel> <idempotency
key> <pid>`` to it with a single ``O_APPEND`` write, which is atomic between processes on a
local filesystem: the benchmark reads it back to prove that no effect was executed twice.
A run's result carries ``lease_epoch``, the fencing token of the execution that completed
it: 1 when the run was claimed exactly once.
"""

from __future__ import annotations

import os
from typing import Any

import durably

EFFECT_LOG_ENV = "DURABLY_BENCH_EFFECT_LOG"
CHANNELS = ("email", "sms")
"""The two effects of every run, in order."""
STEPS_PER_RUN = 2
EFFECTS_PER_RUN = len(CHANNELS)
RUN_ID_PREFIX = "bench-"


def run_id(i: int) -> str:
    """The id of the benchmark's i-th run."""
    return f"{RUN_ID_PREFIX}{i:06d}"


_log_fds: dict[str, int] = {}


def _record_effect(line: str) -> None:
    path = os.environ.get(EFFECT_LOG_ENV)
    if not path:
        return
    fd = _log_fds.get(path)
    if fd is None:
        fd = _log_fds[path] = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, line.encode())


def build(database_url: str | None = None) -> durably.App:
    """A fresh app with the benchmark workflow ``job``, bound to ``database_url``."""
    app = durably.App(database_url)

    @app.step()
    async def price(i: int, part: str) -> dict[str, Any]:
        return {"i": i, "part": part, "amount": i % 97 + len(part)}

    @app.tool(idempotent=True)
    async def notify(i: int, channel: str) -> dict[str, Any]:
        key = durably.idempotency_key()
        _record_effect(f"{i} {channel} {key} {os.getpid()}\n")
        return {"id": f"{channel}-{key[:16]}", "channel": channel}

    @app.workflow()
    async def job(i: int) -> dict[str, Any]:
        base = await price(i, "base")
        tax = await price(i, "tax")
        sent = [await notify(i, channel) for channel in CHANNELS]
        return {
            "i": i,
            "total": base["amount"] + tax["amount"],
            "sent": [s["id"] for s in sent],
            "lease_epoch": durably.fencing_token(),
        }

    return app


WORKFLOW = "job"
app = build()
"""The app the workers load; its database comes from ``--db`` or $DURABLY_DATABASE_URL."""
