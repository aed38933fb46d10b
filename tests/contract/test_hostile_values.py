"""Values no store can hold, and ids that could forge another run's key, on both stores.

An effect that happened is recorded as happened whatever its result looks like; ids and
texts that would break the store, a terminal or the key derivation are refused where they
enter, with an error naming them, before anything is written.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import durably
from durably import PauseReason, RunStatus
from durably.keys import canonical_json, sha256_hex
from durably.store.base import NewRun
from durably.worker import Worker
from tests.conftest import execute_sql

MakeApp = Callable[..., durably.App]


def deep(levels: int) -> Any:
    value: Any = "leaf"
    for _ in range(levels):
        value = {"a": value}
    return value


@pytest.mark.parametrize(
    "returned",
    [
        pytest.param({"memo": "\ud800"}, id="lone-surrogate"),
        pytest.param({"memo": "a\x00b"}, id="nul"),
        pytest.param({"k\x00": 1}, id="nul-in-key"),
        pytest.param(deep(300), id="nested-300"),
        pytest.param((1, 2), id="tuple"),
    ],
)
def test_an_unstorable_result_records_the_effect_and_pauses(
    make_app: MakeApp, returned: Any
) -> None:
    """The email went out: the operation is succeeded (never stranded in executing), the run
    is paused for an operator (never failed for good), and resolving it continues the run
    with the service's real outcome, without a second send."""
    app = make_app()
    sent: Counter[str] = Counter()

    @app.tool(idempotent=True)
    def send_email(to: str) -> Any:
        sent[to] += 1
        return returned

    @app.workflow()
    async def wf() -> Any:
        return {"mail": await send_email("a@example.com")}

    run = app.run(wf)
    assert run.status is RunStatus.PAUSED
    assert run.status_reason == PauseReason.RESULT_NOT_STORABLE
    assert run.error is not None
    assert "durably resolve" in run.error["message"]
    effect = app.describe(run.run_id)["effects"][0]
    assert effect["status"] == "succeeded"
    assert effect["result"] is None

    again = app.resume(run.run_id)  # nothing settled yet: it pauses again, nothing re-sent
    assert again.status is RunStatus.PAUSED
    assert sent["a@example.com"] == 1

    app.resolve_effect(run.run_id, "send_email#1", "succeeded", result={"memo": "ok"})
    done = app.resume(run.run_id)
    assert done.status is RunStatus.COMPLETED
    assert done.result == {"mail": {"memo": "ok"}}
    assert sent["a@example.com"] == 1


@pytest.mark.parametrize("bad", ["\ud800", "a\x00b"])
def test_unstorable_arguments_are_refused_before_the_intent(make_app: MakeApp, bad: str) -> None:
    app = make_app()
    sent: list[str] = []

    @app.tool(idempotent=True)
    def send_email(to: str) -> str:
        sent.append(to)
        return "sent"

    @app.workflow()
    async def wf() -> Any:
        try:
            await send_email(bad)
        except durably.NotJSONSerializable as exc:
            return str(exc)
        return "accepted"

    run = app.run(wf)
    assert run.status is RunStatus.COMPLETED
    assert "cannot be stored" in run.result or "NUL" in run.result
    assert sent == []
    assert app.describe(run.run_id)["effects"] == []


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("run_id", "x|y"),
        ("run_id", "a/b"),
        ("run_id", "a?b"),
        ("run_id", ""),
        ("run_id", "r" * 129),
        ("run_id", "a\x00b"),
        ("run_id", "\ud800"),
        ("run_id", "\x1b[2J"),
        ("tenant", "acme|x"),
        ("tenant", "acme x"),
        ("tenant", "é"),
    ],
)
def test_ids_that_could_forge_a_key_are_refused_at_start(
    make_app: MakeApp, database_url: str, field: str, value: str
) -> None:
    app = make_app()

    @app.workflow()
    async def wf() -> str:
        return "ok"

    options: dict[str, Any] = {field: value}
    with pytest.raises(durably.InvalidInput, match="not a valid id"):
        app.start(wf, **options)
    assert app.list_runs() == []


