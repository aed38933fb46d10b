"""Workflow behaviour over a real store: replay, the effect ledger, failures, operator actions."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

import durably
from durably import FailureCategory, Reconciliation, RetryPolicy, RunStatus
from durably.checkpoint import CHECKPOINTS_KEPT, PRUNE_EVERY
from tests.conftest import execute_sql, fetch_sql

MakeApp = Callable[..., durably.App]
FAST = RetryPolicy(max_attempts=3, initial_interval=timedelta(milliseconds=1))


def events(app: durably.App, run_id: str) -> list[str]:
    return [e.type for e in app.events(run_id)]


def test_completed_steps_and_effects_are_not_repeated(make_app: MakeApp) -> None:
    """Re-executing a run replays recorded results; nothing runs twice."""
    app = make_app()
    calls: Counter[str] = Counter()
    state = {"pause": True}

    @app.step()
    def fetch(region: str) -> dict[str, Any]:
        calls["fetch"] += 1
        return {"region": region, "n": 3}

    @app.tool(idempotent=True)
    def order(n: int) -> dict[str, Any]:
        calls["order"] += 1
        return {"order_id": f"o{n}", "key": durably.idempotency_key()}

    @app.tool()
    def gate() -> str:
        calls["gate"] += 1
        if state["pause"]:
            raise TimeoutError("no answer")
        return "ok"

    @app.workflow()
    async def wf(region: str) -> dict[str, Any]:
        figures = await fetch(region)
        placed = await order(figures["n"])
        await gate()
        return placed

    first = app.run(wf, "EMEA")
    assert first.status is RunStatus.PAUSED
    assert first.status_reason == "effect_state_unknown"
    state["pause"] = False
    app.resolve_effect(first.run_id, "gate#1", "not_executed")
    done = app.resume(first.run_id)
    assert done.status is RunStatus.COMPLETED
    assert calls == Counter(fetch=1, order=1, gate=2)
    assert done.result["order_id"] == "o3"


def test_idempotency_key_is_stable_and_bound_to_position(make_app: MakeApp) -> None:
    """The key is the same on every attempt of one call and differs between calls."""
    app = make_app()
    keys: list[str] = []
    attempts = {"n": 0}

    @app.tool(idempotent=True, retry=FAST)
    def send(to: str) -> str:
        keys.append(durably.idempotency_key())
        attempts["n"] += 1
        if attempts["n"] == 1:
            raise ConnectionRefusedError("service down")
        return to

    @app.workflow()
    async def wf() -> list[str]:
        return [await send("a"), await send("b")]

    run = app.run(wf)
    assert run.status is RunStatus.COMPLETED
    assert run.result == ["a", "b"]
    assert keys[0] == keys[1] != keys[2]
    effects = app.describe(run.run_id)["effects"]
    assert [e["idempotency_key"] for e in effects] == [keys[1], keys[2]]
    assert effects[0]["attempt"] == 2


def test_same_key_with_other_input_is_a_conflict(make_app: MakeApp) -> None:
    """A recorded call replayed with other arguments raises, never reuses the result."""
    app = make_app()
    args = {"amount": 10}
    gate_open = {"v": False}

    @app.tool(idempotent=True)
    def charge(amount: int) -> int:
        return amount

    @app.tool()
    def gate() -> None:
        if not gate_open["v"]:
            raise TimeoutError

    @app.workflow()
    async def wf() -> int:
        charged = await charge(args["amount"])
        await gate()
        return charged

    first = app.run(wf)
    assert first.status is RunStatus.PAUSED
    args["amount"] = 99
    gate_open["v"] = True
    app.resolve_effect(first.run_id, "gate#1", "not_executed")
    again = app.resume(first.run_id)
    assert again.status is RunStatus.PAUSED
    assert again.status_reason == "idempotency_conflict"
    assert again.error is not None
    assert again.error["type"] == "IdempotencyConflict"
    conflicts = app.metrics.idempotency_conflict.labels(tool="charge")._value.get()
    assert conflicts == 1


def test_changed_workflow_code_is_detected(make_app: MakeApp) -> None:
    """A different call at a recorded position pauses the run with non_determinism."""
    app = make_app()
    flip = {"v": False}

    @app.step()
    def a() -> int:
        return 1

    @app.step()
    def b() -> int:
        return 2

    @app.tool()
    def gate() -> None:
        if not flip["v"]:
            raise TimeoutError

    @app.workflow()
    async def wf() -> int:
        first = await (b() if flip["v"] else a())
        await gate()
        return first

    run = app.run(wf)
    flip["v"] = True
    app.resolve_effect(run.run_id, "gate#1", "not_executed")
    again = app.resume(run.run_id)
    assert again.status is RunStatus.PAUSED
    assert again.status_reason == "non_determinism"


def test_failure_categories_decide_retries(make_app: MakeApp) -> None:
    """Before-send and rate limits are retried; business rejection is raised at once."""
    app = make_app()
    calls: Counter[str] = Counter()

    @app.tool(retry=FAST)
    def flaky() -> str:
        calls["flaky"] += 1
        if calls["flaky"] < 3:
            raise durably.ToolError(
                "slow down",
                category=FailureCategory.RATE_LIMIT,
                retry_after=timedelta(milliseconds=1),
            )
        return "ok"

    @app.tool(retry=FAST)
    def declined() -> str:
        calls["declined"] += 1
        raise durably.ToolError("card declined", category=FailureCategory.BUSINESS_REJECTED)

    @app.workflow()
    async def wf() -> dict[str, Any]:
        result = await flaky()
        try:
            await declined()
        except durably.StepFailed as exc:
            return {"flaky": result, "declined": exc.category, "step": exc.step_id}
        return {}

    run = app.run(wf)
    assert run.status is RunStatus.COMPLETED
    assert run.result == {"flaky": "ok", "declined": "BUSINESS_REJECTED", "step": "declined#1"}
    assert calls == Counter(flaky=3, declined=1)


def test_exhausted_retries_fail_the_run(make_app: MakeApp) -> None:
    """A before-send failure that never clears fails after max_attempts executions."""
    app = make_app()
    calls = Counter[str]()

    @app.tool(retry=FAST)
    def down() -> None:
        calls["down"] += 1
        raise ConnectionRefusedError

    @app.workflow()
    async def wf() -> None:
        await down()

    run = app.run(wf)
    assert run.status is RunStatus.FAILED
    assert run.error is not None
    assert run.error["type"] == "StepFailed"
    assert calls["down"] == 3


def test_unknown_outcome_is_reconciled_not_retried(make_app: MakeApp) -> None:
    """A timeout after the request left asks reconcile; 'succeeded' is recorded, no re-send."""
    app = make_app()
    shop: list[str] = []

    def lookup(op: durably.Operation) -> Reconciliation:
        assert op.arguments == {"customer": "c1"}
        found = [c for c in shop if c == op.arguments["customer"]]
        return (
            Reconciliation.succeeded({"coupon": found[0]})
            if found
            else (Reconciliation.not_executed())
        )

    @app.tool(reconcile=lookup, external_id=lambda r: r["coupon"])
    def issue(customer: str) -> dict[str, str]:
        shop.append(customer)
        raise TimeoutError("answered too late")

    @app.workflow()
    async def wf() -> dict[str, str]:
        return await issue("c1")

    run = app.run(wf)
    assert run.status is RunStatus.COMPLETED
    assert run.result == {"coupon": "c1"}
    assert shop == ["c1"]
    effect = app.describe(run.run_id)["effects"][0]
    assert effect["status"] == "succeeded"
    assert effect["external_operation_id"] == "c1"
    assert "effect_unknown" in events(app, run.run_id)
    assert "effect_reconciled" in events(app, run.run_id)
    assert app.metrics.reconciliation.labels(result="succeeded")._value.get() == 1


@pytest.mark.parametrize(
    "refusal",
    [
        ConnectionRefusedError("down"),
        durably.ToolError("slow down", category=FailureCategory.RATE_LIMIT),
        durably.ToolError("not allowed", category=FailureCategory.PERMISSION),
    ],
    ids=["before_send", "rate_limited", "not_allowed"],
)
def test_a_resend_that_never_reached_the_service_leaves_the_first_attempt_unknown(
    make_app: MakeApp, refusal: Exception
) -> None:
    """The first payment took effect and its answer was lost; re-sending it under its key
    fails before reaching the service. That says nothing about the first one: the call stays
    unknown, and once the attempts are spent a person says, never a failed step the workflow
    would act on as if nothing was paid."""
    app = make_app()
    paid: list[str] = []
    attempts: list[str] = []

    @app.tool(idempotent=True, retry=RetryPolicy(max_attempts=2, initial_interval=timedelta(0)))
    def pay() -> str:
        attempts.append(durably.idempotency_key())
        if len(attempts) == 1:
            paid.append(durably.idempotency_key())
            raise TimeoutError("no answer")
        raise refusal

    @app.workflow()
    async def wf() -> str:
        try:
            return await pay()
        except durably.StepFailed:
            return "not paid"

    run = app.run(wf)
    assert (run.status, run.status_reason) == (RunStatus.PAUSED, "effect_state_unknown")
    assert len(attempts) == 2
    assert len(paid) == 1
    effect = app.describe(run.run_id)["effects"][0]
    assert effect["status"] == "unknown"
    app.resolve_effect(run.run_id, effect["step_id"], "succeeded", result="paid")
    assert app.worker().run(until_idle=True) == 1
    assert app.get_run(run.run_id).result == "paid"
    assert len(paid) == 1


def test_a_throttled_resend_waits_the_delay_the_service_asked_for(make_app: MakeApp) -> None:
    app = make_app()
    sent: list[float] = []

    @app.tool(idempotent=True, retry=RetryPolicy(max_attempts=3, initial_interval=timedelta(0)))
    def pay() -> str:
        sent.append(time.monotonic())
        if len(sent) == 1:
            raise TimeoutError("no answer")
        if len(sent) == 2:
            raise durably.ToolError(
                "slow down", category=FailureCategory.RATE_LIMIT, retry_after=timedelta(seconds=0.5)
            )
        return "paid"

    @app.workflow()
    async def wf() -> str:
        return await pay()

    assert app.run(wf).result == "paid"
    assert len(sent) == 3
    assert sent[2] - sent[1] >= 0.5


def test_a_resend_that_declines_as_control_flow_leaves_the_first_attempt_unknown(
    make_app: MakeApp,
) -> None:
    """A tool re-sent after an answer was lost raises its framework's control flow (ask the
    model again): that resend chose not to act, but the first attempt may have. The call
    stays unknown, never recorded as not sent."""
    app = make_app()
    paid: list[str] = []

    class AskAgain(Exception):
        pass

    @app.tool(
        idempotent=True,
        control_flow=[AskAgain],
        retry=RetryPolicy(max_attempts=2, initial_interval=timedelta(0)),
    )
    def pay() -> str:
        if not paid:
            paid.append(durably.idempotency_key())
            raise TimeoutError("no answer")
        raise AskAgain

    @app.workflow()
    async def wf() -> str:
        try:
            return await pay()
        except AskAgain:
            return "asked again"

    run = app.run(wf)
    assert (run.status, run.status_reason) == (RunStatus.PAUSED, "effect_state_unknown")
    assert len(paid) == 1
    assert app.describe(run.run_id)["effects"][0]["status"] == "unknown"


def test_reconcile_not_executed_runs_again_with_same_key(make_app: MakeApp) -> None:
    # A short reconcile grace: "not executed" is trusted only after it.
    app = make_app(reconcile_grace=timedelta(milliseconds=200))
    keys: list[str] = []

    @app.tool(reconcile=lambda op: Reconciliation.not_executed())
    def send() -> str:
        keys.append(durably.idempotency_key())
        if len(keys) == 1:
            raise durably.OutcomeUnknown("connection reset")
        return "sent"

    @app.workflow()
    async def wf() -> str:
        return await send()

    run = app.run(wf)
    assert run.status is RunStatus.COMPLETED
    assert len(keys) == 2
    assert keys[0] == keys[1]


def test_unresolved_effect_pauses_until_resolved(make_app: MakeApp) -> None:
    """Neither idempotent nor reconcilable: the run pauses; an operator settles it."""
    app = make_app()
    sent: list[str] = []

    @app.tool()
    def send(to: str) -> dict[str, str]:
        sent.append(to)
        raise TimeoutError

    @app.workflow()
    async def wf() -> dict[str, str]:
        return await send("lead@example.com")

    run = app.run(wf)
    assert run.status is RunStatus.PAUSED
    assert run.status_reason == "effect_state_unknown"
    assert run.waiting_for is not None
    assert run.waiting_for["step_id"] == "send#1"
    assert app.describe(run.run_id)["effects"][0]["status"] == "unknown"
    assert app.resume(run.run_id).status is RunStatus.PAUSED  # still unknown: no guess
    assert sent == ["lead@example.com"]
    resolved = app.resolve_effect(run.run_id, "send#1", "succeeded", result={"id": "m1"})
    assert resolved.status is RunStatus.QUEUED
    done = app.resume(run.run_id)
    assert done.status is RunStatus.COMPLETED
    assert done.result == {"id": "m1"}
    assert sent == ["lead@example.com"]
    with pytest.raises(durably.InvalidTransition):
        app.resolve_effect(run.run_id, "send#1", "failed")


def test_resolve_failed_raises_in_workflow(make_app: MakeApp) -> None:
    app = make_app()

    @app.tool()
    def send() -> None:
        raise TimeoutError

    @app.workflow()
    async def wf() -> str:
        try:
            await send()
        except durably.StepFailed as exc:
            return f"handled {exc.category}"
        return "sent"

    run = app.run(wf)
    app.resolve_effect(run.run_id, "send#1", "failed")
    assert app.resume(run.run_id).result == "handled BUSINESS_REJECTED"


def test_non_json_tool_result_is_recorded_as_happened(make_app: MakeApp) -> None:
    """The effect is recorded as happened, so it is never repeated; the run pauses for an
    operator to give the real outcome (tests/contract/test_hostile_values.py)."""
    app = make_app()
    calls = Counter[str]()

    @app.tool(idempotent=True)
    def weird() -> object:
        calls["weird"] += 1
        return {1, 2}

    @app.workflow()
    async def wf() -> None:
        await weird()

    run = app.run(wf)
    assert run.status is RunStatus.PAUSED
    assert run.status_reason == "result_not_storable"
    effect = app.describe(run.run_id)["effects"][0]
    assert effect["status"] == "succeeded"
    assert calls["weird"] == 1


def test_redacted_arguments_are_not_stored_in_clear(make_app: MakeApp, database_url: str) -> None:
    app = make_app(secret_key="a-test-secret-of-at-least-16-bytes")

    @app.tool(idempotent=True, redact=["card"])
    def pay(card: str, amount: int) -> int:
        return amount

    @app.workflow()
    async def wf() -> int:
        return await pay("4242424242424242", 5)

    run = app.run(wf)
    stored = app.describe(run.run_id)["effects"][0]["arguments"]
    assert stored["amount"] == 5
    assert set(stored["card"]) == {"redacted"}
    path = database_url.removeprefix("sqlite:///")
    if database_url.startswith("sqlite:"):
        with open(path, "rb") as db:
            assert b"4242424242424242" not in db.read()


def test_compensation_runs_once(make_app: MakeApp) -> None:
    app = make_app()
    undone: list[str] = []

    def cancel(op: durably.Operation) -> str:
        undone.append(op.result["order_id"])
        return "cancelled"

    @app.tool(idempotent=True, compensate=cancel)
    def place() -> dict[str, str]:
        return {"order_id": "o1"}

    @app.tool()
    def charge() -> None:
        raise durably.ToolError("declined", category=FailureCategory.BUSINESS_REJECTED)

    @app.workflow()
    async def wf() -> list[str]:
        await place()
        try:
            await charge()
        except durably.StepFailed:
            return await durably.compensate()
        return []

    run = app.run(wf)
    assert run.status is RunStatus.COMPLETED
    assert run.result == ["place#1"]
    assert undone == ["o1"]
    statuses = {e["step_id"]: e["status"] for e in app.describe(run.run_id)["effects"]}
    assert statuses["place#1"] == "compensated"
    assert statuses["compensate:place#1"] == "succeeded"


def test_parallel_calls_get_ids_in_creation_order(make_app: MakeApp) -> None:
    app = make_app()

    @app.step()
    async def slow(i: int) -> int:
        await asyncio.sleep(0.01 * (3 - i))
        return i

    @app.workflow()
    async def wf() -> list[int]:
        return list(await asyncio.gather(slow(0), slow(1), slow(2)))

    run = app.run(wf)
    steps = app.describe(run.run_id)["steps"]
    assert {s["step_id"]: s["output"] for s in steps} == {"slow#1": 0, "slow#2": 1, "slow#3": 2}


def test_start_is_idempotent_on_run_id(make_app: MakeApp) -> None:
    app = make_app()

    @app.workflow()
    async def wf(x: int) -> int:
        return x

    assert app.start(wf, 1, run_id="fixed") == "fixed"
    assert app.start(wf, 1, run_id="fixed") == "fixed"
    with pytest.raises(durably.IdempotencyConflict):
        app.start(wf, 2, run_id="fixed")


def test_run_on_a_run_id_that_exists_executes_that_run_or_refuses_another_input(
    make_app: MakeApp,
) -> None:
    """``app.run`` leases a run it creates in the same commit; a run that exists already is
    not created again: a queued one is executed here, a finished one returned as it is,
    and another input under its id is refused."""
    app = make_app()
    bodies: list[int] = []

    @app.step()
    def body(x: int) -> int:
        bodies.append(x)
        return x

    @app.workflow()
    async def wf(x: int) -> int:
        return await body(x)

    assert app.start(wf, 1, run_id="queued") == "queued"
    assert app.run(wf, 1, run_id="queued").result == 1
    assert app.run(wf, 1, run_id="queued").result == 1
    assert app.run(wf, 2, run_id="fresh").result == 2
    assert bodies == [1, 2]
    with pytest.raises(durably.IdempotencyConflict):
        app.run(wf, 3, run_id="fresh")
    assert app.get_run("fresh").result == 2


def test_bad_input_gets_typed_errors(make_app: MakeApp) -> None:
    app = make_app(max_payload_bytes=100)

    @app.step()
    def s() -> int:
        return 1

    @app.workflow()
    async def wf(x: object) -> None:
        return None

    with pytest.raises(durably.NotJSONSerializable):
        app.start(wf, object())
    with pytest.raises(durably.NotJSONSerializable):
        app.start(wf, (1, 2))  # would replay as a list
    with pytest.raises(durably.PayloadTooLarge):
        app.start(wf, "x" * 200)
    with pytest.raises(durably.OutsideRunError):
        asyncio.run(s())  # type: ignore[arg-type]
    with pytest.raises(durably.RunNotFound):
        app.get_run("nope")
    with pytest.raises(durably.ConfigurationError):
        app.start("no_such_workflow")


def test_corrupted_checkpoint_falls_back_and_is_reported(
    make_app: MakeApp, database_url: str
) -> None:
    """A checkpoint failing its checksum is skipped; the run resumes from the previous one."""
    app = make_app()
    gate_open = {"v": False}

    @app.step()
    def s(i: int) -> int:
        return i

    @app.tool()
    def gate() -> None:
        if not gate_open["v"]:
            raise TimeoutError

    @app.workflow()
    async def wf() -> int:
        total = await s(1) + await s(2)
        await gate()
        return total

    run = app.run(wf)
    execute_sql(
        database_url,
        "UPDATE durably_checkpoints SET payload_json = replace(payload_json, '\"status\"', "
        "'\"stat\"') WHERE state_version = (SELECT max(state_version) FROM durably_checkpoints)",
    )
    gate_open["v"] = True
    app.resolve_effect(run.run_id, "gate#1", "not_executed")
    done = app.resume(run.run_id)
    assert done.status is RunStatus.COMPLETED
    assert done.result == 3
    assert "checkpoint_corrupted" in events(app, run.run_id)


def test_altered_journal_is_never_used(make_app: MakeApp, database_url: str) -> None:
    """A recorded result changed behind durably's back pauses the run: no silent wrong state."""
    app = make_app()
    gate_open = {"v": False}

    @app.step()
    def price() -> int:
        return 10

    @app.tool()
    def gate() -> None:
        if not gate_open["v"]:
            raise TimeoutError

    @app.workflow()
    async def wf() -> int:
        p = await price()
        await gate()
        return p

    run = app.run(wf)
    execute_sql(
        database_url, "UPDATE durably_steps SET output_json = '1000' WHERE step_id = 'price#1'"
    )
    gate_open["v"] = True
    with pytest.raises(durably.CheckpointCorrupted):
        app.resolve_effect(run.run_id, "gate#1", "not_executed")
    again = app.resume(run.run_id)
    assert again.status is RunStatus.PAUSED
    assert again.status_reason == "checkpoint_corrupted"
    assert again.error is not None
    assert again.error["type"] == "CheckpointCorrupted"


