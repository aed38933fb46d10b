"""Race three tool calls, keep the first answer, cancel the others; crash; recover.

``<kind>_race`` (crashapp) starts three calls of one tool at once, takes whichever answers
first and cancels the others, a common agent pattern (ask several providers, use the
fastest). The process dies right after the first answer is recorded, while the others were
sent. The recovery is slower to reach the losers, so it cancels them before they call
again: the replay never reaches them, and the workflow returns.

The run must not complete while calls it made have no known outcome: it pauses
``effect_state_unknown`` naming them, an operator settles each from the shop's own records,
and ``resume`` completes it. Nothing is sent again, so each call took effect at most once.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.crash.conftest import PATH, Harness, Proc, Shop, coupon_result
from tests.crash.test_crash_windows import campaign_of, result_id

pytestmark = pytest.mark.crash

CAMPAIGN = "race"
UNSETTLED = ("executing", "unknown", "reconciling")


def settled_from_the_shop(kind: str, row: dict[str, Any]) -> dict[str, Any]:
    return {"order_id": row["id"]} if kind == "idempotent" else coupon_result(row)


def paused_for_the_losers(
    kind: str, harness: Harness, shop: Shop, customer: str, run_id: str
) -> Proc:
    """Start the race, crash after the first answer, recover: the run pauses for the two
    calls the replay never reached."""
    wf = f"{kind}_race"
    # The other two calls' effects are committed, their answers held back past the crash.
    shop.service.add_fault(PATH[kind], "delay_after_commit", times=2, seconds=2.0)
    run_input = {"customer": customer, "campaign": CAMPAIGN}
    first = harness.start(wf, run_id, crash_at="effect.after_record", **run_input)
    assert first.code == 77, first.explain()
    proc = harness.recover(wf, run_id, **run_input)
    assert proc.code == 0, proc.explain()
    assert proc.run is not None

    effects = {e["step_id"]: e["status"] for e in harness.describe(run_id)["effects"]}
    assert effects == {"call_0": "succeeded", "call_1": "executing", "call_2": "executing"}
    assert proc.run["status"] == "paused", proc.explain()
    assert proc.run["status_reason"] == "effect_state_unknown"
    assert proc.run["waiting_for"]["step_id"] in ("call_1", "call_2")
    assert proc.run["waiting_for"]["workflow_ended"] is True
    assert "call_1" in proc.run["error"]["message"], proc.run["error"]
    assert "call_2" in proc.run["error"]["message"], proc.run["error"]
    return proc


def settle_from_the_shop(
    proc: Proc, kind: str, harness: Harness, shop: Shop, customer: str, run_id: str
) -> Proc:
    """What an operator does for each call the run pauses for: look it up at the shop,
    resolve it, resume."""
    for _ in range(2):
        assert proc.run is not None
        assert proc.run["status"] == "paused", proc.explain()
        step_id = proc.run["waiting_for"]["step_id"]
        rows = [
            r for r in shop.records(kind, customer) if campaign_of(r) == f"{CAMPAIGN}-{step_id[-1]}"
        ]
        assert len(rows) == 1, rows
        harness.resolve(run_id, step_id, "succeeded", settled_from_the_shop(kind, rows[0]))
        proc = harness.resume(run_id)
        assert proc.code == 0, proc.explain()
    assert proc.run is not None
    return proc


@pytest.mark.parametrize("kind", ["idempotent", "reconciled", "neither"])
def test_calls_a_recovered_run_no_longer_reaches_pause_it_instead_of_ending_it(
    kind: str, harness: Harness, shop: Shop, customer: str, run_id: str
) -> None:
    proc = paused_for_the_losers(kind, harness, shop, customer, run_id)
    assert proc.run is not None
    # Resumed as it is, the run still cannot end.
    again = harness.resume(run_id)
    assert again.run is not None
    assert again.run["waiting_for"] == proc.run["waiting_for"]

    proc = settle_from_the_shop(proc, kind, harness, shop, customer, run_id)
    assert proc.run is not None
    assert proc.run["status"] == "completed", proc.explain()

    # Each call took effect at most once, and the ledger says what the shop did.
    rows_by_campaign: dict[str, list[dict[str, Any]]] = {}
    for row in shop.records(kind, customer):
        rows_by_campaign.setdefault(campaign_of(row), []).append(row)
    assert all(len(rows) == 1 for rows in rows_by_campaign.values()), rows_by_campaign
    for effect in harness.describe(run_id)["effects"]:
        assert effect["status"] not in UNSETTLED, effect
        rows = rows_by_campaign.get(f"{CAMPAIGN}-{effect['step_id'][-1]}", [])
        if effect["status"] == "succeeded":
            assert [result_id(effect["result"])] == [str(r["id"]) for r in rows], effect
        else:
            assert rows == [], (effect, rows)
    assert result_id(proc.run["result"]) == str(rows_by_campaign[f"{CAMPAIGN}-0"][0]["id"])


@pytest.mark.parametrize("kind", ["idempotent", "reconciled", "neither"])
def test_cancelling_it_with_compensations_undoes_each_call_once_its_outcome_is_known(
    kind: str, harness: Harness, shop: Shop, customer: str, run_id: str
) -> None:
    """Each of the losers may have taken effect: its compensation depends on that. The
    cancellation waits for a person to say, then undoes all three, newest first."""
    paused_for_the_losers(kind, harness, shop, customer, run_id)
    proc = harness.cancel(run_id)
    assert proc.code == 0, proc.explain()
    assert proc.run is not None
    assert (proc.run["status"], proc.run["status_reason"]) == ("paused", "effect_state_unknown")
    assert "cancelled with compensations" in proc.run["error"]["message"], proc.run["error"]
    assert shop.emails(customer) == []  # nothing is undone before every outcome is known

    proc = settle_from_the_shop(proc, kind, harness, shop, customer, run_id)
    assert proc.run is not None
    assert proc.run["status"] == "cancelled", proc.explain()
    withdrawn = [e["request"]["subject"] for e in shop.emails(customer)]
    assert sorted(withdrawn) == ["withdrawn call_0", "withdrawn call_1", "withdrawn call_2"]
    assert withdrawn[0] == "withdrawn call_0"  # the last call made is the first undone
    effects = {e["step_id"]: e["status"] for e in harness.describe(run_id)["effects"]}
    assert {k: v for k, v in effects.items() if k.startswith("call_")} == dict.fromkeys(
        ("call_0", "call_1", "call_2"), "compensated"
    )
