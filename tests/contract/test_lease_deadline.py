"""A process that outlived its lease starts nothing more, by its own clock.

The store fences late writes, but a worker frozen between its claim and its send (GC,
SIGSTOP, a slow connect) could still send: another worker may have taken the run over and
settled the same call meanwhile. Here the freeze is an ``async`` step that blocks the event
loop past the lease (no heartbeat can run), as a stopped process would.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

import durably
from durably import RunStatus

MakeApp = Callable[..., durably.App]
LEASE = timedelta(seconds=0.4)


def frozen(seconds: float) -> None:
    """Block the whole process's event loop, like SIGSTOP or a long GC pause."""
    time.sleep(seconds)


def finish_elsewhere(app: durably.App, run_id: str) -> durably.Run:
    """What the worker taking over does: once the frozen holder's lease ran out, claim the
    run and execute it to the end."""
    time.sleep(LEASE.total_seconds() + 0.1)
    return app.resume(run_id)


class DiesBeforeItsFirstSend:
    """An ``authorize=`` hook whose first call freezes the process past its lease: the
    holder dies, as far as the store can tell, between a call's claim and its send."""

    def __init__(self) -> None:
        self.frozen = False

    async def __call__(self, op: durably.Operation) -> bool:
        if not self.frozen:
            self.frozen = True
            frozen(LEASE.total_seconds() * 2.5)
        return True


@pytest.mark.parametrize("kind", ["step", "tool"])
def test_no_step_body_or_tool_call_starts_after_the_lease_ran_out(
    make_app: MakeApp, kind: str
) -> None:
    """Frozen with no commit since (which would have renewed the lease, or failed had
    another worker taken the run): the next step body, or the tool call about to be sent,
    does not start; the run is continued by its next holder."""
    app = make_app(lease_ttl=LEASE)
    calls: Counter[str] = Counter()
    thaw = {"frozen": False}

    def freeze_once() -> None:
        if not thaw["frozen"]:
            thaw["frozen"] = True
            frozen(LEASE.total_seconds() * 2.5)

    async def slow_authorisation(op: durably.Operation) -> bool:
        freeze_once()  # between the claim's commit and the send
        return True

    @app.step()
    def think() -> str:
        calls["step"] += 1
        return "thought"

    @app.tool(idempotent=True, authorize=slow_authorisation)
    def send() -> str:
        calls["tool"] += 1
        return "sent"

    @app.workflow()
    async def wf() -> str:
        if kind == "step":
            freeze_once()  # workflow code between calls
            return await think()
        return await send()

    first = app.run(wf)
    assert first.status is not RunStatus.COMPLETED
    assert calls[kind] == 0, f"the {kind} started although the process had outlived its lease"

    done = finish_elsewhere(app, first.run_id)
    assert done.status is RunStatus.COMPLETED
    assert calls[kind] == 1
    assert any(e.type == "run_recovered" for e in app.events(first.run_id))


def test_a_tool_that_checks_the_lease_before_sending_sends_nothing_late(
    make_app: MakeApp,
) -> None:
    """``durably.check_lease()`` right before the request: a tool frozen past its lease
    raises instead of sending; the next holder settles the call (here: re-sends the key)."""
    app = make_app(lease_ttl=LEASE)
    sent: list[str] = []
    tokens: list[int] = []

    @app.tool(idempotent=True)
    async def send(to: str) -> str:
        tokens.append(durably.fencing_token())
        if len(tokens) == 1:
            frozen(LEASE.total_seconds() * 2.5)
        durably.check_lease()
        sent.append(durably.idempotency_key())
        return "sent"

    @app.workflow()
    async def wf() -> str:
        try:
            return await send("a@example.com")
        except Exception as exc:  # a framework swallowing everything must not help
            return f"swallowed {exc!r}"

    first = app.run(wf)
    assert first.status is not RunStatus.COMPLETED
    assert sent == []
    done = finish_elsewhere(app, first.run_id)
    assert done.status is RunStatus.COMPLETED
    assert done.result == "sent"
    assert len(sent) == 1
    assert tokens[1] > tokens[0], "the fencing token grows with every new holder"