def test_worker_completes_queued_runs(make_app: MakeApp) -> None:
    app = make_app()

    @app.step()
    def double(x: int) -> int:
        return 2 * x

    @app.workflow()
    async def wf(x: int) -> int:
        return await double(x)

    ids = [app.start(wf, i) for i in range(5)]
    assert app.worker(concurrency=2).run(until_idle=True) == 5
    assert [app.get_run(i).result for i in ids] == [0, 2, 4, 6, 8]


def test_checkpoints_carry_every_field(make_app: MakeApp) -> None:
    app = make_app()

    @app.tool(idempotent=True)
    def t() -> int:
        return 1

    @app.workflow()
    async def wf() -> int:
        return await t()

    run = app.run(wf)
    payloads = app.checkpoints(run.run_id)
    assert all(p.pop("valid") for p in payloads)
    assert all(p.pop("checksum") for p in payloads)
    assert set(payloads[0]) == {
        "checkpoint_id",
        "run_id",
        "state_version",
        "current_step",
        "status",
        "state_snapshot",
        "last_event_sequence",
        "pending_action",
        "completed_effects",
        "budget_snapshot",
        "created_at",
        "schema_version",
    }
    assert payloads[0]["status"] == "completed"
    assert payloads[0]["completed_effects"] == {
        "count": 1,
        "keys": [app.describe(run.run_id)["effects"][0]["idempotency_key"]],
    }
    intent = payloads[-1]
    assert intent["pending_action"]["step_id"] == "t#1"
    assert json.dumps(payloads)  # everything is JSON


