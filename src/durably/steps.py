"""One call of a step inside a run: replayed from the journal, or run (with retries) and
recorded. The call's step id is allocated when it is made, so the order calls are created
in, also for calls gathered in parallel, is the deterministic order."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, NoReturn

from durably import faults, model_calls
from durably.definitions import StepDef, bind_arguments, invoke
from durably.errors import StepFailed
from durably.execution import RunContext, error_dict
from durably.keys import canonical_json, input_hash, json_value, sha256_hex
from durably.status import StepStatus
from durably.store.base import EventWrite, StepWrite, Transition

log = logging.getLogger("durably")


def call_step(
    ctx: RunContext,
    sdef: StepDef,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    explicit: str | None,
) -> Coroutine[Any, Any, Any]:
    """Allocate the call's step id now (creation order is the deterministic order, also
    for calls gathered in parallel) and return the coroutine that runs or replays it."""
    step_id, position = ctx.allocate(sdef.name, explicit)
    ctx.count("steps")
    if sdef.canonical is not None:
        arguments = {"canonical": sdef.canonical(*args, **kwargs)}
    else:
        arguments = bind_arguments(sdef, args, kwargs)
    ih = input_hash(sdef.name, sdef.version, arguments)
    ctx.replayed(step_id, position, "step", sdef.name, ih)
    call = StepCall(ctx, sdef, step_id, position, ih, arguments)
    return ctx.created(step_id, sdef.name, call.settle(args, kwargs))


@dataclass(slots=True, eq=False)
class StepCall:
    """One call of a step: replayed from the journal, or run (with retries) and recorded."""

    ctx: RunContext
    sdef: StepDef
    step_id: str
    position: int
    input_hash: str
    arguments: dict[str, Any]
    """What the input hash covers: a model call's record keeps it as its input."""

    async def settle(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.ctx.started(self.step_id)
        try:
            return await self._settle(args, kwargs)
        finally:
            self.ctx.begun(self.step_id)

    async def _settle(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        ctx = self.ctx
        recorded = ctx.steps.get(self.step_id)
        if recorded is not None and recorded.status is StepStatus.SUCCEEDED:
            value = json_value(recorded.output_json or "null")
            await self._charge(recorded.model_call)
            return value
        if recorded is not None and recorded.status is StepStatus.FAILED:
            raise _step_failed(ctx, self.step_id, recorded.error or {})
        await ctx.boundary()
        await ctx.check_budget()
        attempt = 0
        while True:
            attempt += 1
            # A step another worker may have recorded already is not run again (model calls
            # cost money), nor one whose result this process could no longer record.
            ctx.hold_lease()
            # In flight from its start to its record: a parallel branch that releases the run
            # waits for it, rather than let a finished step (a paid model call) run again.
            async with ctx.in_flight(id(self), self.step_id):
                started = time.monotonic()
                try:
                    value = await invoke(self.sdef.fn, *args, **kwargs)
                except Exception as exc:
                    if attempt >= self.sdef.retry.max_attempts:
                        await self._record_failure(attempt, exc)
                    log.info("step %s attempt %d failed (%r); retrying", self.step_id, attempt, exc)
                else:
                    model_call = await self._record(attempt, value, time.monotonic() - started)
                    break
            # Between attempts the step is starting again: the run's end waits for it.
            ctx.started(self.step_id)
            await asyncio.sleep(self.sdef.retry.delay_s(attempt))
        await self._charge(model_call)
        return value

    def _write(self, status: StepStatus, attempt: int, **changes: Any) -> StepWrite:
        return StepWrite(
            self.step_id,
            self.position,
            "step",
            self.sdef.name,
            status,
            self.input_hash,
            attempts=attempt,
            new_row=self.step_id not in self.ctx.steps,
            **changes,
        )

    async def _record(self, attempt: int, value: Any, latency_s: float) -> dict[str, Any] | None:
        """Record the result (a model call's with its record, which this returns)."""
        ctx = self.ctx
        limit = ctx.engine.max_payload_bytes
        output_json = canonical_json(value, what=f"the result of step {self.step_id}", limit=limit)
        output_hash = sha256_hex(output_json)
        payload = {"name": self.sdef.name, "output_hash": output_hash}
        model_call = None
        if self.sdef.model is not None:
            model_call = model_calls.record(
                self.sdef.model,
                run_id=ctx.run.run_id,
                step_id=self.step_id,
                arguments=self.arguments,
                answer=value,  # JSON already: canonical_json accepted it
                latency_s=latency_s,
                limit=limit,
            )
            payload["model_call_id"] = model_call["model_call_id"]
        await ctx.commit(
            lambda: Transition(
                events=[EventWrite("step_succeeded", self.step_id, payload)],
                step=self._write(
                    StepStatus.SUCCEEDED,
                    attempt,
                    output_json=output_json,
                    settle=True,
                    model_call=model_call,
                ),
                checkpoint=ctx.journal.periodic(current_step=self.step_id),
            ),
            settle=(self.step_id, output_hash),
        )
        # Result, event and any checkpoint are one transaction: checkpoint.after_write (fired
        # by the commit when it held one) and this window are the same moment.
        faults.crash_point("step.after_record")
        return model_call

    async def _charge(self, model_call: dict[str, Any] | None) -> None:
        """Charge a model call's recorded usage to the run's budget (first execution and
        replay alike), pausing the run here if that puts it over."""
        if model_call is None:
            return
        tokens, cost = model_calls.charges(model_call)
        self.ctx.count("tokens", tokens)
        self.ctx.count("cost", cost)
        await self.ctx.check_budget()

    async def _record_failure(self, attempt: int, exc: Exception) -> NoReturn:
        error = error_dict(exc)
        await self.ctx.commit(
            Transition(
                events=[EventWrite("step_failed", self.step_id, {"name": self.sdef.name, **error})],
                step=self._write(StepStatus.FAILED, attempt, error=error),
            )
        )
        raise _step_failed(self.ctx, self.step_id, error) from exc


def _step_failed(ctx: RunContext, step_id: str, error: dict[str, Any]) -> StepFailed:
    return StepFailed(
        f"step {step_id} failed: {error.get('type')}: {error.get('message')}",
        run_id=ctx.run.run_id,
        step_id=step_id,
        error_type=str(error.get("type", "")),
        error_message=str(error.get("message", "")),
    )