def test_each_run_keeps_the_key_scheme_it_started_with(
    make_app: MakeApp, database_url: str
) -> None:
    """New runs use the unambiguous scheme; a run recorded before it keeps its keys."""
    app = make_app()

    @app.tool(idempotent=True)
    def send(to: str) -> str:
        return durably.idempotency_key()

    @app.workflow()
    async def wf() -> str:
        return await send("a")

    new = app.run(wf, run_id="r-new", tenant="acme").result
    assert new == sha256_hex('["durably.idempotency_key",2,"acme","r-new",1,"send#1","send"]')

    app.start(wf, run_id="r-old", tenant="acme")
    execute_sql(database_url, "UPDATE durably_runs SET key_scheme = 1 WHERE run_id = 'r-old'")
    assert app.resume("r-old").result == sha256_hex("acme|r-old|1|send#1|send")


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda app, rid: app.send_event(rid, "go\x00"), id="event-name-nul"),
        pytest.param(lambda app, rid: app.send_event(rid, "\ud800"), id="event-name-surrogate"),
        pytest.param(lambda app, rid: app.send_event(rid, "go", {"a": "\x00"}), id="payload-nul"),
        pytest.param(lambda app, rid: app.send_event(rid, "go", deep(100)), id="payload-deep"),
        pytest.param(
            lambda app, rid: app.send_event(rid, "go", event_id="e\x1b]52;c;x\x07"),
            id="event-id-osc52",
        ),
        pytest.param(lambda app, rid: app.approve(rid, by="\ud800"), id="approver-surrogate"),
        pytest.param(lambda app, rid: app.approve(rid, by="a\x00"), id="approver-nul"),
        pytest.param(lambda app, rid: app.approve(rid, comment="\x1b[2J"), id="comment-escape"),
        pytest.param(lambda app, rid: app.get_run(rid + "\x00"), id="lookup-nul"),
        pytest.param(lambda app, rid: app.describe("\udc80"), id="lookup-surrogate"),
        pytest.param(lambda app, rid: app.cancel(rid + "\x00"), id="cancel-nul"),
        pytest.param(
            lambda app, rid: app.resolve_effect(rid, "s\x00", "not_executed"), id="resolve-nul"
        ),
    ],
)
def test_operator_input_that_cannot_be_stored_is_refused_and_changes_nothing(
    make_app: MakeApp, call: Callable[[durably.App, str], object]
) -> None:
    app = make_app()

    @app.workflow()
    async def wf() -> Any:
        await durably.approval("plan", {"n": 1})
        return await durably.wait_for_event("go")

    run = app.run(wf)
    assert run.status is RunStatus.WAITING_APPROVAL
    before = [(e.sequence, e.type) for e in app.events(run.run_id)]
    with pytest.raises(durably.DurablyError):
        call(app, run.run_id)
    assert [(e.sequence, e.type) for e in app.events(run.run_id)] == before
    assert app.describe(run.run_id)["approvals"][0]["status"] == "requested"


def test_a_failure_message_no_store_can_hold_is_still_recorded(make_app: MakeApp) -> None:
    """The error a tool raised, and a reconciliation's detail, are recorded escaped: the
    operation settles as failed / the run pauses, never stranded in executing."""
    app = make_app()

    @app.tool(idempotent=True)
    def charge() -> str:
        raise durably.ToolError(
            "declined \x00 \ud800", category=durably.FailureCategory.BUSINESS_REJECTED
        )

    def ask(op: durably.Operation) -> durably.Reconciliation:
        return durably.Reconciliation.unresolved("lookup said \x00\udc80")

    @app.tool(reconcile=ask)
    def coupon() -> str:
        raise TimeoutError("no answer \ud800")

    seen: list[str] = []

    @app.workflow()
    async def wf() -> str:
        try:
            await charge()
        except durably.StepFailed as exc:
            seen.append(exc.error_message)
        return await coupon()

    run = app.run(wf)
    assert run.status is RunStatus.PAUSED, run.error
    assert run.status_reason == PauseReason.EFFECT_STATE_UNKNOWN
    assert seen == ["declined \\x00 \\ud800"]
    effects = {e["tool"]: e for e in app.describe(run.run_id)["effects"]}
    assert effects["charge"]["status"] == "failed"
    assert effects["charge"]["error"]["message"] == "declined \\x00 \\ud800"
    assert effects["coupon"]["status"] == "unknown"
    assert run.error is not None
    assert run.error["message"] == "lookup said \\x00\\udc80"


