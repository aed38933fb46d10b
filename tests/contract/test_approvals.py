"""Approvals bound to exactly what they approve, over both stores."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

import durably
from durably import RunStatus
from tests.conftest import execute_sql

MakeApp = Callable[..., durably.App]


def approvals(app: durably.App, run_id: str) -> list[dict[str, Any]]:
    return list(app.describe(run_id)["approvals"])


def expire(database_url: str, approval_id: str) -> None:
    """Move the approval's expiry into the past: the clock, controlled, not slept."""
    execute_sql(
        database_url,
        "UPDATE durably_approvals SET expires_at = 1 WHERE approval_id = ?",
        (approval_id,),
    )


@pytest.fixture
def mailer(make_app: MakeApp) -> tuple[durably.App, Counter[str], dict[str, str]]:
    app = make_app()
    sent = Counter[str]()
    to = {"address": "lead@example.com"}

    @app.tool(idempotent=True, requires_approval=True, approval_ttl=timedelta(hours=1))
    def send_email(address: str, body: str) -> dict[str, str]:
        sent[address] += 1
        return {"sent_to": address}

    @app.workflow()
    async def report() -> Any:
        try:
            return await send_email(to["address"], "Q3 figures")
        except durably.ApprovalRejected as exc:
            return {"rejected_by": exc.by, "comment": exc.comment}

    return app, sent, to


def test_effect_waits_for_approval_and_runs_once(mailer: Any) -> None:
    app, sent, _ = mailer
    run = app.run("report")
    assert run.status is RunStatus.WAITING_APPROVAL
    assert run.waiting_for["tool"] == "send_email"
    assert run.waiting_for["arguments"] == {"address": "lead@example.com", "body": "Q3 figures"}
    assert sent == Counter()
    (pending,) = approvals(app, run.run_id)
    assert pending["status"] == "requested"
    approved = app.approve(run.run_id, by="ana", comment="ok")
    assert approved.approval_id == pending["approval_id"]
    with pytest.raises(durably.InvalidTransition, match="already approved"):
        app.approve(run.run_id, approved.approval_id, by="eve")
    done = app.resume(run.run_id)
    assert done.status is RunStatus.COMPLETED
    assert sent == Counter({"lead@example.com": 1})
    (used,) = approvals(app, run.run_id)
    assert used["status"] == "consumed"
    assert used["idempotency_key"] == app.describe(run.run_id)["effects"][0]["idempotency_key"]


def test_rejection_raises_in_the_workflow(mailer: Any) -> None:
    app, sent, _ = mailer
    run = app.run("report")
    app.reject(run.run_id, by="ana", comment="numbers are wrong")
    done = app.resume(run.run_id)
    assert done.result == {"rejected_by": "ana", "comment": "numbers are wrong"}
    assert sent == Counter()


def test_an_expired_approval_never_authorises_the_effect(mailer: Any, database_url: str) -> None:
    app, sent, _ = mailer
    run = app.run("report")
    first = app.approve(run.run_id, by="ana")
    expire(database_url, first.approval_id)
    again = app.resume(run.run_id)
    assert again.status is RunStatus.WAITING_APPROVAL
    assert sent == Counter()
    statuses = [a["status"] for a in approvals(app, run.run_id)]
    assert statuses == ["expired", "requested"]
    app.approve(run.run_id, by="ana")
    assert app.resume(run.run_id).status is RunStatus.COMPLETED
    assert sent == Counter({"lead@example.com": 1})


def test_deciding_after_expiry_is_refused(mailer: Any, database_url: str) -> None:
    app, sent, _ = mailer
    run = app.run("report")
    (pending,) = approvals(app, run.run_id)
    expire(database_url, pending["approval_id"])
    with pytest.raises(durably.ApprovalExpired):
        app.approve(run.run_id, by="ana", comment="fine by me")
    # The clock expired it: nothing is recorded in the name of the one refused.
    (expired,) = approvals(app, run.run_id)
    assert (expired["status"], expired["decided_by"], expired["comment"]) == ("expired", None, None)
    [decided] = [e for e in app.events(run.run_id) if e.type == "approval_decided"]
    assert decided.payload["by"] is None
    assert decided.payload["noticed_by"] == "ana"
    again = app.resume(run.run_id)
    assert again.status is RunStatus.WAITING_APPROVAL
    assert [a["status"] for a in approvals(app, run.run_id)] == ["expired", "requested"]
    assert sent == Counter()


