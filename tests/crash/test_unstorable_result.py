"""A result no store can hold, around a crash: the effect happens once and waits for an
operator, never repeated, never failed for good.

The tool places a real order at the shop (idempotent, keyed) and returns it with a lone
surrogate, as a response cut inside a character would. The process dies right after the
call (``effect.after_call``): the order exists, nothing is recorded. A fresh process re-sends
the same key (the shop answers the same order), records the effect as succeeded and pauses
the run as ``result_not_storable``. Resuming without settling changes nothing; after an
operator records the shop's real answer, the run completes with it.
"""

from __future__ import annotations

from tests.crash.conftest import Harness, Shop
from tests.crash.test_crash_windows import assert_completed, assert_crashed

STEP = "garbled_tool#1"


def test_an_unstorable_result_after_a_crash_pauses_once_and_resolves(
    harness: Harness, shop: Shop, customer: str, run_id: str
) -> None:
    run_input = {"customer": customer, "campaign": "spring"}
    first = harness.start("garbled_once", run_id, crash_at="effect.after_call", **run_input)
    assert_crashed(first, "effect.after_call")
    assert len(shop.records("idempotent", customer)) == 1
    assert harness.effect_status(run_id, STEP) == "executing"

    second = harness.recover("garbled_once", run_id, **run_input)
    assert second.code == 0, second.explain()
    assert second.run is not None
    assert (second.run["status"], second.run["status_reason"]) == (
        "paused",
        "result_not_storable",
    )
    assert harness.effect_status(run_id, STEP) == "succeeded"
    assert shop.requests("POST", "/orders") == 2  # the re-send, answered from the same key

    again = harness.resume(run_id)
    assert again.run is not None, again.explain()
    assert again.run["status"] == "paused"
    assert shop.requests("POST", "/orders") == 2

    [order] = shop.records("idempotent", customer)
    harness.resolve(run_id, STEP, "succeeded", result={"order_id": order["id"]})
    done = assert_completed(harness.resume(run_id))
    assert done["result"] == {"order_id": order["id"]}
    assert shop.record_ids("idempotent", customer) == [order["id"]]
    assert shop.requests("POST", "/orders") == 2
