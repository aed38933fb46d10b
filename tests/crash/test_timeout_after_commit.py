"""The shop commits the effect, then the answer is lost: late, dropped, or refused up front.

Faults are injected by the shop itself (``/faults``) on the tool's own path, so the effect
is real and the shop's records are the ground truth:

* ``delay_after_commit`` longer than the tool's HTTP client timeout: committed, then the
  client raises ``TimeoutError``;
* ``drop_after_commit``: committed, then the connection closes without an answer
  (``http.client.RemoteDisconnected``);
* ``reject_before``: 503 before anything is written. A ``ShopHTTPError`` is no category
  durably knows, so by default (``effects.classify``) it is ``UNKNOWN_OUTCOME`` like the
  other two: reconciled, never retried blindly. A tool that knows better says so with
  ``classify=`` (``classified_tool``) and is retried as ``TRANSIENT_BEFORE_SEND``.
"""

from __future__ import annotations

import http.client
from typing import Any

import pytest

import durably
from durably import FailureCategory
from durably.definitions import ToolDef
from durably.demo.shop import ShopHTTPError
from durably.effect import classify
from tests.crash import crashapp
from tests.crash.conftest import PATH, TOOL, WORKFLOW, Harness, Shop, coupon_result

pytestmark = pytest.mark.crash

CAMPAIGN = "autumn"
CLIENT_TIMEOUT_S = 0.5
SHOP_DELAY_S = 2.0
LOST_ANSWER = {"delay_after_commit": "TimeoutError", "drop_after_commit": "RemoteDisconnected"}


@pytest.fixture
def h(harness: Harness) -> Harness:
    harness.shop_timeout_s = CLIENT_TIMEOUT_S
    return harness


def tool_events(h: Harness, run_id: str, kind: str) -> list[tuple[str, dict[str, Any]]]:
    step_id = f"{TOOL[kind]}#1"
    return [(e.type, e.payload) for e in h.events(run_id) if e.step_id == step_id]


def first_run(
    h: Harness, shop: Shop, kind: str, fault: str, customer: str, run_id: str
) -> dict[str, Any]:
    """Queue ``fault`` on the tool's path, then run ``<kind>_once`` in a fresh process."""
    shop.add_fault(PATH[kind], fault, seconds=SHOP_DELAY_S if "delay" in fault else 0.0)
    proc = h.start(WORKFLOW[kind], run_id, customer=customer, campaign=CAMPAIGN)
    assert proc.code == 0, proc.explain()
    assert proc.run is not None
    return proc.run


def assert_unknown_recorded(events: list[tuple[str, dict[str, Any]]], error_type: str) -> None:
    unknown = [p for t, p in events if t == "effect_unknown"]
    assert len(unknown) == 1, events
    assert unknown[0]["category"] == "UNKNOWN_OUTCOME"
    assert unknown[0]["type"] == error_type


def assert_one_effect(
    h: Harness, shop: Shop, run: dict[str, Any], kind: str, customer: str
) -> dict[str, Any]:
    """The shop holds exactly one effect of this customer, the one the run recorded."""
    rows = shop.records(kind, customer)
    assert len(rows) == 1, rows
    key = "order_id" if kind == "idempotent" else "coupon_id"
    assert run["result"][key] == rows[0]["id"]
    effects = h.describe(run["run_id"])["effects"]
    assert [e["status"] for e in effects] == ["succeeded"]
    assert effects[0]["external_operation_id"] in (None, rows[0]["id"])
    return rows[0]


# -- the answer is lost after the commit ---------------------------------------------------


@pytest.mark.parametrize("fault", list(LOST_ANSWER))
def test_reconciled_tool_asks_the_shop(
    fault: str, h: Harness, shop: Shop, customer: str, run_id: str
) -> None:
    run = first_run(h, shop, "reconciled", fault, customer, run_id)
    assert run["status"] == "completed", run
    assert_one_effect(h, shop, run, "reconciled", customer)
    events = tool_events(h, run_id, "reconciled")
    assert_unknown_recorded(events, LOST_ANSWER[fault])
    assert [t for t, _ in events] == [
        "effect_intent_recorded",
        "effect_unknown",
        "effect_reconciling",
        "effect_reconciled",
    ]
    assert events[-1][1]["answer"] == "succeeded"
    assert events[-1][1]["duplicates"] == 0
    assert shop.requests("POST", "/coupons") == 1
    assert shop.requests("GET", "/coupons") == 1