def test_fenced_checks_the_lease_on_every_call_and_passes_through_outside_a_run(
    make_app: MakeApp,
) -> None:
    app = make_app(lease_ttl=LEASE)
    requests: list[str] = []

    @durably.fenced
    def post(path: str) -> str:
        requests.append(path)
        return path

    assert post("/outside") == "/outside"  # outside a run: a plain call

    @app.tool(idempotent=True)
    async def two_requests() -> str:
        post("/first")
        frozen(LEASE.total_seconds() * 2.5)
        return post("/second")

    @app.workflow()
    async def wf() -> str:
        return await two_requests()

    run = app.run(wf)
    assert run.status is not RunStatus.COMPLETED
    assert requests == ["/outside", "/first"]


def test_check_lease_outside_a_run_is_a_clear_error() -> None:
    with pytest.raises(durably.OutsideRunError):
        durably.check_lease()
    with pytest.raises(durably.OutsideRunError):
        durably.fencing_token()


class SlowCoupons:
    """A coupon service without idempotency whose first request reaches it late.

    ``coupons`` are its own records, ``posts`` the requests sent to it; ``find`` is the
    reconcile function that asks it.
    """

    def __init__(self, first_arrives_after_s: float) -> None:
        self.delay_s = first_arrives_after_s
        self.coupons: list[str] = []
        self.posts: list[str] = []

    def post(self, customer: str) -> bool:
        """Send a request; True for the first one, which is still on its way."""
        self.posts.append(customer)
        if len(self.posts) == 1:
            threading.Timer(self.delay_s, self.coupons.append, args=(customer,)).start()
            return True
        self.coupons.append(customer)
        return False

    def find(self, op: durably.Operation) -> durably.Reconciliation:
        customer = op.arguments["customer"]
        if customer in self.coupons:
            return durably.Reconciliation.succeeded({"customer": customer})
        return durably.Reconciliation.not_executed()


def test_not_executed_is_trusted_only_after_the_previous_lease_plus_the_grace(
    make_app: MakeApp,
) -> None:
    """A request sent just before the lease ran out may reach the service after the next
    holder first asks. "Not executed" for the previous holder's claim is believed only once
    that holder's lease deadline plus ``reconcile_grace`` has passed; asked again then, the
    service has it, and nothing is sent twice."""
    app = make_app(lease_ttl=LEASE, reconcile_grace=timedelta(seconds=2))
    shop = SlowCoupons(first_arrives_after_s=2.0)

    @app.tool(reconcile=shop.find)
    async def issue_coupon(customer: str) -> dict[str, str]:
        if shop.post(customer):
            # The request left in time but travels slowly, and this process then freezes.
            frozen(LEASE.total_seconds() * 2.5)
            durably.check_lease()
        return {"customer": customer}

    @app.workflow()
    async def wf() -> dict[str, str]:
        return await issue_coupon("c-1")

    first = app.run(wf)
    assert first.status is not RunStatus.COMPLETED
    done = finish_elsewhere(app, first.run_id)
    assert done.status is RunStatus.COMPLETED
    assert shop.coupons == ["c-1"], "a second coupon: 'not executed' was believed too early"
    assert shop.posts == ["c-1"]


