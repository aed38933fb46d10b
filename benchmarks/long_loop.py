"""Long agent loops on SQLite: what recovering a run of N recorded steps costs, and what a
step leaves on disk (the targets: replay cost flat per step, storage within 2x the results
plus a stated fixed overhead).

    .venv/bin/python benchmarks/long_loop.py              # N = 1,000 / 5,000 / 20,000
    .venv/bin/python benchmarks/long_loop.py --quick      # N = 200 / 1,000

Replay: a run makes N steps, then waits for an event; the event is delivered and the run is
executed again, which replays the N recorded steps (none runs again: checked) and completes.
Measured: wall and process CPU time of that execution, per step. Storage: the database file
after VACUUM, per step, between a run of 100 steps and one of 100 + N, against the size of
a step's result JSON. Each step body counts its executions; the benchmark fails (exit 1) if
any step ran twice or the run did not complete.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sqlite3
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import durably

RESULT_PAD = 180


def build(url: str, executed: Counter[int]) -> durably.App:
    app = durably.App(url)

    @app.step()
    async def think(i: int) -> dict[str, Any]:
        executed[i] += 1
        return {"i": i, "pad": "x" * RESULT_PAD}

    @app.workflow()
    async def loop(n: int, wait: bool) -> int:
        for i in range(n):
            await think(i)
        if wait:
            await durably.wait_for_event("go")
        return n

    return app


async def replay(directory: Path, n: int) -> tuple[float, float]:
    """Seconds of wall and CPU time to replay n recorded steps and complete."""
    executed: Counter[int] = Counter()
    app = build(f"sqlite:///{directory}/replay-{n}.db", executed)
    try:
        run = await app.run_async("loop", n, True)
        assert run.status is durably.RunStatus.WAITING_EXTERNAL, run
        await app.send_event_async(run.run_id, "go", {})
        cpu, wall = time.process_time(), time.perf_counter()
        done = await app.execute_async(run.run_id)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        await app.close_async()
    if done.status is not durably.RunStatus.COMPLETED or done.result != n:
        raise SystemExit(f"CHECK FAILED: the run of {n} steps did not complete: {done}")
    if executed != Counter(range(n)):
        raise SystemExit(f"CHECK FAILED: a step ran more than once in the run of {n} steps")
    return wall, cpu


def stored_bytes(directory: Path, n: int) -> int:
    path = directory / f"storage-{n}.db"
    executed: Counter[int] = Counter()
    app = build(f"sqlite:///{path}", executed)
    try:
        run = app.run("loop", n, False)
    finally:
        app.close()
    if run.status is not durably.RunStatus.COMPLETED or executed != Counter(range(n)):
        raise SystemExit(f"CHECK FAILED: the storage run of {n} steps: {run}")
    conn = sqlite3.connect(path)  # the benchmark's own connection, to measure the file
    try:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        conn.execute("VACUUM")
    finally:
        conn.close()
    return path.stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", default="1000,5000,20000", help="N, comma-separated")
    parser.add_argument("--quick", action="store_true", help="N = 200, 1000")
    parser.add_argument("--dir", help="where the SQLite files go (default: a temp dir)")
    args = parser.parse_args()
    sizes = [200, 1000] if args.quick else [int(n) for n in args.steps.split(",")]
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        directory = Path(tmp)
        print(f"{'steps':>8} {'replay s':>9} {'µs/step':>8} {'CPU µs/step':>12}")
        for n in sizes:
            wall, cpu = asyncio.run(replay(directory, n))
            print(f"{n:>8,} {wall:>9.3f} {wall / n * 1e6:>8.1f} {cpu / n * 1e6:>12.1f}")
        grown = max(sizes)
        per_step = (stored_bytes(directory, 100 + grown) - stored_bytes(directory, 100)) / grown
        result = len(json.dumps({"i": grown, "pad": "x" * RESULT_PAD}, separators=(",", ":")))
        print(
            f"storage: {per_step:.0f} bytes per step for a {result}-byte result "
            f"({per_step - result:.0f} bytes of it are durably's: ids, hashes, the event)"
        )


if __name__ == "__main__":
    main()
