"""Recording an effect: intent, claim, outcome (succeeded, failed, unknown), the pause."""

from __future__ import annotations

import logging
import socket
from typing import Any, NoReturn

from durably import faults
from durably.definitions import ToolDef
from durably.effect.core import EffectCore
from durably.errors import (
    DurablyError,
    NotJSONSerializable,
    OutcomeUnknown,
    PayloadTooLarge,
    ToolError,
)
from durably.execution import error_dict
from durably.keys import (
    canonical_json,
    sha256_hex,
)
from durably.status import FailureCategory, OperationStatus, PauseReason, RunStatus, StepStatus
from durably.store.base import (
    ApprovalUse,
    RunUpdate,
    Transition,
)
from durably.values import storable_text

log = logging.getLogger("durably")


def classify(tool: ToolDef, exc: BaseException) -> FailureCategory:
    """The failure category of an exception raised by a tool.

    Defaults: ``ToolError`` states its own; a timeout, ``OutcomeUnknown`` or a connection
    cut after sending is ``UNKNOWN_OUTCOME``; a refused connection or a failed DNS lookup
    (nothing left the machine) is ``TRANSIENT_BEFORE_SEND``. Anything else we cannot
    classify means we do not know whether the effect happened: ``UNKNOWN_OUTCOME``, so it
    is reconciled rather than guessed. ``@app.tool(classify=fn)`` is asked first.
    """
    if isinstance(exc, ToolError):
        return exc.category
    if tool.classify is not None:
        try:
            category = tool.classify(exc)
            if category is not None:
                return FailureCategory(category)
        except Exception as bug:
            # The outcome must still be recorded; an unclassifiable failure is unknown.
            log.warning("classify of %s raised %r; treating the outcome as unknown", tool.name, bug)
            return FailureCategory.UNKNOWN_OUTCOME
    if isinstance(exc, ConnectionRefusedError | socket.gaierror):
        return FailureCategory.TRANSIENT_BEFORE_SEND
    if isinstance(exc, TimeoutError | OutcomeUnknown | ConnectionError):
        return FailureCategory.UNKNOWN_OUTCOME
    return FailureCategory.UNKNOWN_OUTCOME


_SAYS_NOTHING_OF_AN_EARLIER_SEND = frozenset(
    {
        FailureCategory.TRANSIENT_BEFORE_SEND,
        FailureCategory.TRANSIENT_AFTER_SEND,
        FailureCategory.RATE_LIMIT,
        FailureCategory.PERMISSION,
    }
)
"""How a re-sent attempt may fail without the service having answered for its key: refused
before it left or by the service's door (throttled, not allowed), or lost on the way. Only
an answer for the key (a result, a rejection of the operation itself) settles an earlier
attempt of unknown outcome."""