@pytest.mark.parametrize("fault", list(LOST_ANSWER))
def test_idempotent_tool_resends_the_same_key(
    fault: str, h: Harness, shop: Shop, customer: str, run_id: str
) -> None:
    run = first_run(h, shop, "idempotent", fault, customer, run_id)
    assert run["status"] == "completed", run
    assert_one_effect(h, shop, run, "idempotent", customer)
    assert run["result"]["replayed"] is True  # the shop recognised the key
    events = tool_events(h, run_id, "idempotent")
    assert_unknown_recorded(events, LOST_ANSWER[fault])
    assert [t for t, _ in events] == [
        "effect_intent_recorded",
        "effect_unknown",
        "effect_reconciling",
        "effect_resent",
        "effect_succeeded",
    ]
    assert shop.requests("POST", "/orders") == 2


@pytest.mark.parametrize("fault", list(LOST_ANSWER))
def test_tool_with_neither_pauses_unknown(
    fault: str, h: Harness, shop: Shop, customer: str, run_id: str
) -> None:
    run = first_run(h, shop, "neither", fault, customer, run_id)
    step_id = f"{TOOL['neither']}#1"
    assert run["status"] == "paused", run
    assert run["status_reason"] == "effect_state_unknown"
    assert run["waiting_for"]["step_id"] == step_id
    assert h.effect_status(run_id, step_id) == "unknown"
    events = tool_events(h, run_id, "neither")
    assert_unknown_recorded(events, LOST_ANSWER[fault])
    assert [t for t, _ in events][-1] == "run_paused"
    rows = shop.records("neither", customer)
    assert len(rows) == 1, rows  # it happened once, and was not sent again

    record = coupon_result(rows[0])
    h.resolve(run_id, step_id, "succeeded", result=record)
    resumed = h.resume(run_id)
    assert resumed.code == 0, resumed.explain()
    assert resumed.run is not None
    assert resumed.run["status"] == "completed", resumed.explain()
    assert resumed.run["result"] == record
    assert_one_effect(h, shop, resumed.run, "neither", customer)
    assert shop.requests("POST", "/coupons") == 1


# -- refused before anything was written (503) ---------------------------------------------


def tool_def(tool: durably.Durable[..., Any]) -> ToolDef:
    assert isinstance(tool.definition, ToolDef)
    return tool.definition


def test_a_shop_error_is_an_unknown_outcome_by_default() -> None:
    """effects.classify: what durably cannot classify may have happened."""
    unavailable = ShopHTTPError(503, {"error": "unavailable"})
    defaults: list[tuple[BaseException, FailureCategory]] = [
        (unavailable, FailureCategory.UNKNOWN_OUTCOME),
        (TimeoutError("timed out"), FailureCategory.UNKNOWN_OUTCOME),
        (http.client.RemoteDisconnected("closed"), FailureCategory.UNKNOWN_OUTCOME),
        (ConnectionRefusedError(), FailureCategory.TRANSIENT_BEFORE_SEND),
    ]
    for tool in (crashapp.plain_tool, crashapp.reconciled_tool, crashapp.idem_tool):
        for exc, category in defaults:
            assert classify(tool_def(tool), exc) is category, (tool, exc)
    # classify= is asked first; where it answers None the defaults apply.
    classified = tool_def(crashapp.classified_tool)
    assert classify(classified, unavailable) is FailureCategory.TRANSIENT_BEFORE_SEND
    other = ShopHTTPError(500, {"error": "boom"})
    assert classify(classified, other) is FailureCategory.UNKNOWN_OUTCOME


@pytest.mark.parametrize("kind", ["idempotent", "reconciled"])
def test_rejected_before_commit_is_settled_and_executed_once(
    kind: str, h: Harness, shop: Shop, customer: str, run_id: str
) -> None:
    run = first_run(h, shop, kind, "reject_before", customer, run_id)
    assert run["status"] == "completed", run
    assert_one_effect(h, shop, run, kind, customer)
    events = tool_events(h, run_id, kind)
    assert_unknown_recorded(events, "ShopHTTPError")
    settle = "effect_resent" if kind == "idempotent" else "effect_reconciled"
    assert [t for t, _ in events] == [
        "effect_intent_recorded",
        "effect_unknown",
        "effect_reconciling",
        settle,
        "effect_succeeded",
    ]
    if kind == "reconciled":
        assert events[3][1]["answer"] == "not_executed"
        # Asked at once, then again once the reconcile grace after the failed call passed:
        # only the second "not executed" is believed.
        assert shop.requests("GET", "/coupons") == 2
    else:
        assert run["result"]["replayed"] is False  # the first send never reached the table
    assert shop.requests("POST", PATH[kind]) == 2


