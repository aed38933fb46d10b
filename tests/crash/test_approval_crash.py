"""Kill real processes around an approval of a ``requires_approval=True`` tool.

``approved_once`` (crashapp) runs a step, then ``approved_tool``: an idempotent POST /orders
that first waits for a person's approval bound to that very call. The shop's own records
(``/effects``) are the ground truth; the run, its effects and approvals are read with
``app.describe``. Both store backends, since each writes the approval's transactions itself.

* A crash right after the approval request: the request and the suspension are one
  transaction, so the run is ``waiting_approval`` with one ``requested`` approval and nothing
  reached the shop. Approved (here with the CLI, in another process), a fresh process
  completes it with exactly one order and the approval ``consumed``.
* A crash between the decision and the resume's record: the recovering process makes the
  call and dies before recording it. The approval was consumed by the claim, so the next
  process does not ask again; it re-sends the same key, which the shop deduplicates.
* An approval that expired before the run used it authorises nothing: the recovering process
  requests a new approval bound to the same call, and the shop stays untouched.
* Three parallel calls needing approval (``approved_together``): a crash right after their
  requests finds all three recorded with the run's suspension (one transaction), none sent;
  approved one by one with the CLI, a recovery that dies after one call's send and the next
  one complete the run with each order placed once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import execute_sql, postgres_schema_url
from tests.crash.conftest import ROOT, SUBPROCESS_TIMEOUT_S, Harness, Proc, Shop

pytestmark = pytest.mark.crash

WORKFLOW = "approved_once"
STEP = "approved_tool#1"
CAMPAIGN = "summer"


@pytest.fixture(params=["sqlite", "postgres"])
def h(request: pytest.FixtureRequest, shop: Shop, tmp_path: Path) -> Iterator[Harness]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/durably.db"
    else:
        url = postgres_schema_url(request.getfixturevalue("postgres_schema"))
    harness = Harness(shop, url)
    yield harness
    harness.close()


def cli(h: Harness, *args: str) -> subprocess.CompletedProcess[str]:
    """The ``durably`` CLI in its own process, on the crash app and the test's database."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DURABLY_")}
    env["DURABLY_DATABASE_URL"] = h.database_url
    return subprocess.run(
        [sys.executable, "-m", "durably", "--app", "tests.crash.crashapp:app", *args],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
        check=False,
    )


def orders(shop: Shop, customer: str) -> list[dict[str, Any]]:
    return [r for r in shop.effects()["orders"] if r["request"]["customer"] == customer]


def assert_crashed(proc: Proc, point: str) -> None:
    assert proc.code == 77, proc.explain()
    assert proc.run is None
    assert f"crash injected at {point} (visit 1)" in proc.stderr, proc.stderr


def assert_waiting(h: Harness, run_id: str) -> dict[str, Any]:
    """The run waits for its one pending approval, bound to the tool call, with no effect."""
    doc = h.describe(run_id)
    assert doc["status"] == "waiting_approval", doc
    assert doc["effects"] == []
    pending = [a for a in doc["approvals"] if a["status"] == "requested"]
    assert len(pending) == 1, doc["approvals"]
    approval = pending[0]
    assert approval["step_id"] == STEP
    assert approval["kind"] == "tool"
    assert approval["payload"]["tool"] == "approved_tool"
    assert doc["waiting_for"]["approval_id"] == approval["approval_id"]
    steps = {s["step_id"]: s["status"] for s in doc["steps"]}
    assert steps == {"begin#1": "succeeded", STEP: "waiting_approval"}
    return dict(approval)


def assert_completed_once(
    h: Harness, shop: Shop, proc: Proc, run_id: str, customer: str
) -> dict[str, Any]:
    """Completed, exactly one order at the shop, the one the ledger recorded."""
    assert proc.code == 0, proc.explain()
    assert proc.run is not None
    assert proc.run["status"] == "completed", proc.explain()
    [order] = orders(shop, customer)
    doc = h.describe(run_id)
    assert doc["status"] == "completed"
    [effect] = doc["effects"]
    assert effect["status"] == "succeeded"
    assert effect["external_operation_id"] == order["id"]
    assert order["idempotency_key"] == effect["idempotency_key"]
    assert proc.run["result"]["order_id"] == order["id"]
    return doc


