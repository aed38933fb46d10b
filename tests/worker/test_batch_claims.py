"""The worker's slots claim together: one transaction for every slot waiting, and one empty
claim (not one per slot) when nothing is runnable."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import durably
from durably.store.base import Claim
from tests.worker import drainapp


def _spied(app: durably.App) -> list[tuple[int, int]]:
    """Each claim_batch of the app's store, as (limit asked, runs got)."""
    app.list_runs(limit=1)  # opens the store
    store = app.engine.store
    real = store.claim_batch
    calls: list[tuple[int, int]] = []

    async def claim_batch(*args: Any) -> list[Claim]:
        claims = await real(*args)
        calls.append((args[-1], len(claims)))
        return claims

    store.claim_batch = claim_batch  # type: ignore[method-assign]
    return calls


def test_free_slots_claim_their_runs_in_one_transaction(database_url: str, tmp_path: Path) -> None:
    app = drainapp.app
    app.database_url = database_url
    try:
        run_ids = [
            app.start(drainapp.three_slow_steps, str(tmp_path / f"ledger-{i}")) for i in range(5)
        ]
        calls = _spied(app)
        assert app.worker(concurrency=8).run(until_idle=True) == 5
        # All 8 slots asked at once and got the 5 runs; the 3 left over did not ask again.
        assert calls[0] == (8, 5)
        assert all(got == 0 for _, got in calls[1:])
        for run_id in run_ids:
            assert app.get_run(run_id).status is durably.RunStatus.COMPLETED
    finally:
        app.close()


def test_idle_slots_make_one_empty_claim(database_url: str) -> None:
    app = drainapp.app
    app.database_url = database_url
    try:
        calls = _spied(app)
        assert app.worker(concurrency=8).run(until_idle=True) == 0
        assert calls == [(8, 0)]
    finally:
        app.close()