def test_rejected_before_commit_with_neither_pauses_then_runs_once(
    h: Harness, shop: Shop, customer: str, run_id: str
) -> None:
    run = first_run(h, shop, "neither", "reject_before", customer, run_id)
    step_id = f"{TOOL['neither']}#1"
    assert run["status"] == "paused", run
    assert run["status_reason"] == "effect_state_unknown"
    assert h.effect_status(run_id, step_id) == "unknown"
    assert_unknown_recorded(tool_events(h, run_id, "neither"), "ShopHTTPError")
    assert shop.records("neither", customer) == []

    # The operator sees nothing at the shop: not executed, so it runs with the same key.
    h.resolve(run_id, step_id, "not_executed")
    resumed = h.resume(run_id)
    assert resumed.code == 0, resumed.explain()
    assert resumed.run is not None
    assert resumed.run["status"] == "completed", resumed.explain()
    assert_one_effect(h, shop, resumed.run, "neither", customer)
    assert shop.requests("POST", "/coupons") == 2


def test_rejected_before_commit_classified_as_before_send_is_retried(
    h: Harness, shop: Shop, customer: str, run_id: str
) -> None:
    run = first_run(h, shop, "classified", "reject_before", customer, run_id)
    assert run["status"] == "completed", run
    assert_one_effect(h, shop, run, "classified", customer)
    events = tool_events(h, run_id, "classified")
    assert [t for t, _ in events] == [
        "effect_intent_recorded",
        "effect_executing",
        "effect_failed",
        "effect_retrying",
        "effect_succeeded",
    ]
    assert events[2][1]["category"] == "TRANSIENT_BEFORE_SEND"
    assert shop.requests("POST", "/coupons") == 2


# -- the answer is lost, and the process dies before it records the unknown ------------------

# ``effect.after_call`` is also visited when the tool raised: here the timeout is in hand but
# not recorded. The operation is left ``executing``; recovery settles it like any other.
AFTER_TIMEOUT_CRASH = {
    # (the tool's events over the whole run, POSTs to its path, GET /coupons)
    "idempotent": (
        ["effect_intent_recorded", "effect_reconciling", "effect_resent", "effect_succeeded"],
        2,
        0,
    ),
    "reconciled": (["effect_intent_recorded", "effect_reconciling", "effect_reconciled"], 1, 1),
    "neither": (["effect_intent_recorded", "effect_executing", "run_paused"], 1, 0),
}


@pytest.mark.parametrize("kind", list(AFTER_TIMEOUT_CRASH))
def test_timeout_then_crash_before_recording_it(
    kind: str, h: Harness, shop: Shop, customer: str, run_id: str
) -> None:
    wf, step_id = WORKFLOW[kind], f"{TOOL[kind]}#1"
    shop.add_fault(PATH[kind], "delay_after_commit", seconds=SHOP_DELAY_S)
    first = h.start(wf, run_id, crash_at="effect.after_call", customer=customer, campaign=CAMPAIGN)
    assert first.code == 77, first.explain()
    assert h.effect_status(run_id, step_id) == "executing"
    assert len(shop.records(kind, customer)) == 1

    second = h.recover(wf, run_id, customer=customer, campaign=CAMPAIGN)
    assert second.code == 0, second.explain()
    assert second.run is not None
    events, posts, gets = AFTER_TIMEOUT_CRASH[kind]
    assert [t for t, _ in tool_events(h, run_id, kind)] == events
    if kind == "neither":
        assert second.run["status"] == "paused"
        assert second.run["status_reason"] == "effect_state_unknown"
        assert h.effect_status(run_id, step_id) == "unknown"
        record = coupon_result(shop.records(kind, customer)[0])
        h.resolve(run_id, step_id, "succeeded", result=record)
        resumed = h.resume(run_id)
        assert resumed.code == 0, resumed.explain()
        run = resumed.run
        assert run is not None
        assert run["result"] == record
    else:
        run = second.run
    assert run["status"] == "completed", run
    assert_one_effect(h, shop, run, kind, customer)
    assert shop.requests("POST", PATH[kind]) == posts
    assert shop.requests("GET", "/coupons") == gets
