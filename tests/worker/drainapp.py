"""A slow three-step workflow for the worker shutdown tests."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import durably

app = durably.App(os.environ.get("DURABLY_DATABASE_URL"))


@app.step()
async def slow_step(i: int, ledger: str) -> int:
    # Appends to a file shared by every process: counts executions across restarts.
    with Path(ledger).open("a") as f:
        f.write(f"{i}\n")
    await asyncio.sleep(0.4)
    return i


def started(ledger: Path) -> bool:
    """Whether a step of the run counting into ``ledger`` has started: its line is in the
    file. The file exists from the step's ``open``, before its line is flushed at ``close``:
    a process killed in between ran the step without counting it."""
    return ledger.exists() and bool(ledger.read_text().strip())


@app.workflow()
async def three_slow_steps(ledger: str) -> list[int]:
    return [await slow_step(i, ledger) for i in range(3)]