@pytest.mark.parametrize("secret_key", [None, b"k" * 32], ids=["plain", "sealed"])
@pytest.mark.parametrize("waits", [False, True], ids=["one-execution", "sleeps-between"])
def test_a_long_run_keeps_a_bounded_number_of_checkpoints_as_it_goes(
    make_app: MakeApp, database_url: str, secret_key: bytes | None, waits: bool
) -> None:
    """Every effect is checkpointed twice (its intent and its result), every sealed step's
    result once: a run of many of them prunes as it goes, not only when it ends, also when
    each of its executions is short (a sleep between calls ends one)."""
    app = make_app(secret_key=secret_key)
    held: list[int] = []

    def count(run_id: str) -> int:
        ((n,),) = fetch_sql(
            database_url, "SELECT count(*) FROM durably_checkpoints WHERE run_id = ?", (run_id,)
        )
        return int(n)

    @app.tool(idempotent=True)
    def send(i: int) -> int:
        held.append(count(durably.current_run().run_id))
        return i

    @app.step()
    def add(i: int) -> int:
        held.append(count(durably.current_run().run_id))
        return i

    @app.workflow()
    async def wf(n: int) -> int:
        total = 0
        for i in range(n):
            total += await send(i) + await add(i)
            if waits:
                await durably.sleep(0.001)
        return total

    calls = 20 if waits else 40
    run = app.run(wf, calls)
    deadline = time.monotonic() + 60
    while run.status is not RunStatus.COMPLETED:
        assert run.status is RunStatus.WAITING_EXTERNAL, run
        assert time.monotonic() < deadline
        time.sleep(0.002)
        app.worker().run(until_idle=True)
        run = app.get_run(run.run_id)
    assert run.result == 2 * sum(range(calls))
    assert CHECKPOINTS_KEPT < max(held) <= CHECKPOINTS_KEPT + PRUNE_EVERY, held
    assert count(run.run_id) == CHECKPOINTS_KEPT


