"""Kill a real worker process at every crash point and check the shop after recovery.

Each run executes ``<kind>_once`` from ``crashapp`` (a step, one tool call, a step) in a
subprocess with ``DURABLY_CRASH_AT=<point>``, which exits 77 there. A fresh subprocess then
recovers the run once the dead one's lease expired. The verdict comes from the shop's own
records, never from the ledger alone:

* ``idempotent`` and ``reconciled`` tools: exactly one effect, run ``completed``, and what the
  ledger recorded exists at the shop (no ghost success).
* ``neither`` (no key, no reconcile): its intent and its claim are separate commits
  (effects.py), so a crash before the call leaves ``intent_recorded``, which is safely
  executed; only a crash after the call and before the record (``effect.after_call``) leaves
  an outcome nobody can know: the run pauses ``effect_state_unknown`` with the effect
  ``unknown`` and the shop holds exactly the one effect; an operator resolves it.
"""

from __future__ import annotations

from typing import Any

import pytest

from durably.faults import CRASH_POINTS
from tests.crash.conftest import PATH, TOOL, WORKFLOW, Harness, Proc, Shop, coupon_result

pytestmark = pytest.mark.crash

KINDS = ("idempotent", "reconciled", "neither")
CAMPAIGN = "spring"

# Which crash points ``<kind>_once`` must reach. The ``effect.*`` points are on every tool's
# path, and so is ``checkpoint.after_write``: a step's commit writes a checkpoint only every
# CHECKPOINT_EVERY results, so this short workflow writes its first one with the tool's
# intent (the same transaction as ``effect.after_intent``); ``step.after_record`` is on
# every step's path. These workflows request no approval, so ``approval.after_request``
# is never reached here: that process must simply complete (test_approval_crash.py covers it).
REACHED = {
    "effect.before_intent": set(KINDS),
    "effect.after_intent": set(KINDS),
    "effect.after_call": set(KINDS),
    "effect.after_record": set(KINDS),
    "step.after_record": set(KINDS),
    "checkpoint.after_write": set(KINDS),
    "approval.after_request": set(),
}

# Right after the crash: the tool operation's ledger status (None: no row) and how many
# effects the shop holds. A reconcilable tool commits intent and claim together
# (``executing``); the ``neither`` tool commits its intent alone (``intent_recorded``).
# The first visit of the step points is the step before the tool.
AT_CRASH: dict[str, dict[str, tuple[str | None, int]]] = {
    "effect.before_intent": dict.fromkeys(KINDS, (None, 0)),
    "effect.after_intent": {
        "idempotent": ("executing", 0),
        "reconciled": ("executing", 0),
        "neither": ("intent_recorded", 0),
    },
    "effect.after_call": dict.fromkeys(KINDS, ("executing", 1)),
    "effect.after_record": dict.fromkeys(KINDS, ("succeeded", 1)),
    "step.after_record": dict.fromkeys(KINDS, (None, 0)),
}
SAME_MOMENT = {"checkpoint.after_write": "effect.after_intent"}
"""Crash points whose first visit is in the same transaction as another's."""
AT_CRASH["checkpoint.after_write"] = AT_CRASH["effect.after_intent"]

_FRESH = {
    "idempotent": ["effect_intent_recorded", "effect_succeeded"],
    "reconciled": ["effect_intent_recorded", "effect_succeeded"],
    "neither": ["effect_intent_recorded", "effect_executing", "effect_succeeded"],
}
_RESENT = ["effect_reconciling", "effect_resent", "effect_succeeded"]

# The tool's events written by the recovering process: how recovery settled the operation.
RECOVERY: dict[str, dict[str, list[str]]] = {
    "effect.before_intent": _FRESH,
    "effect.after_intent": {
        # executing under an expired lease: re-send the same key / ask the shop (not there).
        "idempotent": _RESENT,
        "reconciled": ["effect_reconciling", "effect_reconciled", "effect_succeeded"],
        # intent_recorded was never claimed, so nothing left: claim and execute.
        "neither": ["effect_executing", "effect_succeeded"],
    },
    "effect.after_call": {
        "idempotent": _RESENT,
        "reconciled": ["effect_reconciling", "effect_reconciled"],
        "neither": ["run_paused"],
    },
    "effect.after_record": {kind: [] for kind in KINDS},
    "step.after_record": _FRESH,
}
RECOVERY["checkpoint.after_write"] = RECOVERY["effect.after_intent"]


def paused_unknown(point: str, kind: str) -> bool:
    """Only the tool with neither key nor reconcile, crashed between its call and record."""
    return kind == "neither" and point.partition(":")[0] == "effect.after_call"