def test_errors_never_show_the_database_url_or_its_password(
    make_app: MakeApp, database_url: str
) -> None:
    """Errors reach the API, the UI and logs: they name the run, never the credentials."""
    app = make_app()
    with pytest.raises(durably.RunNotFound) as missing:
        app.get_run("nope")
    assert database_url not in str(missing.value)
    unreachable = durably.App("postgresql://durably:hunter2-secret@127.0.0.1:1/db")
    try:
        with pytest.raises(durably.StoreUnavailable) as down:
            unreachable.get_run("nope")
    finally:
        unreachable.close()
    assert "hunter2" not in str(down.value)
    assert "durably:***@127.0.0.1:1" in str(down.value)


def test_a_reconciler_or_classifier_answering_nonsense_never_fails_the_run_for_good(
    make_app: MakeApp,
) -> None:
    """A reconcile answer that cannot be true (a negative duplicate count) and a classify=
    that names no category are treated as "unknown", not as a crash of the run."""
    app = make_app()

    def miscounted(op: durably.Operation) -> durably.Reconciliation:
        return durably.Reconciliation.succeeded({"id": "c1"}, duplicates=-1)

    @app.tool(reconcile=miscounted)
    async def issue() -> dict[str, str]:
        raise TimeoutError("read timed out after the request left")

    @app.tool(idempotent=True, classify=lambda exc: "timeout")  # not a FailureCategory
    async def notify() -> str:
        raise RuntimeError("failed after send")

    @app.workflow()
    async def wf(which: str) -> Any:
        return await (issue() if which == "issue" else notify())

    for which, status in (("issue", "unknown"), ("notify", "succeeded")):
        run = app.run(wf, which)
        assert run.status is not RunStatus.FAILED, (which, run.error)
        [effect] = app.describe(run.run_id)["effects"]
        assert effect["status"] in (status, "unknown", "reconciling"), (which, effect)


def test_an_external_id_no_store_can_hold_does_not_discard_the_result(
    make_app: MakeApp,
) -> None:
    app = make_app()

    @app.tool(idempotent=True, external_id=lambda r: r["ref"].replace("-", "\x00"))
    async def issue() -> dict[str, str]:
        return {"ref": "a-b"}

    @app.workflow()
    async def wf() -> dict[str, str]:
        return await issue()

    run = app.run(wf)
    assert run.status is RunStatus.COMPLETED, run.error
    assert run.result == {"ref": "a-b"}
    assert app.describe(run.run_id)["effects"][0]["external_operation_id"] == "a\\x00b"


@pytest.mark.parametrize(
    "charged", [{"cost": float("nan")}, {"cost": -5.0}, {"tokens": -1}, {"cost": float("inf")}]
)
def test_a_charge_that_is_not_an_amount_is_refused(
    make_app: MakeApp, charged: dict[str, float]
) -> None:
    """NaN compares false with every limit: accepted, it would switch the budget off."""
    app = make_app()
    calls: list[int] = []

    @app.tool(idempotent=True)
    async def spend(i: int) -> int:
        calls.append(i)
        return i

    @app.workflow(budget=durably.Budget(max_cost=1.0, max_tokens=10))
    async def wf() -> str:
        try:
            await durably.charge(**charged)  # type: ignore[arg-type]
        except durably.InvalidInput as exc:
            return str(exc)
        await spend(1)
        return "charged"

    run = app.run(wf)
    assert run.status is RunStatus.COMPLETED
    assert "finite amount, 0 or more" in run.result
    assert calls == []