def test_approval_is_void_when_the_input_changed(mailer: Any) -> None:
    app, sent, to = mailer
    run = app.run("report")
    app.approve(run.run_id, by="ana")
    to["address"] = "everyone@example.com"  # the plan changed after approval
    again = app.resume(run.run_id)
    assert again.status is RunStatus.WAITING_APPROVAL
    assert again.waiting_for["arguments"]["address"] == "everyone@example.com"
    assert sent == Counter()
    assert [a["status"] for a in approvals(app, run.run_id)] == ["superseded", "requested"]


def test_the_store_judges_expiry_when_the_claim_consumes_it(database_url: str) -> None:
    """Even a runtime that believed the approval valid cannot use an expired one."""
    import asyncio

    from durably.store import open_store
    from durably.store.base import ApprovalRequest, ApprovalUse, EventWrite, NewRun, Transition

    async def scenario() -> None:
        store = open_store(database_url)
        await store.migrate()
        await store.create_run(NewRun("r", "default", "wf", "1", {}, "{}", "h", 2))
        claim = await store.claim_run("r", "w", 30)
        assert claim is not None
        request = ApprovalRequest("a1", "t#1", "tool", "t", "{}", "ih", "k", 1, 10**10)
        await store.commit(claim.lease, Transition(events=[], request_approvals=(request,)))
        await store.decide_approval("r", "a1", "approved", "ana", None)
        wrong_input = ApprovalUse("a1", "other", "k", 1)
        with pytest.raises(durably.ApprovalExpired):
            await store.commit(
                claim.lease, Transition(events=[EventWrite("x")], use_approval=wrong_input)
            )
        execute_sql(database_url, "UPDATE durably_approvals SET expires_at = 1")
        with pytest.raises(durably.ApprovalExpired):
            await store.commit(
                claim.lease,
                Transition(events=[EventWrite("x")], use_approval=ApprovalUse("a1", "ih", "k", 1)),
            )
        assert "x" not in [e.type for e in await store.events("r")]
        await store.close()

    asyncio.run(scenario())


def test_plan_approval_binds_its_payload(make_app: MakeApp) -> None:
    app = make_app()
    audience = {"n": 12000}

    @app.workflow()
    async def campaign() -> Any:
        decision = await durably.approval("send_campaign", {"audience": audience["n"]})
        return {"approved_by": decision["by"]}

    run = app.run(campaign)
    assert run.status is RunStatus.WAITING_APPROVAL
    assert run.waiting_for["payload"] == {"audience": 12000}
    app.approve(run.run_id, by="ana")
    audience["n"] = 50000  # the plan grew after it was approved: ask again
    again = app.resume(run.run_id)
    assert again.status is RunStatus.WAITING_APPROVAL
    assert again.waiting_for["payload"] == {"audience": 50000}
    app.approve(run.run_id, by="bob")
    done = app.resume(run.run_id)
    assert done.result == {"approved_by": "bob"}


def test_approve_needs_a_pending_approval(make_app: MakeApp) -> None:
    app = make_app()

    @app.workflow()
    async def waits() -> Any:
        return await durably.wait_for_event("go")

    run = app.run(waits)
    with pytest.raises(durably.InvalidTransition, match="no pending approval"):
        app.approve(run.run_id)
    with pytest.raises(durably.RunNotFound):
        app.approve("no-such-run")


def test_no_decision_on_a_finished_run(mailer: Any) -> None:
    app, sent, _ = mailer
    run = app.run("report")
    app.cancel(run.run_id)
    with pytest.raises(durably.InvalidTransition, match="final"):
        app.approve(run.run_id, by="ana")
    assert sent == Counter()


