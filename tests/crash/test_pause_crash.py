"""An operator's pause outlives the worker it was asked of: SIGKILLed mid-effect right after
the request, the run is recovered by a fresh process, which settles the effect in flight
and then pauses before the next call (real processes, a real shop)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from tests.crash.conftest import ROOT, Harness, Shop

WORKFLOW = "reconciled_twice"
CAMPAIGN = "spring"


def test_a_pause_asked_of_a_worker_killed_mid_effect_holds_after_recovery(
    harness: Harness, shop: Shop, customer: str, run_id: str
) -> None:
    # The shop writes the first coupon, then holds its answer: the worker is mid-effect.
    shop.add_fault("/coupons", "delay_after_commit", seconds=4.0)
    env = {
        **os.environ,
        "DURABLY_DATABASE_URL": harness.database_url,
        "SHOP_URL": shop.url,
        "SHOP_TIMEOUT": "5",
        "CRASH_LEASE_TTL": str(harness.lease_ttl_s),
        "CRASH_ROLE": "start",
    }
    env.pop("DURABLY_CRASH_AT", None)
    run_input = json.dumps({"customer": customer, "campaign": CAMPAIGN})
    worker = subprocess.Popen(
        [sys.executable, "-m", "tests.crash.runner", "start", run_id, WORKFLOW, run_input],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while not shop.records("reconciled", customer):
            assert worker.poll() is None, "the worker ended before its first effect"
            assert time.monotonic() < deadline, "the first coupon never reached the shop"
            time.sleep(0.02)
        asked = harness.app.pause(run_id, reason="audit", by="ana")
        assert asked.status.value == "running"  # held: only a request
        assert asked.pause_requested
    finally:
        worker.kill()  # SIGKILL: nothing of the effect's outcome was recorded
        worker.wait(10)
    assert harness.effect_status(run_id, "reconciled_tool#1") == "executing"

    recovered = harness.recover(WORKFLOW, run_id, customer=customer, campaign=CAMPAIGN)
    assert recovered.code == 0, recovered.explain()
    assert recovered.run is not None
    assert (recovered.run["status"], recovered.run["status_reason"]) == (
        "paused",
        "operator_pause",
    ), recovered.explain()
    # The effect in flight was settled (the shop asked, never sent again); the next call
    # was never made.
    assert harness.effect_status(run_id, "reconciled_tool#1") == "succeeded"
    assert harness.effect(run_id, "reconciled_tool#2") is None
    assert len(shop.records("reconciled", customer)) == 1
    assert shop.requests("POST", "/coupons") == 1
    types = [e.type for e in harness.events(run_id)]
    assert types.index("pause_requested") < types.index("run_recovered")
    assert types.index("effect_reconciled") < types.index("run_paused")

    harness.app.unpause(run_id, by="ana")
    done = harness.execute_now(run_id)
    assert done.code == 0, done.explain()
    assert done.run is not None
    assert done.run["status"] == "completed", done.explain()
    assert len(shop.records("reconciled", customer)) == 2
    assert shop.requests("POST", "/coupons") == 2