class Recording(EffectCore):
    """Recording an effect's intent, claim and outcome, and pausing when only a person can
    settle it."""

    async def _prepare(self, use: ApprovalUse | None) -> None:
        faults.crash_point("effect.before_intent")
        together = self.tool.can_reconcile
        status = OperationStatus.EXECUTING if together else OperationStatus.INTENT_RECORDED
        attempt = 1 if together else 0
        await self._apply(
            self._write(status, attempt=attempt, hold_lease=together),
            self._step(StepStatus(status.value), attempts=attempt),
            [self._event("effect_intent_recorded", input_hash=self.input_hash)],
            # The approval is consumed by the transaction that claims the effect.
            use_approval=use if together else None,
        )
        faults.crash_point("effect.after_intent")
        if together:
            await self._unless_cancelled()

    async def _claim(
        self,
        event: str,
        *,
        use_approval: ApprovalUse | None = None,
        resend: bool = False,
        **payload: Any,
    ) -> None:
        """Claim the call for an attempt. ``resend``: an attempt of unknown outcome is
        under way already (sent again under its key to settle it), which a cancel does not
        stop."""
        assert self.op is not None
        attempt = self.op.attempt + 1
        await self._apply(
            self._write(OperationStatus.EXECUTING, attempt=attempt, hold_lease=True),
            self._step(StepStatus.EXECUTING, attempts=attempt),
            [self._event(event, attempt=attempt, **payload)],
            run=self._back_to_running(),
            checkpoint=False,
            use_approval=use_approval,
        )
        self.resending = resend
        await self._unless_cancelled()

    async def _unless_cancelled(self) -> None:
        """Just claimed: a cancel the claim's commit saw (landed during a retry's backoff, or
        after the run's last commit) stops a call with nothing under way before it is sent."""
        if self._cancel_pending and not self.resending:
            await self._withdraw("the run was cancelled")
            self.ctx.stop_for_cancel()

    async def _withdraw(self, reason: str) -> None:
        """A claimed call stops before it is sent: recorded back to ``intent_recorded``, so
        that nobody reconciles or sends what never left. Not a resend, whose earlier attempt
        may have acted, nor once the run can no longer be written here (its next holder
        settles the claim)."""
        if self.resending or self.ctx.stopped:
            return
        await self._apply(
            self._write(OperationStatus.INTENT_RECORDED, failure_category=None),
            self._step(StepStatus.INTENT_RECORDED),
            [self._event("effect_not_sent", reason=reason)],
            run=self._back_to_running(),
        )

    async def _record_success(
        self,
        result: Any,
        *,
        event: str = "effect_succeeded",
        known_id: str | None = None,
        **payload: Any,
    ) -> None:
        """``known_id``: the external id the tool reported while it ran, kept unless
        ``external_id=`` derives one from the result."""
        try:
            result_json = canonical_json(
                result,
                what=f"the result of tool {self.tool.name} at {self.step_id}",
                limit=self.ctx.engine.max_payload_bytes,
            )
        except (NotJSONSerializable, PayloadTooLarge) as exc:
            await self._refuse_result(error_dict(exc), record=True)
        external_id = None
        try:
            external_id = self.tool.external_id_of(result)
        except Exception as exc:
            log.warning("external_id of %s failed: %r", self.tool.name, exc)
        external_id = external_id or known_id
        try:
            await self._apply(
                self._write(
                    OperationStatus.SUCCEEDED,
                    result_json=result_json,
                    external_operation_id=external_id,
                    failure_category=None,
                ),
                self._step(StepStatus.SUCCEEDED, output_json=result_json, settle=True),
                [
                    self._event(
                        event,
                        output_hash=sha256_hex(result_json),
                        external_operation_id=external_id,
                        **payload,
                    )
                ],
                run=self._back_to_running(),
                settle=result_json,
            )
        except DurablyError:
            raise
        except Exception as exc:
            # The store refused a value the checks let through (a driver's own limit): the
            # effect still happened, and must be recorded as such, never fail the run.
            log.error(
                "run %s: the store refused the result of %s: %r",
                self.ctx.run.run_id,
                self.step_id,
                exc,
            )
            await self._refuse_result(
                {"type": type(exc).__name__, "message": f"the store refused it: {exc}"},
                record=True,
            )

    async def _refuse_result(self, error: dict[str, Any], *, record: bool) -> NoReturn:
        """The tool took effect but its result cannot be stored: record that it happened
        (``record``; so it is never repeated) and pause the run for an operator to give the
        service's real outcome. Raising in the workflow instead would let it fail the run
        for good, or let a framework swallow the error and go on without the result."""
        ctx = self.ctx
        reason = PauseReason.RESULT_NOT_STORABLE
        paused = {
            "type": "EffectPaused",
            "message": f"{self.tool.name} at {self.step_id} took effect, but its result cannot "
            f"be stored ({error.get('message')}). Make the tool return plain JSON, then record "
            "the service's real outcome: "
            f"`durably resolve {ctx.run.run_id} {self.step_id} --succeeded --result JSON`",
            "step_id": self.step_id,
        }
        waiting = {"step_id": self.step_id, "tool": self.tool.name, "idempotency_key": self.key}
        events = [self._event("run_paused", reason=reason.value)]
        run = RunUpdate(
            RunStatus.PAUSED, status_reason=reason.value, error=paused, waiting_for=waiting
        )

        async def pause() -> None:
            if record:
                await self._apply(
                    self._write(OperationStatus.SUCCEEDED, error=error, failure_category=None),
                    self._step(StepStatus.SUCCEEDED, error=error),
                    [
                        self._event("effect_succeeded", output_hash=None, result_refused=error),
                        *events,
                    ],
                    run=run,
                    release=True,
                )
            else:
                await ctx.commit(
                    lambda: Transition(
                        events=events,
                        run=run,
                        checkpoint=ctx.journal.draft(status=RunStatus.PAUSED, current_step=None),
                        release=True,
                    )
                )

        await ctx.release(pause, exclude=id(self))

    async def _record_failure(
        self, exc: BaseException, *, external_id: str | None = None, unknown: bool = False
    ) -> None:
        """Record how the call failed; ``unknown``: whatever ``exc`` is, nobody knows whether
        the call took effect."""
        category = FailureCategory.UNKNOWN_OUTCOME if unknown else classify(self.tool, exc)
        # Scrubbed whole, then cut: a secret straddling the cut would leave a clear prefix.
        error: dict[str, Any] = {
            "type": self._scrub(type(exc).__name__),
            "message": storable_text(self._scrub(str(exc))),
        }
        if self.resending and category in _SAYS_NOTHING_OF_AN_EARLIER_SEND:
            # Whether the attempt it re-sent took effect is as unknown as before.
            error["resend_failed"] = category.value
            category = FailureCategory.UNKNOWN_OUTCOME
        if isinstance(exc, ToolError) and exc.retry_after is not None:
            error["retry_after_s"] = exc.retry_after.total_seconds()
        if category is FailureCategory.UNKNOWN_OUTCOME:
            self.ctx.engine.metrics.unknown.labels(tool=self.tool.name).inc()
            status = OperationStatus.UNKNOWN
        else:
            status = OperationStatus.FAILED
        log.info(
            "tool %s at %s: %s (%s)",
            self.tool.name,
            self.step_id,
            category.value,
            error["message"],
        )
        changes: dict[str, Any] = {"external_operation_id": external_id}
        if status is OperationStatus.UNKNOWN:
            # This execution's own send ended when the call returned: a request still on its
            # way is given the reconcile grace from now.
            changes["send_deadline"] = await self.ctx.store.now()
        await self._apply(
            self._write(status, error=error, failure_category=category.value, **changes),
            self._step(StepStatus(status.value), error=error),
            [self._event(f"effect_{status.value}", category=category.value, **error)],
        )

    async def _record_not_sent(self, exc: BaseException) -> None:
        """The tool raised its framework's control flow (ask the model again, defer, interrupt):
        it chose not to act, so nothing was sent. The call goes back to ``intent_recorded``,
        settled by nobody: the framework handles the exception, and a replay that reaches the
        same call runs the tool again, which decides again."""
        await self._apply(
            self._write(OperationStatus.INTENT_RECORDED, failure_category=None),
            self._step(StepStatus.INTENT_RECORDED),
            [
                self._event(
                    "effect_not_sent",
                    type=self._scrub(type(exc).__name__),
                    message=storable_text(self._scrub(str(exc))),
                )
            ],
        )

    async def _pause(self, detail: str = "") -> None:
        op = self.op
        assert op is not None
        permission = op.failure_category == FailureCategory.PERMISSION
        reason = PauseReason.PERMISSION if permission else PauseReason.EFFECT_STATE_UNKNOWN
        status = op.status if permission else OperationStatus.UNKNOWN
        waiting = {"step_id": self.step_id, "tool": self.tool.name, "idempotency_key": self.key}
        error = {
            "type": "EffectPaused",
            "message": self._scrub(detail)
            or (
                "permission denied; re-authorise, then resolve or resume"
                if permission
                else f"the outcome of {self.tool.name} at {self.step_id} is unknown and cannot be "
                "settled automatically; check the external system, then run "
                f"`durably resolve {self.ctx.run.run_id} {self.step_id} --succeeded|--not-executed"
                "|--failed`"
            ),
        }
        # Parallel calls of this run record their outcomes before the run is released.
        await self.ctx.release(
            lambda: self._apply(
                self._write(status, error=op.error or error),
                self._step(StepStatus(status.value), error=op.error or error),
                [self._event("run_paused", reason=reason.value)],
                run=RunUpdate(
                    RunStatus.PAUSED, status_reason=reason.value, error=error, waiting_for=waiting
                ),
                release=True,
            ),
            exclude=id(self),
        )