def test_a_runs_steps_are_described_in_call_order(make_app: MakeApp) -> None:
    """The store reads a run's steps unordered (no index holds their order): the journal
    sorts them by position, not by step id, where "x#10" comes before "x#2"."""
    app = make_app()

    @app.step()
    def b() -> int:
        return 1

    @app.step()
    def a() -> int:
        return 1

    @app.step()
    def x(i: int) -> int:
        return i

    @app.workflow()
    async def wf() -> int:
        total = await b() + await a()
        for i in range(12):
            total += await x(i)
        return total

    run = app.run(wf)
    called = ["b#1", "a#1", *(f"x#{i}" for i in range(1, 13))]
    assert [s["step_id"] for s in app.describe(run.run_id)["steps"]] == called


def test_a_run_that_moved_after_its_last_commit_ends_sealed_where_it_really_is(
    make_app: MakeApp, database_url: str
) -> None:
    """An execution's ending is sealed at the state its last commit left the run in, when
    the run is still there. An event that arrived in between moved it: the ending is then
    committed and sealed at the run's real state, and nothing is lost."""
    app = make_app()

    @app.step()
    def one() -> int:
        return 1

    @app.workflow()
    async def wf(aside: bool) -> int:
        x = await one()
        if aside:
            run_id = durably.current_run().run_id
            await app.send_event_async(run_id, "aside", {"n": 1}, event_id=f"{run_id}-aside")
        return x

    for aside in (True, False):
        run = app.run(wf, aside)
        assert run.result == 1
        ending = ["step_succeeded", *(["event_received"] if aside else []), "run_completed"]
        assert events(app, run.run_id)[-len(ending) :] == ending
        ((state_version, last_sequence),) = fetch_sql(
            database_url,
            "SELECT state_version, last_sequence FROM durably_runs WHERE run_id = ?",
            (run.run_id,),
        )
        newest = app.checkpoints(run.run_id)[0]
        assert newest["valid"]
        assert newest["status"] == "completed"
        assert (newest["state_version"], newest["last_event_sequence"]) == (
            state_version,
            last_sequence,
        )


