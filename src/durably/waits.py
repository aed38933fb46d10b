"""Durable waits: timers and external events. The process may exit while a run waits.

A wait is a journal entry like a step: ``pending`` while the run waits (its output holds
what it waits for), then settled with what ended it — a fired timer, the event's payload,
or a timeout. The run waits as ``waiting_external`` with its ``available_at`` set to the
wake-up time, so whichever worker is alive then claims it; an event makes it due at once.
Replaying a settled wait returns its recorded outcome without waiting again.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

from durably import context
from durably.errors import ConfigurationError, WaitTimeout
from durably.keys import canonical_json, input_hash, sha256_hex
from durably.runtime import RunContext, Suspend
from durably.status import RunStatus, StepStatus
from durably.store.base import FAR_FUTURE, EventWrite, RunUpdate, StepWrite, Transition

SLEEP = "durably.sleep"
EVENT = "durably.event"


def _seconds(duration: float | timedelta | None, what: str) -> float | None:
    if duration is None:
        return None
    seconds = duration.total_seconds() if isinstance(duration, timedelta) else float(duration)
    if seconds < 0:
        raise ConfigurationError(f"{what} must not be negative, got {seconds} s")
    return seconds


class _Wait:
    """One wait call: its step id, its recorded state, and the commits that move it."""

    def __init__(self, ctx: RunContext, name: str, arguments: dict[str, Any]) -> None:
        self.ctx = ctx
        self.name = name
        self.step_id, self.position = ctx.allocate(name, None)
        self.input_hash = input_hash(name, "1", arguments)
        ctx.replayed(self.step_id, self.position, "step", name, self.input_hash)
        recorded = ctx.steps.get(self.step_id)
        self.outcome = (
            json.loads(recorded.output_json or "null")
            if recorded is not None and recorded.status is StepStatus.SUCCEEDED
            else None
        )
        self.pending: dict[str, Any] | None = (
            json.loads(recorded.output_json or "{}")
            if recorded is not None and recorded.status is StepStatus.PENDING
            else None
        )
        self.settled = recorded is not None and recorded.status is StepStatus.SUCCEEDED

    async def settle(self, outcome: Any, event: str, consume: str | None = None) -> None:
        output_json = canonical_json(outcome, what=f"the outcome of {self.step_id}")
        ctx = self.ctx
        await ctx.commit(
            lambda: Transition(
                events=[EventWrite(event, self.step_id, {"output_hash": sha256_hex(output_json)})],
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
            ),
            settle=(self.step_id, output_json),
        )

    async def suspend(
        self,
        pending: dict[str, Any],
        waiting_for: dict[str, Any],
        wake_at: float | None,
        *,
        wake_on_signal: str | None = None,
    ) -> None:
        """Record the wait, release the run, and unwind the workflow until it is due."""
        ctx = self.ctx
        await ctx.quiesce()
        waiting = {**waiting_for, "step_id": self.step_id}
        await ctx.commit(
            lambda: Transition(
                events=[EventWrite("wait_started", self.step_id, waiting)],
                step=StepWrite(
                    self.step_id,
                    self.position,
                    "step",
                    self.name,
                    StepStatus.PENDING,
                    self.input_hash,
                    output_json=canonical_json(pending),
                ),
                run=RunUpdate(
                    RunStatus.WAITING_EXTERNAL,
                    waiting_for=waiting,
                    available_at=FAR_FUTURE if wake_at is None else wake_at,
                ),
                checkpoint=ctx.journal.draft(
                    status=RunStatus.WAITING_EXTERNAL, current_step=self.step_id
                ),
                release=True,
                wake_on_signal=wake_on_signal,
            )
        )
        ctx.stopped = True
        raise Suspend


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
