"""Durable waits: timers and external events. The process may exit while a run waits.

A wait is a journal entry like a step: ``pending`` while the run waits (its output holds
what it waits for), then settled with what ended it — a fired timer, the event's payload,
or a timeout. The run waits as ``waiting_external`` with its ``available_at`` set to the
wake-up time, so whichever worker is alive then claims it; an event makes it due at once.
Replaying a settled wait returns its recorded outcome without waiting again.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

from durably import context
from durably.errors import (
    ApprovalExpired,
    ApprovalRejected,
    ConfigurationError,
    NonDeterminismError,
    WaitTimeout,
)
from durably.execution import AwaitedApproval, RunContext
from durably.keys import canonical_json, input_hash, json_value, sha256_hex
from durably.status import RunStatus, StepStatus
from durably.store.base import (
    FAR_FUTURE,
    Approval,
    ApprovalRequest,
    ApprovalUse,
    EventWrite,
    RunUpdate,
    StepWrite,
    Transition,
)
from durably.values import check_text

SLEEP = "durably.sleep"
EVENT = "durably.event"
APPROVAL = "durably.approval"
REPLAN = "durably.replan"


def _seconds(duration: float | timedelta | None, what: str) -> float | None:
    if duration is None:
        return None
    seconds = duration.total_seconds() if isinstance(duration, timedelta) else float(duration)
    if seconds < 0:
        raise ConfigurationError(f"{what} must not be negative, got {seconds} s")
    return seconds


class _Wait:
    """One wait call: its step id, its recorded state, and the commits that move it."""

    def __init__(
        self, ctx: RunContext, name: str, arguments: dict[str, Any], step_id: str | None = None
    ) -> None:
        self.ctx = ctx
        self.name = name
        self.step_id, self.position = ctx.allocate(name, step_id)
        self.input_hash = input_hash(name, "1", arguments)
        ctx.replayed(self.step_id, self.position, "step", name, self.input_hash)
        recorded = ctx.steps.get(self.step_id)
        self.outcome = (
            json_value(recorded.output_json or "null")
            if recorded is not None and recorded.status is StepStatus.SUCCEEDED
            else None
        )
        self.pending: dict[str, Any] | None = (
            json_value(recorded.output_json or "{}")
            if recorded is not None and recorded.status is StepStatus.PENDING
            else None
        )
        self.settled = recorded is not None and recorded.status is StepStatus.SUCCEEDED

    async def settle(
        self,
        outcome: Any,
        event: str,
        consume: str | None = None,
        use: ApprovalUse | None = None,
        plan_version: int | None = None,
    ) -> None:
        output_json = canonical_json(outcome, what=f"the outcome of {self.step_id}")
        output_hash = sha256_hex(output_json)
        ctx = self.ctx
        await ctx.commit(
            lambda: Transition(
                events=[EventWrite(event, self.step_id, {"output_hash": output_hash})],
                step=StepWrite(
                    self.step_id,
                    self.position,
                    "step",
                    self.name,
                    StepStatus.SUCCEEDED,
                    self.input_hash,
                    output_json=output_json,
                    settle=True,
                ),
                checkpoint=ctx.journal.draft(status=RunStatus.RUNNING, current_step=self.step_id),
                consume_signal=None if consume is None else (consume, self.step_id),
                use_approval=use,
                plan_version=plan_version,
            ),
            settle=(self.step_id, output_hash),
        )

    async def suspend(
        self,
        pending: dict[str, Any],
        waiting_for: dict[str, Any],
        wake_at: float | None,
        *,
        wake_on_signal: str | None = None,
        status: RunStatus = RunStatus.WAITING_EXTERNAL,
        request: ApprovalRequest | None = None,
    ) -> None:
        """Record the wait, release the run, and unwind the workflow until it is due."""
        ctx = self.ctx
        waiting = {**waiting_for, "step_id": self.step_id}
        step = StepWrite(
            self.step_id,
            self.position,
            "step",
            self.name,
            StepStatus.PENDING,
            self.input_hash,
            output_json=canonical_json(pending),
        )
        event = EventWrite("wait_started", self.step_id, waiting)
        if status is RunStatus.WAITING_APPROVAL:
            # With the approvals the run's parallel calls wait for, if any.
            await ctx.await_approval(AwaitedApproval(step, event, request, waiting))

        async def suspend() -> None:
            await ctx.commit(
                lambda: Transition(
                    events=[event],
                    step=step,
                    run=RunUpdate(
                        status,
                        waiting_for=waiting,
                        available_at=FAR_FUTURE if wake_at is None else wake_at,
                    ),
                    checkpoint=ctx.journal.draft(status=status, current_step=self.step_id),
                    release=True,
                    wake_on_signal=wake_on_signal,
                )
            )

        await ctx.release(suspend)


async def sleep(duration: float | timedelta) -> None:
    """Wait durably: the run is resumed by whichever worker is alive when it is due.

    Example: ``await durably.sleep(timedelta(days=1))`` — the process may exit meanwhile.
    """
    seconds = _seconds(duration, "sleep duration")
    assert seconds is not None
    ctx = context.active()
    wait = _Wait(ctx, SLEEP, {"seconds": seconds})
    if wait.settled:
        return
    await ctx.boundary()
    now = await ctx.store.now()
    until = float(wait.pending["until"]) if wait.pending else now + seconds
    if now >= until:
        await wait.settle(None, "timer_fired")
        return
    await wait.suspend({"until": until}, {"kind": "timer", "until": until}, until)


async def wait_for_event(name: str, *, timeout: float | timedelta | None = None) -> Any:
    """Wait for an event sent to this run (``app.send_event`` / ``durably event``).

    Returns the event's payload. Events are delivered once per event id and consumed in
    arrival order; one sent before the run reaches this call is kept for it. Raises
    :class:`WaitTimeout` if ``timeout`` passes first.
    """
    check_text(name, "event name")
    if not name or "#" in name or "|" in name:
        raise ConfigurationError(f"event name {name!r} is empty or contains '#' or '|'")
    seconds = _seconds(timeout, "timeout")
    ctx = context.active()
    wait = _Wait(ctx, f"{EVENT}:{name}", {"name": name, "timeout": seconds})
    if not wait.settled:
        await ctx.boundary()
        signal = next((s for s in ctx.signals if s.name == name), None)
        if signal is not None:
            ctx.signals.remove(signal)
            wait.outcome = {"event_id": signal.event_id, "payload": signal.payload}
            await wait.settle(wait.outcome, "event_consumed", consume=signal.event_id)
        else:
            now = await ctx.store.now()
            if wait.pending is not None:
                timeout_at = wait.pending.get("timeout_at")
            else:
                timeout_at = None if seconds is None else now + seconds
            if timeout_at is not None and now >= timeout_at:
                wait.outcome = {"timed_out": True}
                await wait.settle(wait.outcome, "wait_timed_out")
            else:
                await wait.suspend(
                    {"event": name, "timeout_at": timeout_at},
                    {"kind": "event", "event": name, "timeout_at": timeout_at},
                    timeout_at,
                    wake_on_signal=name,
                )
    assert isinstance(wait.outcome, dict)
    if wait.outcome.get("timed_out"):
        raise WaitTimeout(
            f"no event {name!r} arrived within {seconds} s",
            run_id=ctx.run.run_id,
            step_id=wait.step_id,
        )
    return wait.outcome["payload"]


async def approval(
    name: str, payload: Any = None, *, expires_in: float | timedelta = timedelta(hours=24)
) -> dict[str, Any]:
    """Wait for a person to approve ``payload`` (a plan, a draft, an amount).

    The approval is bound to this run, this call and the payload's hash, and used once.
    Returns ``{"approved": True, "by", "comment", "approval_id", "payload_hash"}``; a
    rejection raises :class:`ApprovalRejected`; one that expires undecided is requested
    again.

    Example::

        decision = await durably.approval("send_campaign", {"audience": 12000})
    """
    return await approval_at(None, name, payload, expires_in=expires_in)


def requested(step_id: str) -> tuple[bool, Any]:
    """Whether this run requested an approval at ``step_id`` (:func:`approval_at`), and the
    payload of its latest request."""
    asked = context.active().approvals.get(step_id)
    return (True, asked[-1].payload) if asked else (False, None)


async def approval_at(
    step_id: str | None,
    name: str,
    payload: Any = None,
    *,
    expires_in: float | timedelta = timedelta(hours=24),
) -> dict[str, Any]:
    """:func:`approval` at an explicit step id (an integration's, derived from a tool call
    id): matched by that id alone, so calls made concurrently may ask in any order."""
    check_text(name, "approval name")
    if not name or "#" in name or "|" in name:
        raise ConfigurationError(f"approval name {name!r} is empty or contains '#' or '|'")
    ttl = _seconds(expires_in, "expires_in")
    assert ttl is not None
    payload_json = canonical_json(payload, what=f"the payload of approval {name!r}")
    payload_hash = sha256_hex(payload_json)
    ctx = context.active()
    # The payload is bound by the approval, not the call: a payload that changed before the
    # decision asks again; one that changed after it is non-determinism.
    wait = _Wait(ctx, f"{APPROVAL}:{name}", {"name": name}, step_id)
    decided = wait.outcome if isinstance(wait.outcome, dict) else {}
    if wait.settled and decided.get("payload_hash") != payload_hash:
        raise ctx.poison(
            NonDeterminismError(
                f"approval {name!r} at {wait.step_id} was decided for another payload "
                "than the workflow now passes; workflow code must be deterministic",
                run_id=ctx.run.run_id,
                step_id=wait.step_id,
            )
        )
    if not wait.settled:
        await ctx.boundary()
        requests = ctx.approvals.get(wait.step_id, [])
        latest = requests[-1] if requests else None
        now = await ctx.store.now()
        if latest is not None and (
            latest.input_hash != payload_hash or latest.plan_version != ctx.plan_version
        ):
            latest_bound = None
        else:
            latest_bound = latest
        if latest_bound is not None and latest_bound.status == "rejected":
            wait.outcome = _decision(latest_bound, approved=False)
            await wait.settle(wait.outcome, "approval_rejected")
        elif (
            latest_bound is not None
            and latest_bound.status == "approved"
            and latest_bound.expires_at > now
        ):
            wait.outcome = _decision(latest_bound, approved=True)
            use = ApprovalUse(latest_bound.approval_id, payload_hash, None, ctx.plan_version)
            try:
                await wait.settle(wait.outcome, "approval_granted", use=use)
            except ApprovalExpired:
                # It expired between the check and the store's judgement: ask again.
                now = await ctx.store.now()
                await _request(
                    wait, name, payload, payload_json, payload_hash, latest, now + ttl, now
                )
        else:
            await _request(wait, name, payload, payload_json, payload_hash, latest, now + ttl, now)
    assert isinstance(wait.outcome, dict)
    if not wait.outcome["approved"]:
        raise ApprovalRejected(
            f"approval {name!r} was rejected by {wait.outcome['by']}",
            run_id=ctx.run.run_id,
            step_id=wait.step_id,
            approval_id=str(wait.outcome["approval_id"]),
            by=wait.outcome["by"],
            comment=wait.outcome["comment"],
        )
    return wait.outcome


async def _request(
    wait: _Wait,
    name: str,
    payload: Any,
    payload_json: str,
    payload_hash: str,
    latest: Approval | None,
    expires_at: float,
    now: float,
) -> None:
    """Wait for the pending request, or record a new one (none yet, expired, or unbound)."""
    pending = (
        latest is not None
        and latest.status == "requested"
        and latest.input_hash == payload_hash
        and latest.expires_at > now
    )
    request = None
    if pending and latest is not None:
        approval_id, expires_at = latest.approval_id, latest.expires_at
    else:
        approval_id = uuid.uuid4().hex
        request = ApprovalRequest(
            approval_id=approval_id,
            step_id=wait.step_id,
            kind="plan",
            name=name,
            payload_json=payload_json,
            input_hash=payload_hash,
            idempotency_key=None,
            plan_version=wait.ctx.plan_version,
            expires_at=expires_at,
            replaces=None if latest is None else latest.approval_id,
        )
    waiting = {
        "kind": "approval",
        "approval_id": approval_id,
        "name": name,
        "payload": payload,
        "expires_at": expires_at,
    }
    await wait.suspend(
        {"approval_id": approval_id},
        waiting,
        expires_at,
        status=RunStatus.WAITING_APPROVAL,
        request=request,
    )


def _decision(approval: Approval, *, approved: bool) -> dict[str, Any]:
    return {
        "approved": approved,
        "by": approval.decided_by,
        "comment": approval.comment,
        "approval_id": approval.approval_id,
        "payload_hash": approval.input_hash,
    }


async def replan() -> int:
    """Start a new plan: calls from here on get new idempotency keys and approvals given
    under the old plan no longer authorise anything. Returns the new plan version.

    Use it when the agent decides on different business actions (a new recipient, a new
    amount); a plain retry of the same action must keep its key, so never replan for that.
    """
    ctx = context.active()
    wait = _Wait(ctx, REPLAN, {})
    if not wait.settled:
        await ctx.boundary()
        wait.outcome = {"plan_version": ctx.plan_version + 1}
        await wait.settle(wait.outcome, "plan_revised", plan_version=ctx.plan_version + 1)
    assert isinstance(wait.outcome, dict)
    ctx.plan_version = int(wait.outcome["plan_version"])
    return ctx.plan_version