def test_crash_after_the_request_then_approved_with_the_cli(
    h: Harness, shop: Shop, customer: str, run_id: str
) -> None:
    crashed = h.start(
        WORKFLOW,
        run_id,
        crash_at="approval.after_request",
        customer=customer,
        campaign=CAMPAIGN,
    )
    assert_crashed(crashed, "approval.after_request")
    # Request and suspension were one transaction: no half-suspended run, no order.
    pending = assert_waiting(h, run_id)
    assert orders(shop, customer) == []
    assert shop.requests("POST", "/orders") == 0
    events = [e.type for e in h.events(run_id) if e.step_id == STEP]
    assert events == ["approval_requested"]

    approved = cli(h, "approve", run_id, "--by", "alice", "--json")
    assert approved.returncode == 0, approved.stderr
    decided = json.loads(approved.stdout)
    assert decided["approval_id"] == pending["approval_id"]
    assert (decided["status"], decided["decided_by"]) == ("approved", "alice")
    assert orders(shop, customer) == []

    proc = h.recover(WORKFLOW, run_id, customer=customer, campaign=CAMPAIGN)
    doc = assert_completed_once(h, shop, proc, run_id, customer)
    assert shop.requests("POST", "/orders") == 1
    [used] = doc["approvals"]
    assert (used["approval_id"], used["status"]) == (pending["approval_id"], "consumed")
    assert used["idempotency_key"] == doc["effects"][0]["idempotency_key"]

    again = cli(h, "approve", run_id)
    assert again.returncode == 1
    assert again.stderr.startswith(f"error: run {run_id} is completed (final)")


def test_crash_after_the_approved_call_before_its_record(
    h: Harness, shop: Shop, customer: str, run_id: str
) -> None:
    first = h.start(WORKFLOW, run_id, customer=customer, campaign=CAMPAIGN)
    assert first.code == 0, first.explain()
    assert first.run is not None
    assert first.run["status"] == "waiting_approval"
    pending = assert_waiting(h, run_id)
    h.app.approve(run_id, by="bob")

    crashed = h.recover(
        WORKFLOW, run_id, crash_at="effect.after_call", customer=customer, campaign=CAMPAIGN
    )
    assert_crashed(crashed, "effect.after_call")
    # The order exists, the ledger does not know it; the claim consumed the approval.
    assert len(orders(shop, customer)) == 1
    doc = h.describe(run_id)
    assert [e["status"] for e in doc["effects"]] == ["executing"]
    assert [(a["approval_id"], a["status"]) for a in doc["approvals"]] == [
        (pending["approval_id"], "consumed")
    ]

    proc = h.recover(WORKFLOW, run_id, customer=customer, campaign=CAMPAIGN)
    doc = assert_completed_once(h, shop, proc, run_id, customer)
    # The same key sent twice, one order: the shop deduplicated the re-send.
    assert shop.requests("POST", "/orders") == 2
    assert [(a["approval_id"], a["status"]) for a in doc["approvals"]] == [
        (pending["approval_id"], "consumed")
    ]
    tool_events = [e.type for e in h.events(run_id) if e.step_id == STEP]
    assert tool_events.count("approval_requested") == 1
    assert tool_events[-3:] == ["effect_reconciling", "effect_resent", "effect_succeeded"]


def test_approved_but_expired_before_the_recovery_is_requested_again(
    h: Harness, shop: Shop, customer: str, run_id: str
) -> None:
    crashed = h.start(
        WORKFLOW,
        run_id,
        crash_at="approval.after_request",
        customer=customer,
        campaign=CAMPAIGN,
    )
    assert_crashed(crashed, "approval.after_request")
    old = assert_waiting(h, run_id)
    h.app.approve(run_id)
    execute_sql(h.database_url, "UPDATE durably_approvals SET expires_at = 1")

    proc = h.recover(WORKFLOW, run_id, customer=customer, campaign=CAMPAIGN)
    assert proc.code == 0, proc.explain()
    assert proc.run is not None
    assert proc.run["status"] == "waiting_approval"
    # The expired token authorised nothing: a new approval for the same call, no order.
    new = assert_waiting(h, run_id)
    assert new["approval_id"] != old["approval_id"]
    assert (new["idempotency_key"], new["input_hash"]) == (
        old["idempotency_key"],
        old["input_hash"],
    )
    assert new["expires_at"] > 1
    statuses = [(a["approval_id"], a["status"]) for a in h.describe(run_id)["approvals"]]
    assert statuses == [(old["approval_id"], "expired"), (new["approval_id"], "requested")]
    assert orders(shop, customer) == []
    assert shop.requests("POST", "/orders") == 0

    # The new approval does authorise the call, once.
    h.app.approve(run_id, new["approval_id"])
    done = h.recover(WORKFLOW, run_id, customer=customer, campaign=CAMPAIGN)
    doc = assert_completed_once(h, shop, done, run_id, customer)
    assert shop.requests("POST", "/orders") == 1
    assert [a["status"] for a in doc["approvals"]] == ["expired", "consumed"]


