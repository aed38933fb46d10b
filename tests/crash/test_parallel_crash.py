"""Kill a worker while three tool calls run at once, recover them in another order.

``<kind>_parallel`` (crashapp) makes a step, then three concurrent calls of one tool under
the step ids ``call_0``..``call_2``, as an agent framework passes the model's tool call
ids, each started after a random latency drawn from the test's seed and the process's role:
the recovery reaches the calls in another order than the dead process did, and some of
them for the first time. The process is killed at every crash point (first visit: in
whichever call gets there first). The shop's own records decide:

* ``idempotent`` and ``reconciled``: each call took effect exactly once, the run
  completed, and no call paused for a person;
* ``neither``: each call took effect at most once before any person acted; calls whose
  outcome nobody can know pause the run ``effect_state_unknown`` one at a time, and once
  resolved from the shop's records the run completes with each effect exactly once.

Never ``non_determinism``: the order of concurrent calls is not part of the journal.
"""

from __future__ import annotations

from typing import Any

import pytest

from durably.faults import CRASH_POINTS
from tests.crash.conftest import Harness, Proc, Shop, coupon_result
from tests.crash.test_crash_windows import assert_no_ghost, campaign_of, result_id

pytestmark = pytest.mark.crash

KINDS = ("idempotent", "reconciled", "neither")
SEEDS = (1, 2, 3)
CALLS = 3
CAMPAIGN = "summer"


def by_campaign(shop: Shop, kind: str, customer: str) -> dict[str, list[dict[str, Any]]]:
    rows: dict[str, list[dict[str, Any]]] = {f"{CAMPAIGN}-{i}": [] for i in range(CALLS)}
    for row in shop.records(kind, customer):
        rows[campaign_of(row)].append(row)
    return rows


def settle_pauses(h: Harness, shop: Shop, proc: Proc, run_id: str, customer: str) -> Proc:
    """What an operator does for each unknown outcome: read the shop, resolve, resume."""
    for _ in range(CALLS):
        assert proc.code == 0, proc.explain()
        assert proc.run is not None
        if proc.run["status"] != "paused":
            return proc
        assert proc.run["status_reason"] == "effect_state_unknown", proc.explain()
        step_id = proc.run["waiting_for"]["step_id"]
        rows = by_campaign(shop, "neither", customer)[f"{CAMPAIGN}-{step_id[-1]}"]
        assert len(rows) <= 1, f"{step_id} took effect {len(rows)} times before anyone acted"
        if rows:
            h.resolve(run_id, step_id, "succeeded", result=coupon_result(rows[0]))
        else:
            h.resolve(run_id, step_id, "not_executed")
        proc = h.resume(run_id)
    return proc


@pytest.mark.parametrize(
    ("point", "kind", "seed"),
    [
        pytest.param(p, k, s, id=f"{p}-{k}-seed{s}")
        for p in CRASH_POINTS
        for k in KINDS
        for s in SEEDS
    ],
)
def test_parallel_calls_crash_and_recover_in_any_order(
    point: str, kind: str, seed: int, harness: Harness, shop: Shop, customer: str, run_id: str
) -> None:
    wf = f"{kind}_parallel"
    run_input = {"customer": customer, "campaign": CAMPAIGN, "seed": seed}
    first = harness.start(wf, run_id, crash_at=point, **run_input)
    if point == "approval.after_request":  # no approval here: nothing to crash at
        assert first.code == 0, first.explain()
        final = first
    else:
        assert first.code == 77, first.explain()
        for rows in by_campaign(shop, kind, customer).values():
            assert len(rows) <= 1
        final = harness.recover(wf, run_id, **run_input)
        if kind == "neither":
            final = settle_pauses(harness, shop, final, run_id, customer)
    assert final.code == 0, final.explain()
    assert final.run is not None
    assert final.run["status"] == "completed", final.explain()

    rows = by_campaign(shop, kind, customer)
    assert all(len(r) == 1 for r in rows.values()), rows
    results = final.run["result"]
    assert [result_id(r) for r in results] == [r[0]["id"] for r in rows.values()]
    assert_no_ghost(harness, shop, run_id, kind, customer)
    effects = {e["step_id"] for e in harness.describe(run_id)["effects"]}
    assert effects == {f"call_{i}" for i in range(CALLS)}
    reasons = [e.payload.get("reason") for e in harness.events(run_id) if e.type == "run_paused"]
    assert "non_determinism" not in reasons
    if kind != "neither":
        assert reasons == [], "an idempotent or reconciled call never needs a person"
