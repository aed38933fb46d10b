"""A worker process that starts at an agreed instant, for races between workers.

    python -m tests.scale.runner GO_FILE CONCURRENCY LEASE_TTL

Imports ``scaleapp``, opens its store (connected, migrated), prints ``ready`` and its worker
id, waits until ``GO_FILE`` exists, then runs ``worker.run(until_idle=True)``. The last
stdout line is JSON: worker id, pid, when it started and how many runs it executed. Several
of these, released by the same file, race for the same ready runs with no import or
connection time between them. Configuration as ``scaleapp`` (environment).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

from tests.scale.scaleapp import app

GO_TIMEOUT_S = 60.0


async def main(go_file: Path, concurrency: int, lease_ttl_s: float) -> dict[str, object]:
    worker = app.worker(concurrency=concurrency, lease_ttl=timedelta(seconds=lease_ttl_s))
    try:
        await app.open()
        print(f"ready {worker.worker_id}", flush=True)
        deadline = time.monotonic() + GO_TIMEOUT_S
        while not go_file.exists():
            if time.monotonic() > deadline:
                raise SystemExit(f"{go_file} did not appear within {GO_TIMEOUT_S} s")
            await asyncio.sleep(0.001)
        started = time.time()
        executed = await worker.run_async(until_idle=True)
    finally:
        await app.close_async()
    return {
        "worker_id": worker.worker_id,
        "pid": os.getpid(),
        "started": started,
        "executed": executed,
    }


if __name__ == "__main__":
    go, slots, ttl = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    print(json.dumps(asyncio.run(main(go, slots, ttl))), flush=True)