def result_id(result: dict[str, Any]) -> str:
    return str(result.get("order_id") or result["coupon_id"])


def tool_events_after_recovery(h: Harness, run_id: str, step_id: str) -> list[str]:
    events = h.events(run_id)
    recovered = [e.sequence for e in events if e.type == "run_recovered"]
    assert recovered, f"no run_recovered event: {[e.type for e in events]}"
    return [e.type for e in events if e.sequence > recovered[-1] and e.step_id == step_id]


def assert_crashed(proc: Proc, point: str) -> None:
    name, _, visit = point.partition(":")
    assert proc.code == 77, proc.explain()
    assert proc.run is None
    assert f"crash injected at {name} (visit {visit or 1})" in proc.stderr, proc.stderr


def assert_completed(proc: Proc) -> dict[str, Any]:
    assert proc.code == 0, proc.explain()
    assert proc.run is not None
    assert proc.run["status"] == "completed", proc.explain()
    assert "crash injected" not in proc.stderr
    return proc.run


def assert_no_ghost(h: Harness, shop: Shop, run_id: str, kind: str, customer: str) -> None:
    """Every effect the ledger calls done exists at the shop, under the id it recorded."""
    at_shop = set(shop.record_ids(kind, customer))
    effects = h.describe(run_id)["effects"]
    assert effects
    for effect in effects:
        assert effect["status"] == "succeeded", effect
        assert result_id(effect["result"]) in at_shop, (effect, at_shop)
        if effect["external_operation_id"] is not None:
            assert effect["external_operation_id"] == result_id(effect["result"]), effect