def test_a_rejection_can_be_told_to_the_model(make_app: MakeApp) -> None:
    """``on_rejected=``: the call answers with what the model should hear; the run goes on,
    and a replay answers the same without sending."""
    app = make_app()
    sent = Counter[str]()
    gate_open = {"v": False}

    @app.tool(
        idempotent=True,
        requires_approval=True,
        on_rejected=lambda r: {"refused_by": r.by, "why": r.comment},
    )
    def refund(order: str) -> dict[str, str]:
        sent[order] += 1
        return {"refunded": order}

    @app.tool()
    def gate() -> None:
        if not gate_open["v"]:
            raise TimeoutError("no answer")

    @app.workflow()
    async def agent() -> Any:
        answer = await refund("o-1")
        await gate()
        return answer

    run = app.run(agent)
    assert run.status is RunStatus.WAITING_APPROVAL
    app.reject(run.run_id, by="ana", comment="already refunded by phone")
    paused = app.resume(run.run_id)
    assert paused.status_reason == "effect_state_unknown"  # the gate, after the answer
    gate_open["v"] = True
    app.resolve_effect(run.run_id, "gate#1", "not_executed")
    done = app.resume(run.run_id)
    assert done.status is RunStatus.COMPLETED
    assert done.result == {"refused_by": "ana", "why": "already refunded by phone"}
    assert sent == Counter()


def test_calls_in_a_task_group_wait_for_their_approvals(make_app: MakeApp) -> None:
    """A stop raised in an ``asyncio.TaskGroup`` reaches durably inside an exception group,
    and the group cancels the other tasks, one of them maybe while it records the run's
    release: the run asks for every approval at once all the same, and each call takes
    effect once."""
    app = make_app()
    sent = Counter[int]()

    @app.tool(idempotent=True, requires_approval=True)
    def approved(n: int) -> int:
        sent[n] += 1
        return n

    @app.workflow()
    async def three() -> list[int]:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(approved.with_step_id(f"call_{n}")(n)) for n in range(3)]
        return [t.result() for t in tasks]

    run = app.run(three)
    assert run.status is RunStatus.WAITING_APPROVAL
    pending = [a for a in approvals(app, run.run_id) if a["status"] == "requested"]
    assert sorted(a["step_id"] for a in pending) == ["call_0", "call_1", "call_2"]
    for a in pending:
        app.approve(run.run_id, a["approval_id"])
    run = app.resume(run.run_id)
    assert run.status is RunStatus.COMPLETED
    assert run.result == [0, 1, 2]
    assert sent == Counter({0: 1, 1: 1, 2: 1})


@pytest.fixture
def refunds(make_app: MakeApp) -> tuple[durably.App, Counter[str]]:
    """An agent's three parallel refunds, each needing a person's approval (a rejected one
    is told to the model)."""
    app = make_app()
    sent = Counter[str]()

    @app.tool(
        idempotent=True,
        requires_approval=True,
        approval_ttl=timedelta(hours=1),
        on_rejected=lambda r: f"refused by {r.by}",
    )
    def refund(order: str, amount: int) -> str:
        sent[order] += 1
        return f"refunded {order}"

    @app.workflow()
    async def agent() -> list[str]:
        return await durably.gather(*(refund(o, 10 * n) for n, o in enumerate("abc", 1)))

    return app, sent


def pending_by_order(app: durably.App, run_id: str) -> dict[str, dict[str, Any]]:
    return {
        a["payload"]["arguments"]["order"]: a
        for a in approvals(app, run_id)
        if a["status"] == "requested"
    }


def test_parallel_calls_request_their_approvals_together(refunds: Any) -> None:
    """One suspension asks for all three approvals, each bound to its own call; the run goes
    on as each is decided: an approved call takes effect, the others keep waiting for the
    very requests they made (none is asked again)."""
    app, sent = refunds
    run = app.run("agent")
    assert run.status is RunStatus.WAITING_APPROVAL
    pending = pending_by_order(app, run.run_id)
    assert sorted(pending) == ["a", "b", "c"]
    assert [p["payload"]["arguments"]["amount"] for p in pending.values()] == [10, 20, 30]
    assert run.waiting_for is not None
    listed = {w["approval_id"] for w in run.waiting_for["approvals"]}
    assert listed == {p["approval_id"] for p in pending.values()}
    steps = {s["step_id"]: s["status"] for s in app.describe(run.run_id)["steps"]}
    assert sorted(steps.values()) == ["waiting_approval"] * 3
    assert sent == Counter()

    app.approve(run.run_id, pending["b"]["approval_id"], by="ana")
    run = app.resume(run.run_id)
    assert run.status is RunStatus.WAITING_APPROVAL
    assert sent == Counter({"b": 1})
    still = pending_by_order(app, run.run_id)
    assert still == {k: pending[k] for k in ("a", "c")}

    app.reject(run.run_id, pending["a"]["approval_id"], by="bo", comment="duplicate")
    app.approve(run.run_id, pending["c"]["approval_id"], by="ana")
    done = app.resume(run.run_id)
    assert done.status is RunStatus.COMPLETED
    assert done.result == ["refused by bo", "refunded b", "refunded c"]
    assert sent == Counter({"b": 1, "c": 1})
    used = {a["payload"]["arguments"]["order"]: a["status"] for a in approvals(app, run.run_id)}
    assert used == {"a": "rejected", "b": "consumed", "c": "consumed"}