def test_a_run_recorded_before_ids_were_checked_stays_reachable(make_app: MakeApp) -> None:
    """A 250-character run id (accepted before ids were validated) can still be looked up,
    resolved, resumed and cancelled."""
    app = make_app()

    @app.tool()
    async def send() -> str:
        raise TimeoutError("unknown outcome")

    @app.workflow()
    async def wf() -> str:
        return await send()

    rid = "legacy-" + "x" * 250
    run_input: dict[str, Any] = {"args": [], "kwargs": {}}

    async def record_legacy() -> None:
        store = await app.open()
        await store.create_run(
            NewRun(
                run_id=rid,
                tenant="default",
                workflow="wf",
                workflow_version="1",
                input=run_input,
                input_json=canonical_json(run_input),
                input_hash=sha256_hex(canonical_json({"workflow": "wf", "input": run_input})),
                key_scheme=1,
            )
        )

    app.engine.block(record_legacy())
    paused = app.resume(rid)
    assert paused.status is RunStatus.PAUSED
    app.resolve_effect(rid, "send#1", "failed")
    assert app.get_run(rid).status is RunStatus.QUEUED
    assert app.cancel(rid).status is RunStatus.CANCELLED


def test_listing_and_forking_arguments_out_of_range_are_refused_the_same_on_both_stores(
    make_app: MakeApp,
) -> None:
    """Before anything reaches a database (which answered -1 with every run on SQLite and a
    driver error on PostgreSQL, and 10**30 with an overflow)."""
    app = make_app()

    @app.workflow()
    async def wf() -> int:
        return 1

    run = app.run(wf)
    for bad in (-1, 0, 10**30, "10", True, 1.5):
        with pytest.raises(durably.InvalidInput, match="limit must be a whole number"):
            app.list_runs(limit=bad)  # type: ignore[arg-type]
    with pytest.raises(durably.InvalidInput, match="status must be one of"):
        app.list_runs(status="bogus")  # type: ignore[arg-type]
    assert [r.run_id for r in app.list_runs(status="completed")] == [run.run_id]  # type: ignore[arg-type]
    for bad in (-1, 10**30, "x", None):
        with pytest.raises(durably.InvalidInput, match="after must be a whole number"):
            app.events(run.run_id, after=bad)  # type: ignore[arg-type]
    assert app.events(run.run_id, after=2**63 - 1) == []
    with pytest.raises(durably.InvalidInput, match="replay must be one of"):
        app.fork(run.run_id, replay="sandbox")  # type: ignore[arg-type]
    forked = app.fork(run.run_id, replay="DISABLED", new_run_id="f-1")  # type: ignore[arg-type]
    assert forked.run_id == "f-1"


def test_settings_that_cannot_work_are_refused_when_given(tmp_path: Path) -> None:
    """A lease of no time (or negative), a payload limit below one byte, a worker of no
    slots, a subscription of empty batches: each refused where it is given, by name."""
    url = f"sqlite:///{tmp_path}/settings.db"
    for kwargs, name in (
        ({"lease_ttl": timedelta(0)}, "lease_ttl"),
        ({"lease_ttl": timedelta(seconds=-1)}, "lease_ttl"),
        ({"lease_ttl": 30}, "lease_ttl"),
        ({"reconcile_grace": timedelta(seconds=-1)}, "reconcile_grace"),
        ({"max_payload_bytes": 0}, "max_payload_bytes"),
        ({"max_payload_bytes": True}, "max_payload_bytes"),
    ):
        with pytest.raises(durably.ConfigurationError, match=name):
            durably.App(url, **kwargs)  # type: ignore[arg-type]
    app = durably.App(url, reconcile_grace=timedelta(0))
    try:
        for kwargs, name in (
            ({"concurrency": 0}, "concurrency"),
            ({"lease_ttl": timedelta(seconds=-5)}, "lease_ttl"),
            ({"recheck_paused": timedelta(seconds=-1)}, "recheck_paused"),
        ):
            with pytest.raises(durably.ConfigurationError, match=name):
                app.worker(**kwargs)  # type: ignore[arg-type]
        with pytest.raises(durably.ConfigurationError, match="poll_interval"):
            Worker(app, poll_interval=timedelta(0))
        with pytest.raises(durably.ConfigurationError, match="batch"):
            app.subscribe(print, consumer="c", batch=0)
    finally:
        app.close()