def test_a_pause_and_an_operators_resume_keep_the_senders_window(make_app: MakeApp) -> None:
    """The new holder cannot settle the call yet (its lookup fails: the run pauses), and an
    operator resumes at once. The frozen holder's send window is kept with the operation,
    so "not executed" is still not believed before it ends plus the grace."""
    app = make_app(lease_ttl=LEASE, reconcile_grace=timedelta(seconds=4))
    shop = SlowCoupons(first_arrives_after_s=3.0)
    asks: list[str] = []

    def find(op: durably.Operation) -> durably.Reconciliation:
        asks.append(op.idempotency_key)
        if len(asks) == 1:
            # Asked again later, but with no horizon left (reconcile_for=0): the run pauses.
            raise ConnectionError("the lookup service blinked")
        return shop.find(op)

    @app.tool(reconcile=find, reconcile_for=timedelta(0))
    async def issue_coupon(customer: str) -> dict[str, str]:
        if shop.post(customer):
            frozen(LEASE.total_seconds() * 2.5)
            durably.check_lease()
        return {"customer": customer}

    @app.workflow()
    async def wf() -> dict[str, str]:
        return await issue_coupon("c-1")

    first = app.run(wf)
    paused = finish_elsewhere(app, first.run_id)
    assert paused.status is RunStatus.PAUSED
    done = app.resume(first.run_id)
    assert done.status is RunStatus.COMPLETED
    assert shop.coupons == ["c-1"], "a second coupon: the pause lost the sender's window"
    assert shop.posts == ["c-1"]


def test_after_its_own_timeout_a_worker_waits_the_grace_before_believing_silence(
    make_app: MakeApp,
) -> None:
    """The request left, the answer did not come (TimeoutError): the service may still be
    processing it. "Not executed" is believed only a grace after the call returned."""
    app = make_app(lease_ttl=timedelta(seconds=5), reconcile_grace=timedelta(seconds=1.5))
    shop = SlowCoupons(first_arrives_after_s=0.8)

    @app.tool(reconcile=shop.find)
    async def issue_coupon(customer: str) -> dict[str, str]:
        if shop.post(customer):
            raise TimeoutError("read timed out")
        return {"customer": customer}

    @app.workflow()
    async def wf() -> dict[str, str]:
        return await issue_coupon("c-1")

    run = app.run(wf)
    assert run.status is RunStatus.COMPLETED
    assert shop.coupons == ["c-1"], "re-sent while the first request was still on its way"
    assert shop.posts == ["c-1"]


def test_no_call_starts_once_a_parallel_branch_releases_the_run(make_app: MakeApp) -> None:
    """One branch waits for an event (the run is released) while a sibling tool is about
    to start: it must not send with nobody holding the run, or its outcome is lost."""
    app = make_app(lease_ttl=timedelta(seconds=5))
    sent: list[str] = []

    @app.tool()  # neither idempotent nor reconcilable: a lost outcome would need a person
    def charge_card(order: str) -> dict[str, str]:
        time.sleep(0.2)
        durably.check_lease()
        sent.append(order)
        return {"charged": order}

    @app.workflow()
    async def wf() -> list[Any]:
        return list(await asyncio.gather(charge_card("o-1"), durably.wait_for_event("go")))

    run = app.run(wf)
    time.sleep(0.5)
    waiting = app.describe(run.run_id)
    statuses = {e["step_id"]: e["status"] for e in waiting["effects"]}
    assert not (sent and statuses.get("charge_card#1") != "succeeded"), (
        f"sent after the run was released, outcome lost: {statuses}"
    )
    app.send_event(run.run_id, "go")
    app.worker(lease_ttl=timedelta(seconds=5)).run(until_idle=True)
    done = app.get_run(run.run_id)
    assert done.status is RunStatus.COMPLETED, (done.status, done.error)
    assert sent == ["o-1"]


