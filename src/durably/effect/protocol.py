"""Prepare → claim → execute → record → reconcile (docs/architecture.md#the-effect-protocol).

Commits per effect, on the happy path:

* a tool that can be reconciled or is idempotent: **two** — intent and claim together
  (before the call), then the outcome. A crash right after the first commit leaves
  ``executing``, which recovery settles by asking the service or re-sending the same key.
* a tool with neither: **three** — intent, claim, outcome. Its claim is separate so that a
  crash before the call leaves ``intent_recorded``, which is safe to execute, instead of an
  ``unknown`` that would need a person although the call never left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from durably import context, faults
from durably.definitions import invoke
from durably.effect.approval import Approving
from durably.effect.reconciliation import Reconciling
from durably.effect.recording import Recording
from durably.effect.replay import Replaying
from durably.errors import (
    ApprovalExpired,
    ApprovalRejected,
    IdempotencyConflict,
    OutcomeUnknown,
    ToolError,
)
from durably.execution import Suspend
from durably.keys import json_value
from durably.ledger import Action, OperationView, decide
from durably.status import FailureCategory, OperationStatus, StepStatus
from durably.store.base import (
    OperationRecord,
)
from durably.values import storable_text

log = logging.getLogger("durably")


class Effect(Replaying, Reconciling, Approving, Recording):
    """One tool call inside a run, driven through the ledger until it settles."""

    async def settle(self) -> Any:
        self.ctx.started(self.step_id)
        try:
            return await self._settle()
        finally:
            self.ctx.begun(self.step_id)

    async def _settle(self) -> Any:
        if self.op is None:
            await self.ctx.after_recovered_calls()
            # Only a brand-new call stops for a cancel, a shutdown or the budget: an effect
            # already under way is settled first (reconciled if need be), never abandoned.
            await self.ctx.boundary(compensating=self.compensating)
            await self.ctx.check_budget()
        # Frameworks and task groups cancel a turn's other calls once one fails. Cut between
        # its intent and its record, this call would be left executing and its run running
        # with nothing recorded: it goes on to its recorded end in a task of its own, which
        # the run's release waits for (in_flight), while its caller gets the cancellation.
        landing = asyncio.ensure_future(self._landed())
        landing.add_done_callback(_retrieved)
        return await asyncio.shield(landing)

    async def _landed(self) -> Any:
        asking = self.op is None and self._needs_approval()
        async with self.ctx.in_flight(id(self), self.step_id, asking=asking):
            if self.ctx.closing:
                # Started while the run is being suspended for its parallel calls' approvals:
                # nothing is sent now, but this call's request joins theirs.
                with contextlib.suppress(ApprovalRejected):
                    await self._approval()
                raise Suspend  # decided already: the next execution goes on from there
            try:
                return await self._until_settled()
            except ApprovalRejected as rejected:
                if self.tool.on_rejected is None:
                    raise
                # The rejection is recorded (the approval), so a replay answers the same.
                return self.tool.on_rejected(rejected)

    async def _until_settled(self) -> Any:
        """Decide, act, and decide again until the call has a result (or stops the run)."""
        metrics = self.ctx.engine.metrics
        while True:
            op = self.op
            action = decide(
                None if op is None else _view(op),
                input_hash=self.input_hash,
                owner=self.ctx.lease.owner,
                epoch=self.ctx.lease.epoch,
                now=time.time(),
                max_attempts=self.tool.retry.max_attempts,
                can_reconcile=self.tool.can_reconcile,
            )
            if action is Action.PREPARE:
                if await self._replay_gate():
                    continue  # answered from the source run's ledger
                use = await self._approval()
                try:
                    await self._prepare(use)
                except ApprovalExpired:
                    await self._reapprove(use)
            elif action is Action.CONFLICT:
                metrics.idempotency_conflict.labels(tool=self.tool.name).inc()
                raise self.ctx.poison(
                    IdempotencyConflict(
                        f"tool {self.tool.name} at {self.step_id} was recorded with other "
                        "arguments under the same idempotency key; the recorded result is not "
                        "reused. Keep the call's arguments deterministic, or replan "
                        "(durably.replan()) to make it a new business operation",
                        run_id=self.ctx.run.run_id,
                        step_id=self.step_id,
                        idempotency_key=self.key,
                    )
                )
            elif action is Action.RETURN:
                # A recorded result replayed is no duplicate request: not an idempotency hit.
                assert op is not None
                if op.result_json is None and op.error:
                    await self._refuse_result(op.error, record=False)
                return json_value(op.result_json or "null")
            elif action is Action.CLAIM:
                assert op is not None
                self._stop_if_cancelled()  # only its intent stands: never sent, or not executed
                use = await self._approval() if op.attempt == 0 else None
                try:
                    await self._claim("effect_executing", use_approval=use)
                except ApprovalExpired:
                    await self._reapprove(use)
            elif action is Action.EXECUTE:
                await self._execute()
            elif action is Action.WAIT:
                assert op is not None
                await self._wait_for_holder(op)
            elif action is Action.RECONCILE:
                await self._reconcile()
            elif action is Action.RETRY:
                assert op is not None
                self._stop_if_cancelled()  # the last attempt is known not to have acted
                await asyncio.sleep(self._retry_delay(op))
                await self._claim("effect_retrying")
            elif action is Action.RAISE:
                assert op is not None
                raise self._failed(op)
            elif self._cancel_pending and not self._undone():
                # Only a person could settle this effect, and nothing the cancellation does
                # depends on it: the run stops here, leaving the effect unknown (counted in
                # the unknown gauges) for a person to record its outcome (resolve) later.
                await self._unknown_at_cancel()
                self.ctx.stop_for_cancel()
            else:
                # Cancelled with compensations, whether this effect is undone depends on its
                # outcome; and a compensation of unknown outcome: the run pauses for a person
                # to settle it (resolve), then ends cancelled when it goes on.
                await self._pause()

    async def _unknown_at_cancel(self) -> None:
        """Mark a failure after sending ``unknown``, as a pause would have: the cancelled run
        leaves it for a person to settle."""
        op = self.op
        assert op is not None
        if op.status is not OperationStatus.FAILED or op.failure_category in (
            FailureCategory.PERMISSION,  # refused before it ran
            None,
        ):
            return
        error = op.error or {}
        await self._apply(
            self._write(OperationStatus.UNKNOWN, error=error),
            self._step(StepStatus.UNKNOWN, error=error),
            [self._event("effect_unknown", category=op.failure_category, **error)],
        )

    def _undone(self) -> bool:
        """Whether the run's cancellation would undo this call, had it taken effect (one
        refused permission never ran)."""
        refused = self.op is not None and self.op.failure_category == FailureCategory.PERMISSION
        return self.ctx.cancel_requested == 2 and self.tool.compensate is not None and not refused

    async def _wait_for_holder(self, op: OperationRecord) -> None:
        """Another holder claimed this call: wait until its claim runs out, then look."""
        assert op.lease_until is not None
        await asyncio.sleep(max(op.lease_until - time.time(), 0.05))
        await self._refresh()
        if self.op is not None and self.op.status is OperationStatus.SUCCEEDED:
            # That holder's send landed: the call is answered from the ledger, not sent again.
            self.ctx.engine.metrics.idempotency_hit.labels(tool=self.tool.name).inc()

    async def _execute(self) -> None:
        if self.ctx.stopped:
            # A parallel branch paused or released the run since this call was claimed:
            # nothing is sent; whoever continues the run settles the claim.
            raise Suspend
        await self._call_and_record()

    async def _call_and_record(self) -> None:
        refusal = await self._authorize()
        if refusal is not None:
            await self._record_failure(refusal)
            return
        try:
            target = self._target()
            # Past the lease another worker may be reconciling this very claim: never send.
            self.ctx.hold_lease(id(self))
        except Suspend:
            await self._withdraw("the run stopped before it was sent")
            raise
        token = context._key.set(self.key)
        external_ids: list[str] = []  # durably.external_id() inside the tool appends
        ids_token = context._external_ids.set(external_ids)
        try:
            call = invoke(target, *self.args, **self.kwargs)
            if self.tool.timeout is not None:
                result = await asyncio.wait_for(call, self.tool.timeout.total_seconds())
            else:
                result = await call
        except Exception as exc:
            faults.crash_point("effect.after_call")
            if self.ctx.stopped:
                # The tool stopped at durably.check_lease() (or the run stopped meanwhile):
                # nothing can be recorded from here; the run's next holder settles the call.
                raise Suspend from exc
            if self.tool.is_control_flow(exc) and not self.resending:
                await self._record_not_sent(exc)
                raise
            if isinstance(exc, OutcomeUnknown) and exc.external_id is not None:
                external_ids.append(storable_text(str(exc.external_id)))
            await self._record_failure(exc, external_id=external_ids[-1] if external_ids else None)
            return
        except BaseException as exc:
            # A cancellation (or a group holding one) passing through the tool: it may have
            # acted already, so its outcome is recorded as unknown before the stop goes on,
            # or the call would stay executing for good.
            if not self.ctx.stopped:
                await self._record_failure(exc, unknown=True)
            raise
        finally:
            context._key.reset(token)
            context._external_ids.reset(ids_token)
        returned_at = time.monotonic()
        faults.crash_point("effect.after_call")
        payload: dict[str, Any] = {"sandbox": True} if self.sandboxed else {}
        await self._record_success(
            result, known_id=external_ids[-1] if external_ids else None, **payload
        )
        self.ctx.engine.metrics.checkpoint_lag.observe(time.monotonic() - returned_at)
        faults.crash_point("effect.after_record")

    async def _authorize(self) -> ToolError | None:
        """Ask ``authorize=`` right before the call: a refusal is a PERMISSION failure."""
        if self.tool.authorize is None:
            return None
        try:
            allowed = await invoke(self.tool.authorize, self._operation())
        except Exception as exc:
            return ToolError(f"authorize raised {exc!r}", category=FailureCategory.PERMISSION)
        if not allowed:
            return ToolError(
                f"{self.tool.name} at {self.step_id} is not authorised now",
                category=FailureCategory.PERMISSION,
            )
        return None


def _view(op: OperationRecord) -> OperationView:
    return OperationView(
        status=op.status,
        input_hash=op.input_hash,
        attempt=op.attempt,
        failure_category=FailureCategory(op.failure_category) if op.failure_category else None,
        confirmed_not_executed=bool((op.error or {}).get("confirmed_not_executed")),
        lease_owner=op.lease_owner,
        lease_epoch=op.lease_epoch,
        lease_until=op.lease_until,
    )


def _retrieved(task: asyncio.Future[Any]) -> None:
    """Its outcome is in the journal if nobody awaits it any more: no warning about it."""
    if not task.cancelled():
        task.exception()