def test_a_run_is_checkpointed_when_it_is_received(make_app: MakeApp) -> None:
    """The first checkpoint is written with the run: queued, nothing in its journal."""
    app = make_app()

    @app.workflow()
    async def wf(n: int) -> int:
        return n

    run_id = app.start(wf, 1, run_id="received")
    assert app.start(wf, 1, run_id="received") == run_id  # the same task: no second one
    (receipt,) = app.checkpoints(run_id)
    assert receipt["valid"]
    assert receipt["status"] == "queued"
    assert (receipt["state_version"], receipt["last_event_sequence"]) == (1, 1)
    assert receipt["state_snapshot"] == {"journal_length": 0, "journal_digest": ""}
    assert receipt["completed_effects"] == {"count": 0, "keys": []}
    assert [e.type for e in app.events(run_id)] == ["run_started"]
    app.worker().run(until_idle=True)
    assert app.get_run(run_id).result == 1
    assert app.checkpoints(run_id)[-1]["checkpoint_id"] == f"{run_id}:1"


def test_a_paused_unknown_effect_is_the_checkpoints_pending_action(make_app: MakeApp) -> None:
    """What recovery must do first is in the checkpoint: the call whose outcome is unknown."""
    app = make_app()

    @app.tool()
    def send() -> None:
        raise TimeoutError("no answer")

    @app.workflow()
    async def wf() -> None:
        await send()

    run = app.run(wf)
    assert run.status_reason == "effect_state_unknown"
    latest = app.checkpoints(run.run_id)[0]
    assert latest["status"] == "paused"
    key = app.describe(run.run_id)["effects"][0]["idempotency_key"]
    assert latest["pending_action"] == {
        "tool": "send",
        "step_id": "send#1",
        "idempotency_key": key,
        "status": "unknown",
    }
    app.resolve_effect(run.run_id, "send#1", "failed")
    app.resume(run.run_id)
    assert app.checkpoints(run.run_id)[0]["pending_action"] is None


def test_tool_timeout_is_an_unknown_outcome(make_app: MakeApp) -> None:
    """A call cut off by timeout= may still have taken effect: unknown, never 'failed'."""
    app = make_app()

    @app.tool(timeout=timedelta(milliseconds=50))
    async def slow() -> str:
        await asyncio.sleep(5)
        return "late"

    @app.workflow()
    async def wf() -> str:
        return await slow()

    run = app.run(wf)
    assert run.status is RunStatus.PAUSED
    effect = app.describe(run.run_id)["effects"][0]
    assert effect["status"] == "unknown"
    assert effect["error"]["type"] == "TimeoutError"


def test_classify_maps_exceptions_to_categories(make_app: MakeApp) -> None:
    """classify= is asked first; ToolError states its own; the rest follow the defaults."""
    app = make_app()
    calls = Counter[str]()

    class Throttled(Exception):
        pass

    def classify(exc: BaseException) -> FailureCategory | None:
        return FailureCategory.RATE_LIMIT if isinstance(exc, Throttled) else None

    @app.tool(classify=classify, retry=FAST)
    def api() -> str:
        calls["api"] += 1
        if calls["api"] == 1:
            raise Throttled
        if calls["api"] == 2:
            raise ConnectionRefusedError
        return "ok"

    @app.workflow()
    async def wf() -> str:
        return await api()

    run = app.run(wf)
    assert run.status is RunStatus.COMPLETED
    assert calls["api"] == 3
    categories = [
        e.payload.get("category") for e in app.events(run.run_id) if e.type == "effect_failed"
    ]
    assert categories == ["RATE_LIMIT", "TRANSIENT_BEFORE_SEND"]


