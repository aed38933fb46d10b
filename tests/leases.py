"""Leases in tests: runs held by a worker, and what a recovering test process waits for
before it takes a crashed run over."""

from __future__ import annotations

import asyncio
import time

import durably
from durably.store.base import Lease, NewRun, Store

LEASE_WAIT_S = 15.0


async def wait_for_lease(app: durably.App, run_id: str) -> None:
    """Return once nobody holds a live lease on the run (judged by the store's clock)."""
    store = await app.open()
    deadline = time.monotonic() + LEASE_WAIT_S
    while True:
        run = await store.get_run(run_id)
        if run is None or run.lease_owner is None or run.lease_until is None:
            return
        if run.lease_until < await store.now():
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"the lease on {run_id} did not expire within {LEASE_WAIT_S} s")
        await asyncio.sleep(0.02)


async def held_runs(store: Store, count: int) -> list[Lease]:
    """The leases of ``count`` new runs, ``r0`` onwards, each claimed by worker ``w1``."""
    leases = []
    for i in range(count):
        await store.create_run(NewRun(f"r{i}", "default", "wf", "1", {}, "{}", "h", 2))
        claim = await store.claim_run(f"r{i}", "w1", 30)
        assert claim is not None
        leases.append(claim.lease)
    return leases