def test_a_recovered_run_reconciles_before_it_makes_a_new_call(make_app: MakeApp) -> None:
    """Its holder died mid-call: the next holder records ``reconciling`` first, settles the
    call (here: re-sends the key), and only then is ``running`` and makes the next call."""
    app = make_app(lease_ttl=LEASE)
    slow_authorisation = DiesBeforeItsFirstSend()

    @app.tool(idempotent=True, authorize=slow_authorisation)
    def send() -> str:
        return "sent"

    @app.step()
    def after() -> str:
        return "next"

    @app.workflow()
    async def wf() -> list[str]:
        return [await send(), await after()]

    first = app.run(wf)
    assert first.status is not RunStatus.COMPLETED
    done = finish_elsewhere(app, first.run_id)
    assert done.result == ["sent", "next"]
    types = [e.type for e in app.events(first.run_id)]
    order = [
        "run_recovered",
        "run_reconciling",
        "effect_reconciling",
        "effect_resent",
        "run_reconciled",
        "effect_succeeded",
        "step_succeeded",
    ]
    assert [t for t in types if t in order][-len(order) :] == order
    reconciling = next(c for c in app.checkpoints(first.run_id) if c["status"] == "reconciling")
    assert reconciling["pending_action"]["step_id"] == "send#1"


def test_a_new_call_waits_for_the_recovered_call_another_branch_is_settling(
    make_app: MakeApp,
) -> None:
    """Parallel branches: the holder died between the claim of one branch's call and its
    send. On recovery that call is re-sent (slowly); the other branch's new call waits until
    it is settled and the run ``running`` again, instead of being sent while the run is
    still reconciling."""
    app = make_app(lease_ttl=LEASE)
    slow_authorisation = DiesBeforeItsFirstSend()
    sent: list[str] = []

    @app.tool(idempotent=True, authorize=slow_authorisation)
    async def refund() -> str:
        await asyncio.sleep(0.3)
        sent.append("refund")
        return "refunded"

    @app.tool(idempotent=True)
    def notify() -> str:
        sent.append("notify")
        return "notified"

    async def later() -> str:
        await asyncio.sleep(0.05)
        return await notify()

    @app.workflow()
    async def wf() -> list[str]:
        return list(await asyncio.gather(refund.with_step_id("r")(), later()))

    first = app.run(wf)
    assert first.status is not RunStatus.COMPLETED
    assert sent == []
    done = finish_elsewhere(app, first.run_id)
    assert done.result == ["refunded", "notified"]
    assert sent == ["refund", "notify"]
    events = [(e.type, e.step_id) for e in app.events(first.run_id)]
    assert events.index(("run_reconciled", None)) < events.index(
        ("effect_intent_recorded", "notify#1")
    )


def test_a_new_call_waiting_for_a_recovered_call_stops_when_that_call_pauses_the_run(
    make_app: MakeApp,
) -> None:
    """The recovered call cannot be settled without a person (the shop, asked, cannot
    tell): the run pauses, and the other branch's new call, which waited while the shop
    was asked, is never sent."""
    app = make_app(lease_ttl=LEASE)
    slow_authorisation = DiesBeforeItsFirstSend()
    sent: list[str] = []

    async def ask_the_shop(op: durably.Operation) -> durably.Reconciliation:
        await asyncio.sleep(0.3)
        return durably.Reconciliation.unresolved("the shop cannot tell")

    @app.tool(authorize=slow_authorisation, reconcile=ask_the_shop)
    def charge() -> str:
        sent.append("charge")
        return "charged"

    @app.tool(idempotent=True)
    def notify() -> str:
        sent.append("notify")
        return "notified"

    async def later() -> str:
        # First execution: after the freeze. Recovery: as soon as the recovered call's
        # own task has started, well before it can be judged.
        await asyncio.sleep(0 if slow_authorisation.frozen else 0.05)
        return await notify()

    @app.workflow()
    async def wf() -> list[str]:
        return list(await asyncio.gather(charge.with_step_id("c")(), later()))

    first = app.run(wf)
    assert first.status is not RunStatus.COMPLETED
    paused = finish_elsewhere(app, first.run_id)
    assert paused.status is RunStatus.PAUSED, (paused.status, paused.error)
    assert sent == []
    assert "notify#1" not in {e["step_id"] for e in app.describe(first.run_id)["effects"]}