def test_a_tool_error_takes_its_category_by_name_or_leaves_the_outcome_unknown(
    make_app: MakeApp,
) -> None:
    """``category="PERMISSION"`` is the category; a misspelt one fails in the tool, which
    leaves the call unknown rather than read as some failure it may not be."""
    app = make_app()

    @app.tool()
    def send(category: str) -> str:
        raise durably.ToolError("no", category=category)  # type: ignore[arg-type]

    @app.workflow()
    async def wf(category: str) -> str:
        return await send(category)

    refused = app.run(wf, "PERMISSION")
    assert (refused.status, refused.status_reason) == (RunStatus.PAUSED, "permission_denied")
    misspelt = app.run(wf, "PERMISION")
    assert (misspelt.status, misspelt.status_reason) == (RunStatus.PAUSED, "effect_state_unknown")
    (effect,) = app.describe(misspelt.run_id)["effects"]
    assert effect["status"] == "unknown"
    assert "PERMISION" in effect["error"]["message"]


def test_runs_are_pinned_to_their_workflow_version(make_app: MakeApp) -> None:
    """Code with another version neither claims nor executes a run; the right code does."""
    old, new = make_app(), make_app()

    @old.workflow(name="report", version="1")
    async def report_v1() -> str:
        return "v1"

    @new.workflow(name="report", version="2")
    async def report_v2() -> str:
        return "v2"

    run_id = old.start(report_v1)
    assert new.worker().run(until_idle=True) == 0
    with pytest.raises(durably.ConfigurationError, match="pinned to report version '1'"):
        new.resume(run_id)
    assert old.worker().run(until_idle=True) == 1
    assert old.get_run(run_id).result == "v1"


def test_replan_gives_later_calls_new_keys_and_replays_the_old_ones(make_app: MakeApp) -> None:
    from durably.keys import idempotency_key

    app = make_app()
    keys: list[str] = []
    state = {"open": False}

    @app.tool(idempotent=True)
    def send(to: str) -> str:
        keys.append(durably.idempotency_key())
        return to

    @app.tool()
    def gate() -> None:
        if not state["open"]:
            raise TimeoutError

    @app.workflow()
    async def wf() -> list[int]:
        await send("a")
        version = await durably.replan()
        await send("b")
        await gate()
        return [version, durably.current_run().plan_version]

    run = app.run(wf)
    assert run.status is RunStatus.PAUSED
    state["open"] = True
    app.resolve_effect(run.run_id, "gate#1", "not_executed")
    done = app.resume(run.run_id)  # replays both sends under their original plans
    assert done.status is RunStatus.COMPLETED
    assert done.result == [2, 2]
    assert keys == [
        idempotency_key("default", run.run_id, 1, "send#1", "send"),
        idempotency_key("default", run.run_id, 2, "send#2", "send"),
    ]
    assert [e["idempotency_key"] for e in app.describe(run.run_id)["effects"]][:2] == keys


def test_a_replan_racing_a_call_pauses_instead_of_repeating_it(make_app: MakeApp) -> None:
    """A replan in a parallel branch can land before or after a call depending on timing;
    a replay that derives another key than the one recorded must not execute again."""
    app = make_app()
    charged = Counter[str]()
    state = {"open": False}
    gate_hold = {"wait": 0.05}

    @app.step()
    async def slow() -> None:
        await asyncio.sleep(gate_hold["wait"])

    @app.tool(idempotent=True)
    def charge(amount: int) -> int:
        charged[str(amount)] += 1
        return amount

    @app.tool()
    def gate() -> None:
        if not state["open"]:
            raise TimeoutError

    @app.workflow()
    async def wf() -> int:
        async def revise() -> None:
            await durably.replan()

        task = asyncio.ensure_future(revise())
        await slow()
        charged_amount = await charge(10)
        await task
        await gate()
        return charged_amount

    run = app.run(wf)
    assert run.status is RunStatus.PAUSED
    state["open"] = True
    app.resolve_effect(run.run_id, "gate#1", "not_executed")
    again = app.resume(run.run_id)
    assert charged == Counter({"10": 1})
    assert again.status in (RunStatus.COMPLETED, RunStatus.PAUSED)
    if again.status is RunStatus.PAUSED:
        assert again.status_reason == "non_determinism"


def test_every_reconciliation_answer(make_app: MakeApp) -> None:
    """running is asked again, failed is final, unresolved pauses, and so does a raising
    reconcile once its horizon (here none) has passed."""
    app = make_app()
    answers: dict[str, list[Reconciliation]] = {
        "running_then_done": [Reconciliation.running(), Reconciliation.succeeded("ok")],
        "failed": [Reconciliation.failed(FailureCategory.BUSINESS_REJECTED, "refused")],
        "unresolved": [Reconciliation.unresolved("no record either way")],
    }
    asked = Counter[str]()

    def reconcile(op: durably.Operation) -> Reconciliation:
        which = op.arguments["which"]
        asked[which] += 1
        if which == "raises":
            raise RuntimeError("lookup service down")
        return answers[which][min(asked[which], len(answers[which])) - 1]

    @app.tool(reconcile=reconcile, retry=FAST, reconcile_for=timedelta(0))
    async def act(which: str) -> str:
        raise TimeoutError

    @app.workflow()
    async def wf(which: str) -> str:
        try:
            return await act(which)
        except durably.StepFailed as exc:
            return f"failed: {exc.category}"

    assert app.run(wf, "running_then_done").result == "ok"
    assert asked["running_then_done"] == 2
    assert app.run(wf, "failed").result == "failed: BUSINESS_REJECTED"
    for which in ("unresolved", "raises"):
        run = app.run(wf, which)
        assert run.status is RunStatus.PAUSED, which
        assert run.status_reason == "effect_state_unknown"
        assert app.describe(run.run_id)["effects"][0]["status"] == "unknown"