def pause_then_resolve(
    h: Harness, shop: Shop, proc: Proc, run_id: str, step_id: str, customer: str, campaign: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The paused-unknown path: check it, resolve with the shop's record, resume elsewhere.

    Returns the completed run and the coupon it was resolved with.
    """
    assert proc.code == 0, proc.explain()
    assert proc.run is not None
    assert proc.run["status"] == "paused", proc.explain()
    assert proc.run["status_reason"] == "effect_state_unknown"
    assert proc.run["waiting_for"]["step_id"] == step_id
    assert h.effect_status(run_id, step_id) == "unknown"
    rows = [r for r in shop.records("neither", customer) if campaign_of(r) == campaign]
    assert len(rows) == 1, f"it happened once and was never sent again: {rows}"
    record = coupon_result(rows[0])
    h.resolve(run_id, step_id, "succeeded", result=record)
    return assert_completed(h.resume(run_id)), record


def campaign_of(row: dict[str, Any]) -> str:
    """The campaign of a shop row: a coupon's own, an order's item sku."""
    request = row["request"]
    return str(request.get("campaign") or request["items"][0]["sku"])


@pytest.mark.parametrize(
    ("point", "kind"), [pytest.param(p, k, id=f"{p}-{k}") for p in CRASH_POINTS for k in KINDS]
)
def test_crash_window(
    point: str, kind: str, harness: Harness, shop: Shop, customer: str, run_id: str
) -> None:
    assert point in REACHED, f"crash point {point} is new: state what each flow does there"
    wf, step_id, path = WORKFLOW[kind], f"{TOOL[kind]}#1", PATH[kind]
    first = harness.start(wf, run_id, crash_at=point, customer=customer, campaign=CAMPAIGN)

    if kind not in REACHED[point]:
        run = assert_completed(first)
        assert shop.record_ids(kind, customer) == [result_id(run["result"])]
        assert_no_ghost(harness, shop, run_id, kind, customer)
        return

    assert_crashed(first, point)
    status, at_shop = AT_CRASH[point][kind]
    assert harness.describe(run_id)["status"] == "running"  # as the dead process left it
    effect = harness.effect(run_id, step_id)
    assert (effect and effect["status"]) == status
    assert len(shop.records(kind, customer)) == at_shop
    steps = {s["step_id"]: s["status"] for s in harness.describe(run_id)["steps"]}
    assert steps["begin#1"] == "succeeded"

    second = harness.recover(wf, run_id, customer=customer, campaign=CAMPAIGN)
    assert tool_events_after_recovery(harness, run_id, step_id) == RECOVERY[point][kind]
    if paused_unknown(point, kind):
        run, record = pause_then_resolve(harness, shop, second, run_id, step_id, customer, CAMPAIGN)
        assert run["result"] == record
    else:
        run = assert_completed(second)

    # Exactly one effect at the shop, and it is the one the run reports.
    assert shop.record_ids(kind, customer) == [result_id(run["result"])]
    assert_no_ghost(harness, shop, run_id, kind, customer)
    moment = SAME_MOMENT.get(point, point)
    resent = moment == "effect.after_call" and kind == "idempotent"
    assert shop.requests("POST", path) == (2 if resent else 1)
    asked = kind == "reconciled" and moment in ("effect.after_intent", "effect.after_call")
    if asked and moment == "effect.after_intent":
        # "Not executed" for the dead process's claim is trusted only once its lease plus
        # the reconcile grace has passed: asked again after that, unless already past it.
        assert shop.requests("GET", "/coupons") in (1, 2)
    else:
        assert shop.requests("GET", "/coupons") == (1 if asked else 0)
    if resent:
        assert run["result"]["replayed"] is True
    if asked:
        reconciled = [e for e in harness.events(run_id) if e.type == "effect_reconciled"]
        answer = "succeeded" if point == "effect.after_call" else "not_executed"
        assert [e.payload["answer"] for e in reconciled] == [answer]


# -- counting visits: DURABLY_CRASH_AT=<point>:<n> -----------------------------------------

# (point, workflow shape): the n-th visit is in the second tool call (``twice``) or the step
# after the tool (``once``: ``begin`` is visit 1, ``finish`` visit 2 of step.after_record).
# checkpoint.after_write fires at each tool's intent and outcome commits: visit 3 is the
# second call's intent.
SECOND_VISITS = [
    ("effect.before_intent:2", "twice"),
    ("effect.after_intent:2", "twice"),
    ("effect.after_call:2", "twice"),
    ("effect.after_record:2", "twice"),
    ("step.after_record:2", "once"),
    ("checkpoint.after_write:3", "twice"),
]


@pytest.mark.parametrize(
    ("point", "shape", "kind"),
    [pytest.param(p, s, k, id=f"{p}-{k}") for p, s in SECOND_VISITS for k in KINDS],
)
def test_crash_at_second_visit(
    point: str, shape: str, kind: str, harness: Harness, shop: Shop, customer: str, run_id: str
) -> None:
    wf, tool = f"{kind}_{shape}", TOOL[kind]
    first = harness.start(wf, run_id, crash_at=point, customer=customer, campaign=CAMPAIGN)
    assert_crashed(first, point)

    name = point.partition(":")[0]
    effects = {e["step_id"]: e["status"] for e in harness.describe(run_id)["effects"]}
    campaigns = sorted(campaign_of(r) for r in shop.records(kind, customer))
    if shape == "once":
        # The first visit (step ``begin``) passed; the crash is after ``finish``.
        assert effects == {f"{tool}#1": "succeeded"}
        assert campaigns == [CAMPAIGN]
        steps = {s["step_id"]: s["status"] for s in harness.describe(run_id)["steps"]}
        assert steps["finish#1"] == "succeeded"
    else:
        # The first tool call passed the point and settled; the second crashed there.
        second_status, second_at_shop = AT_CRASH[name][kind]
        expected = {f"{tool}#1": "succeeded"}
        if second_status is not None:
            expected[f"{tool}#2"] = second_status
        assert effects == expected
        assert campaigns == [f"{CAMPAIGN}-1"] + [f"{CAMPAIGN}-2"] * second_at_shop

    second = harness.recover(wf, run_id, customer=customer, campaign=CAMPAIGN)
    if paused_unknown(point, kind):
        step_id, campaign = f"{tool}#2", f"{CAMPAIGN}-2"
        run, record = pause_then_resolve(harness, shop, second, run_id, step_id, customer, campaign)
        assert run["result"][1] == record
    else:
        run = assert_completed(second)

    results = run["result"] if shape == "twice" else [run["result"]]
    rows = shop.records(kind, customer)
    assert [r["id"] for r in rows] == [result_id(r) for r in results]
    wanted = [f"{CAMPAIGN}-1", f"{CAMPAIGN}-2"] if shape == "twice" else [CAMPAIGN]
    assert [campaign_of(r) for r in rows] == wanted
    assert_no_ghost(harness, shop, run_id, kind, customer)


@pytest.mark.parametrize("kind", KINDS)
def test_visit_never_reached_is_not_a_crash(
    kind: str, harness: Harness, shop: Shop, customer: str, run_id: str
) -> None:
    """``twice`` calls its tool two times: a third visit never comes, the run completes."""
    run_input = {"customer": customer, "campaign": CAMPAIGN}
    first = harness.start(f"{kind}_twice", run_id, crash_at="effect.after_call:3", **run_input)
    run = assert_completed(first)
    assert [r["id"] for r in shop.records(kind, customer)] == [result_id(r) for r in run["result"]]
    assert_no_ghost(harness, shop, run_id, kind, customer)


# -- recovery itself dies, and a dead process's lease is respected --------------------------

# After a crash at effect.after_intent, the recovering process executes the tool and dies
# right after the call (effect.after_call). A third process settles it.
AFTER_DOUBLE_CRASH = {
    # executing (attempt 2) under an expired lease again: re-send the key once more.
    "idempotent": {"status": "completed", "posts": 2, "gets": 0},
    # not there (2nd process, asked again once the 1st's lease plus the grace passed, if
    # it had not already), then there (3rd process).
    "reconciled": {"status": "completed", "posts": 1, "gets": (2, 3)},
    # the claim was committed before the call: the outcome is unknown now.
    "neither": {"status": "paused", "posts": 1, "gets": 0},
}


@pytest.mark.parametrize("kind", KINDS)
def test_recovery_that_crashes_is_recovered(
    kind: str, harness: Harness, shop: Shop, customer: str, run_id: str
) -> None:
    wf, step_id = WORKFLOW[kind], f"{TOOL[kind]}#1"
    run_input = {"customer": customer, "campaign": CAMPAIGN}
    first = harness.start(wf, run_id, crash_at="effect.after_intent", **run_input)
    assert_crashed(first, "effect.after_intent")
    second = harness.recover(wf, run_id, crash_at="effect.after_call", **run_input)
    assert_crashed(second, "effect.after_call")
    assert harness.effect_status(run_id, step_id) == "executing"
    assert len(shop.records(kind, customer)) == 1

    third = harness.recover(wf, run_id, **run_input)
    expected = AFTER_DOUBLE_CRASH[kind]
    if expected["status"] == "paused":
        run, record = pause_then_resolve(harness, shop, third, run_id, step_id, customer, CAMPAIGN)
        assert run["result"] == record
    else:
        run = assert_completed(third)
    assert shop.record_ids(kind, customer) == [result_id(run["result"])]
    assert_no_ghost(harness, shop, run_id, kind, customer)
    assert shop.requests("POST", PATH[kind]) == expected["posts"]
    gets = expected["gets"]
    assert shop.requests("GET", "/coupons") in (gets if isinstance(gets, tuple) else (gets,))


def test_live_lease_of_a_dead_process_is_not_taken_over(
    harness: Harness, shop: Shop, customer: str, run_id: str
) -> None:
    """Until the dead holder's lease expires nobody else executes the run (no early resend)."""
    harness.lease_ttl_s = 4.0
    run_input = {"customer": customer, "campaign": CAMPAIGN}
    first = harness.start("idempotent_once", run_id, crash_at="effect.after_call", **run_input)
    assert_crashed(first, "effect.after_call")
    seen = [e.type for e in harness.events(run_id)]

    early = harness.execute_now(run_id)
    assert early.code == 0, early.explain()
    assert early.run is not None
    assert early.run["status"] == "running"
    assert [e.type for e in harness.events(run_id)] == seen  # not claimed, nothing written
    assert shop.requests("POST", "/orders") == 1

    run = assert_completed(harness.recover("idempotent_once", run_id, **run_input))
    assert shop.record_ids("idempotent", customer) == [result_id(run["result"])]
    assert shop.requests("POST", "/orders") == 2


def test_crash_inside_reconciliation_is_recovered(
    harness: Harness, shop: Shop, customer: str, run_id: str
) -> None:
    """A tool's own crash point: the process dies while reconciling (``reconciling`` left)."""
    wf, step_id = WORKFLOW["reconciled"], f"{TOOL['reconciled']}#1"
    run_input = {"customer": customer, "campaign": CAMPAIGN}
    assert_crashed(
        harness.start(wf, run_id, crash_at="effect.after_call", **run_input), "effect.after_call"
    )
    second = harness.recover(wf, run_id, crash_at="find_coupon.answered", **run_input)
    assert_crashed(second, "find_coupon.answered")
    assert harness.effect_status(run_id, step_id) == "reconciling"

    run = assert_completed(harness.recover(wf, run_id, **run_input))
    assert shop.record_ids("reconciled", customer) == [result_id(run["result"])]
    assert_no_ghost(harness, shop, run_id, "reconciled", customer)
    assert shop.requests("POST", "/coupons") == 1
    assert shop.requests("GET", "/coupons") == 2