def test_undecided_approval_that_expired_is_requested_again(
    h: Harness, shop: Shop, customer: str, run_id: str
) -> None:
    first = h.start(WORKFLOW, run_id, customer=customer, campaign=CAMPAIGN)
    assert first.code == 0, first.explain()
    old = assert_waiting(h, run_id)
    # Time passes beyond the expiry: the run is due again then (its wake-up time).
    execute_sql(h.database_url, "UPDATE durably_approvals SET expires_at = 1")
    execute_sql(h.database_url, "UPDATE durably_runs SET available_at = 1")

    proc = h.recover(WORKFLOW, run_id, customer=customer, campaign=CAMPAIGN)
    assert proc.code == 0, proc.explain()
    new = assert_waiting(h, run_id)
    assert new["approval_id"] != old["approval_id"]
    statuses = [a["status"] for a in h.describe(run_id)["approvals"]]
    assert statuses == ["expired", "requested"]
    assert orders(shop, customer) == []
    assert shop.requests("POST", "/orders") == 0

    late = cli(h, "approve", run_id, old["approval_id"])
    assert late.returncode == 1
    assert late.stderr.startswith(
        f"error: approval {old['approval_id']} of run {run_id} is already expired"
    )
    assert [a["status"] for a in h.describe(run_id)["approvals"]] == ["expired", "requested"]


def test_parallel_requests_and_the_suspension_are_one_transaction(
    h: Harness, shop: Shop, customer: str, run_id: str
) -> None:
    crashed = h.start(
        "approved_together",
        run_id,
        crash_at="approval.after_request",
        customer=customer,
        campaign=CAMPAIGN,
    )
    assert_crashed(crashed, "approval.after_request")
    doc = h.describe(run_id)
    assert doc["status"] == "waiting_approval", doc
    pending = {a["step_id"]: a for a in doc["approvals"] if a["status"] == "requested"}
    calls = [f"call_{i}" for i in range(3)]
    assert sorted(pending) == calls
    assert {w["approval_id"] for w in doc["waiting_for"]["approvals"]} == {
        a["approval_id"] for a in pending.values()
    }
    steps = {s["step_id"]: s["status"] for s in doc["steps"]}
    assert steps == {"begin#1": "succeeded", **dict.fromkeys(calls, "waiting_approval")}
    assert doc["effects"] == []
    assert shop.requests("POST", "/orders") == 0

    several = cli(h, "approve", run_id)
    assert several.returncode == 1
    assert "3 pending approvals" in several.stderr
    for step in calls:
        approved = cli(h, "approve", run_id, pending[step]["approval_id"], "--by", "alice")
        assert approved.returncode == 0, approved.stderr
    assert orders(shop, customer) == []

    crashed = h.recover(
        "approved_together",
        run_id,
        crash_at="effect.after_call",
        customer=customer,
        campaign=CAMPAIGN,
    )
    assert_crashed(crashed, "effect.after_call")
    # The first call back from the shop died with the process; the others were in flight,
    # or not claimed yet: their approvals are consumed by their claims, or still unused.
    assert 1 <= len(orders(shop, customer)) <= 3
    statuses = [a["status"] for a in h.describe(run_id)["approvals"]]
    assert "consumed" in statuses
    assert set(statuses) <= {"consumed", "approved"}, statuses

    proc = h.recover("approved_together", run_id, customer=customer, campaign=CAMPAIGN)
    assert proc.code == 0, proc.explain()
    assert proc.run is not None
    assert proc.run["status"] == "completed", proc.explain()
    placed = orders(shop, customer)
    assert sorted(o["request"]["items"][0]["sku"] for o in placed) == [
        f"{CAMPAIGN}-{i}" for i in range(3)
    ]
    doc = h.describe(run_id)
    by_key = {e["idempotency_key"]: e for e in doc["effects"]}
    assert sorted(o["idempotency_key"] for o in placed) == sorted(by_key)
    assert all(e["status"] == "succeeded" for e in by_key.values())
    assert sorted((a["step_id"], a["status"]) for a in doc["approvals"]) == [
        (step, "consumed") for step in calls
    ]
    requested = [e.step_id for e in h.events(run_id) if e.type == "approval_requested"]
    assert sorted(requested) == calls