def test_reconciliation_keeps_asking_without_holding_the_run(
    make_app: MakeApp, database_url: str
) -> None:
    """A lookup service that blinks, then answers "running", then knows: the run is
    released between asks (a durable timer, no lease) and completes without a person."""
    app = make_app()
    answers = iter(
        [RuntimeError("lookup service down"), Reconciliation.running(), Reconciliation.running()]
        + [Reconciliation.running()] * 4  # one ask's polls
        + [Reconciliation.succeeded({"coupon": "C-1"})]
    )
    sent = Counter[str]()
    asked_at: list[float] = []

    def find(op: durably.Operation) -> Reconciliation:
        asked_at.append(time.time())
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    @app.tool(reconcile=find, retry=RetryPolicy(initial_interval=timedelta(milliseconds=20)))
    def issue(customer: str) -> dict[str, Any]:
        sent[customer] += 1
        raise TimeoutError("no answer")

    @app.workflow()
    async def wf() -> Any:
        return await issue("ann")

    run = app.run(wf)
    while run.status is RunStatus.RECONCILING:
        assert run.waiting_for is not None
        assert run.waiting_for["kind"] == "reconcile"
        held = fetch_sql(
            database_url, "SELECT lease_owner FROM durably_runs WHERE run_id = ?", (run.run_id,)
        )
        assert held == [(None,)], "nobody holds the run while it waits to ask"
        time.sleep(max(float(run.waiting_for["retry_at"]) - time.time(), 0) + 0.05)
        # Once at least; twice if the next 50 ms timer ran out before the worker went idle
        # (a stall of the process, a full garbage collection, is enough): it is due then.
        assert app.worker().run(until_idle=True) >= 1
        run = app.get_run(run.run_id)
    assert run.status is RunStatus.COMPLETED, run.error
    assert run.result == {"coupon": "C-1"}
    assert sent == Counter(ann=1), "asked, never sent again"
    # The raise, then an ask whose polls all said "running", then one that learned it.
    later = [e for e in app.events(run.run_id) if e.type == "effect_reconcile_later"]
    assert [e.payload["asks"] for e in later] == [1, 2]
    assert next(answers, None) is None
    assert len(asked_at) == 1 + 5 + 2
    # Each ask waited for its durable timer (the store's clock is this machine's here).
    assert asked_at[1] >= later[0].payload["retry_at"]
    assert asked_at[6] >= later[1].payload["retry_at"]


def test_reconciliation_pauses_after_its_horizon_and_resume_asks_again(
    make_app: MakeApp,
) -> None:
    app = make_app()
    knows = {"v": False}

    def find(op: durably.Operation) -> Reconciliation:
        if not knows["v"]:
            raise ConnectionRefusedError("lookup service down")
        return Reconciliation.succeeded("done")

    @app.tool(
        reconcile=find,
        retry=RetryPolicy(initial_interval=timedelta(milliseconds=50)),
        reconcile_for=timedelta(milliseconds=300),
    )
    def act() -> str:
        raise TimeoutError("no answer")

    @app.workflow()
    async def wf() -> str:
        return await act()

    run = app.run(wf)
    deadline = time.monotonic() + 10
    while run.status is RunStatus.RECONCILING and time.monotonic() < deadline:
        time.sleep(0.06)
        app.worker().run(until_idle=True)
        run = app.get_run(run.run_id)
    assert run.status is RunStatus.PAUSED
    assert run.status_reason == "effect_state_unknown"
    assert run.error is not None
    assert "could not say whether it happened" in run.error["message"]
    knows["v"] = True
    done = app.resume(run.run_id)  # a new horizon: asked again at once
    assert done.status is RunStatus.COMPLETED, done.error
    assert done.result == "done"


@pytest.mark.parametrize("how", ["reported", "raised"])
def test_reconcile_gets_the_external_id_known_before_the_outcome(
    make_app: MakeApp, how: str
) -> None:
    """The service accepted a job and gave its id, then the answer was lost: reconcile asks
    by that id (from durably.external_id() or OutcomeUnknown(external_id=))."""
    app = make_app()
    asked: list[str | None] = []

    def by_id(op: durably.Operation) -> Reconciliation:
        asked.append(op.external_operation_id)
        return Reconciliation.succeeded({"job": op.external_operation_id, "state": "done"})

    @app.tool(reconcile=by_id)
    def render(doc: str) -> dict[str, Any]:
        if how == "reported":
            durably.external_id("job-7")
            raise TimeoutError("no answer")
        raise durably.OutcomeUnknown("connection cut", external_id="job-7")

    @app.workflow()
    async def wf() -> Any:
        return await render("report.pdf")

    run = app.run(wf)
    assert run.status is RunStatus.COMPLETED, run.error
    assert run.result == {"job": "job-7", "state": "done"}
    assert asked == ["job-7"]
    assert app.describe(run.run_id)["effects"][0]["external_operation_id"] == "job-7"


def test_external_id_outside_a_tool_is_refused() -> None:
    with pytest.raises(durably.OutsideRunError):
        durably.external_id("job-7")


def test_a_new_tool_version_keeps_the_calls_already_recorded(
    make_app: MakeApp, database_url: str
) -> None:
    """Deploying @app.tool(version="2") while a run waits: its recorded call is still the
    same call (its key and result kept, no idempotency_conflict); new calls use version 2."""
    charged: list[tuple[str, int]] = []

    def deploy(version: str, gate_open: bool) -> durably.App:
        app = make_app()

        @app.tool(idempotent=True, version=version)
        def charge(amount: int) -> int:
            charged.append((version, amount))
            return amount

        @app.tool()
        def gate() -> None:
            if not gate_open:
                raise TimeoutError("no answer")

        @app.workflow()
        async def wf() -> list[int]:
            first = await charge(10)
            await gate()
            return [first, await charge(20)]

        return app

    old = deploy("1", gate_open=False)
    run = old.run("wf")
    assert run.status_reason == "effect_state_unknown"
    old.resolve_effect(run.run_id, "gate#1", "not_executed")
    new = deploy("2", gate_open=True)
    done = new.resume(run.run_id)
    assert done.status is RunStatus.COMPLETED, done.error
    assert done.result == [10, 20]
    assert charged == [("1", 10), ("2", 20)]
    versions = {
        r[0]: r[1]
        for r in fetch_sql(
            database_url,
            "SELECT step_id, tool_version FROM durably_tool_operations WHERE run_id = ?",
            (run.run_id,),
        )
    }
    assert versions == {"charge#1": "1", "gate#1": "1", "charge#2": "2"}