def test_an_approval_decided_while_its_run_executes_is_acted_on(make_app: MakeApp) -> None:
    """The run executes the call approved first; the other one is approved meanwhile. The
    execution read the approvals when it took the run up, so it waits again for the second:
    that decision, made while the run was not waiting, must make it due all the same, not
    leave it waiting until the approval expires."""
    app = make_app()
    operator = make_app()
    sent = Counter[str]()
    second: dict[str, str] = {}

    @app.tool(idempotent=True, requires_approval=True, approval_ttl=timedelta(hours=1))
    def transfer(n: int) -> str:
        if n == 1:
            operator.approve(second["run_id"], second["approval_id"], by="bo")
        sent[f"transfer {n}"] += 1
        return f"sent {n}"

    @app.workflow()
    async def payout() -> list[str]:
        return await durably.gather(transfer(1), transfer(2))

    run = app.run(payout)
    assert run.status is RunStatus.WAITING_APPROVAL
    pending = {a["step_id"]: a["approval_id"] for a in approvals(app, run.run_id)}
    second.update(run_id=run.run_id, approval_id=pending["transfer#2"])
    operator.approve(run.run_id, pending["transfer#1"], by="ana")
    app.worker().run(until_idle=True)
    done = app.get_run(run.run_id)
    assert done.status is RunStatus.COMPLETED, (done.status, done.waiting_for)
    assert done.result == ["sent 1", "sent 2"]
    assert sent == Counter({"transfer 1": 1, "transfer 2": 1})


def test_an_expired_one_of_parallel_approvals_is_asked_again(
    refunds: Any, database_url: str
) -> None:
    """Approved together, one expired before the run used it: that call alone is asked
    again (bound to the same call), the other takes effect."""
    app, sent = refunds
    run = app.run("agent")
    pending = pending_by_order(app, run.run_id)
    for order in "abc":
        app.approve(run.run_id, pending[order]["approval_id"], by="ana")
    expire(database_url, pending["c"]["approval_id"])
    run = app.resume(run.run_id)
    assert run.status is RunStatus.WAITING_APPROVAL
    assert sent == Counter({"a": 1, "b": 1})
    again = pending_by_order(app, run.run_id)
    assert list(again) == ["c"]
    assert again["c"]["approval_id"] != pending["c"]["approval_id"]
    assert again["c"]["idempotency_key"] == pending["c"]["idempotency_key"]
    app.approve(run.run_id, by="ana")
    assert app.resume(run.run_id).status is RunStatus.COMPLETED
    assert sent == Counter({"a": 1, "b": 1, "c": 1})


def test_a_plan_approval_and_a_tool_approval_in_parallel_are_asked_together(
    make_app: MakeApp,
) -> None:
    """``durably.approval`` in one branch, a ``requires_approval`` tool in another: one
    suspension asks both; each decided, the run completes with the tool called once."""
    app = make_app()
    sent = Counter[str]()

    @app.tool(idempotent=True, requires_approval=True)
    def publish(post: str) -> str:
        sent[post] += 1
        return post

    @app.workflow()
    async def campaign() -> list[Any]:
        plan = durably.approval("budget", {"eur": 500})
        return await durably.gather(plan, publish("launch"))

    run = app.run(campaign)
    assert run.status is RunStatus.WAITING_APPROVAL
    pending = [a for a in approvals(app, run.run_id) if a["status"] == "requested"]
    assert sorted(a["kind"] for a in pending) == ["plan", "tool"]
    for a in pending:
        app.approve(run.run_id, a["approval_id"], by="ana")
    done = app.resume(run.run_id)
    assert done.status is RunStatus.COMPLETED, done.error
    assert done.result[0]["approved"] is True
    assert done.result[1] == "launch"
    assert sent == Counter({"launch": 1})