def test_a_worker_rechecks_a_run_paused_at_a_tool_that_can_reconcile(make_app: MakeApp) -> None:
    """Past its horizon the run paused for a person; the lookup service is back later, and a
    worker asks again by itself. A tool that cannot reconcile is left to the person."""
    app = make_app()
    back = {"v": False}

    def find(op: durably.Operation) -> Reconciliation:
        if not back["v"]:
            raise ConnectionRefusedError("lookup service down")
        return Reconciliation.succeeded("found")

    @app.tool(reconcile=find, reconcile_for=timedelta(0))
    def act() -> str:
        raise TimeoutError("no answer")

    @app.tool()
    def plain() -> str:
        raise TimeoutError("no answer")

    @app.workflow()
    async def wf(reconcilable: bool) -> str:
        return await (act() if reconcilable else plain())

    asked = app.run(wf, True)
    alone = app.run(wf, False)
    assert asked.status_reason == alone.status_reason == "effect_state_unknown"
    assert app.worker(recheck_paused=timedelta(hours=1)).run(until_idle=True) == 0  # too soon
    back["v"] = True
    assert app.worker(recheck_paused=timedelta(0)).run(until_idle=True) == 1
    assert app.get_run(asked.run_id).status is RunStatus.COMPLETED
    assert app.get_run(asked.run_id).result == "found"
    assert app.get_run(alone.run_id).status is RunStatus.PAUSED
    resumed = [e for e in app.events(asked.run_id) if e.type == "run_resumed"]
    assert [e.payload["by"] for e in resumed] == ["recheck"]


def test_concurrent_first_uses_of_an_app_share_one_store(make_app: MakeApp) -> None:
    """Two first uses at once (a worker starting beside a read) open one store: a second
    one, dropped, would keep its connections and pool tasks alive past ``close``."""
    app = make_app()

    async def both() -> tuple[bool, bool]:
        try:
            first, second = await asyncio.gather(app.open(), app.open())
            return first is second, first is app.store
        finally:
            await app.close_async()

    assert asyncio.run(both()) == (True, True)


def test_the_run_an_execution_returns_is_the_run_as_stored(make_app: MakeApp) -> None:
    """``app.run`` (of a new run or of one already there) and ``resume`` return the run as
    the commit that released it read it back: the same as reading it again, whichever way
    the execution ended."""
    app = make_app()
    state = {"fail": True}

    @app.tool()
    def gate() -> str:
        if state["fail"]:
            raise TimeoutError("no answer")
        return "ok"

    @app.workflow()
    async def ends(how: str) -> str:
        if how == "fails":
            raise ValueError("the input says fail")
        if how == "waits":
            return str(await durably.wait_for_event("go"))
        if how == "pauses":
            return await gate()
        return how

    assert app.list_runs() == []  # opens the store
    store = app.store
    reads: list[str] = []
    get_run = store.get_run

    async def counted(run_id: str) -> Any:
        reads.append(run_id)
        return await get_run(run_id)

    store.get_run = counted  # type: ignore[method-assign]
    for how, status in [
        ("completes", RunStatus.COMPLETED),
        ("fails", RunStatus.FAILED),
        ("waits", RunStatus.WAITING_EXTERNAL),
        ("pauses", RunStatus.PAUSED),
    ]:
        returned = app.run(ends, how, run_id=f"r-{how}")
        assert reads == []  # the releasing commit read it: no read of its own
        assert returned.status is status
        assert returned == app.get_run(returned.run_id)
        reads.clear()
    app.send_event("r-waits", "go", "now")
    executed = app.run(ends, "waits", run_id="r-waits")
    assert executed.status is RunStatus.COMPLETED
    assert executed.result == "now"
    assert executed == app.get_run("r-waits")
    state["fail"] = False
    app.resolve_effect("r-pauses", "gate#1", "not_executed")
    resumed = app.resume("r-pauses")
    assert resumed.status is RunStatus.COMPLETED
    assert resumed.result == "ok"
    assert resumed == app.get_run("r-pauses")


def test_a_steps_first_write_says_its_row_is_new(make_app: MakeApp) -> None:
    """A step's result or failure is written once, and its writer says the row is new (on
    PostgreSQL a plain insert in one statement); the row is then what the step returned or
    raised."""
    app = make_app()

    @app.step()
    async def double(x: int) -> int:
        return 2 * x

    @app.step(retry=RetryPolicy(max_attempts=2, initial_interval=timedelta(0)))
    async def refuse() -> int:
        raise ValueError("no")

    @app.workflow()
    async def flow(fail: bool) -> int:
        total = await double(1) + await double(2)
        if fail:
            await refuse()
        return total

    assert app.list_runs() == []  # opens the store
    store = app.store
    writes: list[Any] = []
    commit = store.commit

    async def seen(guard: Any, t: Any) -> Any:
        if t.step is not None:
            writes.append(t.step)
        return await commit(guard, t)

    store.commit = seen  # type: ignore[method-assign]
    assert app.run(flow, False, run_id="ok").result == 6
    assert app.run(flow, True, run_id="no").status is RunStatus.FAILED
    assert [(w.step_id, w.status.value, w.new_row) for w in writes] == [
        ("double#1", "succeeded", True),
        ("double#2", "succeeded", True),
        ("double#1", "succeeded", True),
        ("double#2", "succeeded", True),
        ("refuse#1", "failed", True),
    ]
    steps = {s["step_id"]: s for s in app.describe("no")["steps"]}
    assert (steps["double#2"]["output"], steps["refuse#1"]["status"]) == (4, "failed")


def test_a_workflow_may_take_an_argument_named_workflow_by_keyword(make_app: MakeApp) -> None:
    """``start`` and ``run`` take the workflow positionally only: its input may use the name."""
    app = make_app()

    @app.workflow()
    async def route(workflow: str, step: int = 1) -> str:
        return f"{workflow}:{step}"

    assert app.run(route, workflow="billing", step=2).result == "billing:2"
    run_id = app.start("route", workflow="refunds")
    assert app.worker().run(until_idle=True) == 1
    assert app.get_run(run_id).result == "refunds:1"
