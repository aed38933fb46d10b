"""The tool operation protocol (DESIGN.md §4): prepare → claim → execute → record → reconcile.

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
import json
import logging
import socket
import time
import uuid
from dataclasses import asdict, replace
from typing import Any, NoReturn

from durably import context, faults
from durably.definitions import ToolDef, bind_arguments, invoke
from durably.errors import (
    ApprovalExpired,
    ApprovalRejected,
    DurablyError,
    IdempotencyConflict,
    NonDeterminismError,
    NotJSONSerializable,
    OutcomeUnknown,
    PayloadTooLarge,
    StepFailed,
    ToolError,
)
from durably.execution import Cancel, RunContext, Suspend, error_dict
from durably.keys import (
    canonical_json,
    idempotency_key,
    input_hash,
    plain_json,
    sha256_hex,
)
from durably.ledger import Action, OperationView, decide
from durably.reconcile import Operation, Reconciliation
from durably.redaction import redact, scrub
from durably.status import FailureCategory, OperationStatus, PauseReason, RunStatus, StepStatus
from durably.store.base import (
    Approval,
    ApprovalRequest,
    ApprovalUse,
    EventWrite,
    OperationRecord,
    OperationWrite,
    RunUpdate,
    StepWrite,
    Transition,
)

log = logging.getLogger("durably")

RECONCILE_POLLS = 5


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
        except Exception as bug:
            # The outcome must still be recorded; an unclassifiable failure is unknown.
            log.warning("classify of %s raised %r; treating the outcome as unknown", tool.name, bug)
            return FailureCategory.UNKNOWN_OUTCOME
        if category is not None:
            return FailureCategory(category)
    if isinstance(exc, ConnectionRefusedError | socket.gaierror):
        return FailureCategory.TRANSIENT_BEFORE_SEND
    if isinstance(exc, TimeoutError | OutcomeUnknown | ConnectionError):
        return FailureCategory.UNKNOWN_OUTCOME
    return FailureCategory.UNKNOWN_OUTCOME


class Effect:
    """One tool call inside a run, driven through the ledger until it settles."""

    def __init__(
        self,
        ctx: RunContext,
        tool: ToolDef,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        explicit_step_id: str | None,
    ) -> None:
        self.ctx = ctx
        self.tool = tool
        self.args = args
        self.kwargs = kwargs
        self.step_id, self.position = ctx.allocate(tool.name, explicit_step_id)
        ctx.count("tool_calls")
        self.arguments = bind_arguments(tool.signature, tool.name, args, kwargs)
        secret = ctx.engine.secret_key if tool.redact else None
        self.input_hash = input_hash(tool.name, tool.version, self.arguments, key=secret)
        run = ctx.run
        self.key = idempotency_key(
            run.tenant,
            run.run_id,
            ctx.plan_version,
            self.step_id,
            tool.operation_group or tool.name,
            scheme=run.key_scheme,
        )
        ctx.replayed(self.step_id, self.position, "tool", tool.name, self.input_hash)
        recorded = ctx.steps.get(self.step_id)
        if secret is not None and recorded is not None and recorded.input_hash != self.input_hash:
            plain = input_hash(tool.name, tool.version, self.arguments)
            if recorded.input_hash == plain:
                # Recorded before redacted input hashes were keyed: the same call.
                self.input_hash = plain
        if recorded is not None and recorded.idempotency_key not in (None, self.key):
            # Same call, another key: the plan version (replan) differs from the original
            # execution at this point. Executing under the new key would repeat the effect.
            raise ctx.poison(
                NonDeterminismError(
                    f"{tool.name} at {self.step_id} was recorded under another plan version "
                    "than this replay reaches it with (a replan() raced this call?); the run "
                    "pauses rather than execute it again",
                    run_id=run.run_id,
                    step_id=self.step_id,
                )
            )
        self.op: OperationRecord | None = ctx.operations.get(self.key)
        # input_hash() already proved the arguments are plain JSON.
        self.stored_arguments = redact(tool, secret, self.arguments)
        self.arguments_json = plain_json(self.stored_arguments)
        if len(self.arguments_json) > ctx.engine.max_payload_bytes:
            raise PayloadTooLarge(
                f"the arguments of {tool.name} are {len(self.arguments_json)} bytes of JSON, "
                f"over the limit of {ctx.engine.max_payload_bytes}; pass a reference instead",
                run_id=ctx.run.run_id,
                step_id=self.step_id,
            )
        self.reconciling = False

    # -- the loop -----------------------------------------------------------------------

    async def settle(self) -> Any:
        metrics = self.ctx.engine.metrics
        if self.op is None:
            # Only a brand-new call stops for a cancel, a shutdown or the budget: an effect
            # already under way is settled first (reconciled if need be), never abandoned.
            await self.ctx.boundary()
            await self.ctx.check_budget()
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
                metrics.idempotency_hit.labels(tool=self.tool.name).inc()
                assert op is not None
                if op.result_json is None and op.error:
                    await self._refuse_result(op.error, record=False)
                return json.loads(op.result_json or "null")
            elif action is Action.CLAIM:
                assert op is not None
                use = await self._approval() if op.attempt == 0 else None
                try:
                    await self._claim("effect_executing", use_approval=use)
                except ApprovalExpired:
                    await self._reapprove(use)
            elif action is Action.EXECUTE:
                await self._execute()
            elif action is Action.WAIT:
                assert op is not None
                assert op.lease_until is not None
                await asyncio.sleep(max(op.lease_until - time.time(), 0.05))
                await self._refresh()
            elif action is Action.RECONCILE:
                await self._reconcile()
            elif action is Action.RETRY:
                assert op is not None
                delay = self.tool.retry.delay_s(op.attempt)
                delay = max(delay, float((op.error or {}).get("retry_after_s", 0)))
                await asyncio.sleep(delay)
                await self._claim("effect_retrying")
            elif action is Action.RAISE:
                assert op is not None
                raise self._failed(op)
            elif self.ctx.cancel_requested:
                # Only a person could settle this effect, and the run is being cancelled:
                # it stops here, leaving the effect unknown (counted in the unknown gauges).
                raise Cancel
            else:
                await self._pause()

    # -- transitions --------------------------------------------------------------------

    def _write(self, status: OperationStatus, **changes: Any) -> OperationWrite:
        op = self.op
        fields: dict[str, Any] = dict(
            tenant=self.ctx.run.tenant,
            idempotency_key=self.key,
            run_id=self.ctx.run.run_id,
            step_id=self.step_id,
            plan_version=self.ctx.plan_version,
            tool=self.tool.name,
            tool_version=self.tool.version,
            input_hash=self.input_hash,
            arguments_json=self.arguments_json,
            status=status,
            result_json=None,
            error=None,
            failure_category=None if op is None else op.failure_category,
            attempt=0 if op is None else op.attempt,
            expect_row_version=None if op is None else op.row_version,
        )
        fields.update(changes)
        return OperationWrite(**fields)

    def _step(self, status: StepStatus, **changes: Any) -> StepWrite:
        changes.setdefault("attempts", 0 if self.op is None else self.op.attempt)
        return StepWrite(
            self.step_id,
            self.position,
            "tool",
            self.tool.name,
            status,
            self.input_hash,
            idempotency_key=self.key,
            **changes,
        )

    async def _apply(
        self,
        write: OperationWrite,
        step: StepWrite,
        events: list[EventWrite],
        *,
        run: RunUpdate | None = None,
        checkpoint: bool = True,
        pending: bool = False,
        release: bool = False,
        settle: str | None = None,
        use_approval: ApprovalUse | None = None,
    ) -> None:
        """Commit one ledger transition; ``settle``: the result JSON to add to the journal."""
        ctx = self.ctx
        pending_action = (
            {"tool": self.tool.name, "step_id": self.step_id, "idempotency_key": self.key}
            if pending
            else None
        )

        def transition() -> Transition:
            draft = (
                ctx.journal.draft(
                    status=(run.status if run else RunStatus.RUNNING).value,
                    current_step=self.step_id,
                    pending_action=pending_action,
                )
                if checkpoint
                else None
            )
            return Transition(
                events=events,
                step=step,
                operation=write,
                run=run,
                checkpoint=draft,
                release=release,
                use_approval=use_approval,
            )

        # Outcomes of a call (anything after EXECUTING) are known only here: outlast outages.
        outcome = self.op is not None and self.op.status is OperationStatus.EXECUTING
        committed = await ctx.commit(
            transition,
            settle=None if settle is None else (self.step_id, settle),
            effect=None if settle is None else self.key,
            durable=outcome,
        )
        now = time.time()
        previous = self.op
        held = write.hold_lease
        self.op = OperationRecord(
            tenant=write.tenant,
            idempotency_key=write.idempotency_key,
            run_id=write.run_id,
            step_id=write.step_id,
            plan_version=write.plan_version,
            tool=write.tool,
            tool_version=write.tool_version,
            input_hash=write.input_hash,
            arguments=self.stored_arguments,
            status=write.status,
            result_json=write.result_json,
            error=write.error,
            failure_category=write.failure_category,
            external_operation_id=write.external_operation_id
            or (previous.external_operation_id if previous else None),
            attempt=write.attempt,
            lease_owner=ctx.lease.owner if held else None,
            lease_until=committed.lease_until if held else None,
            lease_epoch=ctx.lease.epoch if held else None,
            row_version=committed.operation_row_version or 0,
            created_at=previous.created_at if previous else now,
            updated_at=now,
        )
        ctx.operations[self.key] = self.op

    def _event(self, type_: str, **payload: Any) -> EventWrite:
        return EventWrite(
            type_, self.step_id, {"tool": self.tool.name, "idempotency_key": self.key, **payload}
        )

    async def _prepare(self, use: ApprovalUse | None) -> None:
        faults.crash_point("effect.before_intent")
        together = self.tool.can_reconcile
        status = OperationStatus.EXECUTING if together else OperationStatus.INTENT_RECORDED
        attempt = 1 if together else 0
        await self._apply(
            self._write(status, attempt=attempt, hold_lease=together),
            self._step(StepStatus(status.value), attempts=attempt),
            [self._event("effect_intent_recorded", input_hash=self.input_hash)],
            pending=True,
            # The approval is consumed by the transaction that claims the effect.
            use_approval=use if together else None,
        )
        faults.crash_point("effect.after_intent")

    async def _claim(
        self, event: str, *, use_approval: ApprovalUse | None = None, **payload: Any
    ) -> None:
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

    # -- approval -----------------------------------------------------------------------

    async def _approval(self) -> ApprovalUse | None:
        """For ``requires_approval`` tools: the approval that authorises this very call.

        It must be bound to this run, step, input hash, idempotency key and plan version,
        be approved and unexpired; otherwise a new one is requested and the run waits.
        The store judges expiry again, by its clock, when the claim consumes it.
        """
        if not self.tool.requires_approval:
            return None
        ctx = self.ctx
        requests = ctx.approvals.get(self.step_id, [])
        latest = requests[-1] if requests else None
        bound = latest is not None and (
            latest.input_hash == self.input_hash
            and latest.idempotency_key == self.key
            and latest.plan_version == ctx.plan_version
        )
        now = await ctx.store.now()
        if latest is not None and bound:
            if latest.status == "rejected":
                raise ApprovalRejected(
                    f"{self.tool.name} at {self.step_id} was rejected by {latest.decided_by}"
                    + (f": {latest.comment}" if latest.comment else ""),
                    run_id=ctx.run.run_id,
                    step_id=self.step_id,
                    approval_id=latest.approval_id,
                    by=latest.decided_by,
                    comment=latest.comment,
                )
            if latest.expires_at > now and latest.status == "approved":
                return ApprovalUse(latest.approval_id, self.input_hash, self.key, ctx.plan_version)
            if latest.expires_at > now and latest.status == "requested":
                await self._wait_for_approval(latest.approval_id, latest.expires_at)
        await self._reapprove(latest)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _reapprove(self, previous: Approval | ApprovalUse | None) -> None:
        """Request a new approval (the previous one expired, was used, or binds other input)."""
        now = await self.ctx.store.now()
        if isinstance(previous, ApprovalUse) or (
            isinstance(previous, Approval)
            and previous.status == "approved"
            and previous.expires_at <= now
        ):
            self.ctx.engine.metrics.approval_expired.inc()
        await self._wait_for_approval(
            uuid.uuid4().hex,
            now + self.tool.approval_ttl.total_seconds(),
            new_request=True,
            replaces=None if previous is None else previous.approval_id,
        )

    async def _wait_for_approval(
        self,
        approval_id: str,
        expires_at: float,
        *,
        new_request: bool = False,
        replaces: str | None = None,
    ) -> None:
        """Suspend in ``waiting_approval`` (after recording a new request, if asked)."""
        ctx = self.ctx
        await ctx.quiesce(exclude=id(self))
        request = None
        if new_request:
            request = ApprovalRequest(
                approval_id=approval_id,
                step_id=self.step_id,
                kind="tool",
                name=self.tool.name,
                payload_json=plain_json(
                    {"tool": self.tool.name, "arguments": self.stored_arguments}
                ),
                input_hash=self.input_hash,
                idempotency_key=self.key,
                plan_version=ctx.plan_version,
                expires_at=expires_at,
                replaces=replaces,
            )
        waiting = {
            "kind": "approval",
            "approval_id": approval_id,
            "step_id": self.step_id,
            "tool": self.tool.name,
            "arguments": self.stored_arguments,
            "expires_at": expires_at,
        }
        await ctx.commit(
            lambda: Transition(
                events=[
                    EventWrite(
                        "approval_requested" if request else "approval_waiting",
                        self.step_id,
                        {"approval_id": approval_id, "expires_at": expires_at},
                    )
                ],
                step=self._step(StepStatus.WAITING_APPROVAL),
                run=RunUpdate(
                    RunStatus.WAITING_APPROVAL, waiting_for=waiting, available_at=expires_at
                ),
                checkpoint=ctx.journal.draft(
                    status=RunStatus.WAITING_APPROVAL, current_step=self.step_id
                ),
                release=True,
                request_approval=request,
            )
        )
        # The request and the suspension are one transaction: this is the same moment.
        faults.crash_point("approval.after_request")
        ctx.stopped = True
        raise Suspend

    async def _execute(self) -> None:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.ctx.inflight[id(self)] = done
        try:
            if self.ctx.stopped:
                # A parallel branch paused or released the run since this call was claimed:
                # nothing is sent; whoever continues the run settles the claim.
                raise Suspend
            await self._call_and_record()
        finally:
            del self.ctx.inflight[id(self)]
            done.set_result(None)

    async def _call_and_record(self) -> None:
        refusal = await self._authorize()
        if refusal is not None:
            await self._record_failure(refusal)
            return
        # Past the lease another worker may be reconciling this very claim: never send.
        self.ctx.hold_lease()
        token = context._key.set(self.key)
        try:
            call = invoke(self.tool.fn, *self.args, **self.kwargs)
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
            await self._record_failure(exc)
            return
        finally:
            context._key.reset(token)
        returned_at = time.monotonic()
        faults.crash_point("effect.after_call")
        await self._record_success(result)
        self.ctx.engine.metrics.checkpoint_lag.observe(time.monotonic() - returned_at)
        faults.crash_point("effect.after_record")

    async def _record_success(
        self, result: Any, *, event: str = "effect_succeeded", **payload: Any
    ) -> None:
        try:
            result_json = canonical_json(
                result,
                what=f"the result of tool {self.tool.name} at {self.step_id}",
                limit=self.ctx.engine.max_payload_bytes,
            )
        except (NotJSONSerializable, PayloadTooLarge) as exc:
            await self._refuse_result(error_dict(exc), record=True)
        external_id = None
        if self.tool.external_id is not None:
            try:
                external_id = str(self.tool.external_id(result))
            except Exception as exc:
                log.warning("external_id of %s failed: %r", self.tool.name, exc)
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
        await ctx.quiesce(exclude=id(self))
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
        if record:
            await self._apply(
                self._write(OperationStatus.SUCCEEDED, error=error, failure_category=None),
                self._step(StepStatus.SUCCEEDED, error=error),
                [self._event("effect_succeeded", output_hash=None, result_refused=error), *events],
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
        ctx.stopped = True
        raise Suspend

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

    def _scrub(self, text: str) -> str:
        """``text`` (a message a tool or a reconciler wrote) without the redacted values."""
        return scrub(self.tool, self.arguments, text)

    async def _record_failure(self, exc: BaseException) -> None:
        category = classify(self.tool, exc)
        error: dict[str, Any] = {k: self._scrub(v) for k, v in error_dict(exc).items()}
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
        await self._apply(
            self._write(status, error=error, failure_category=category.value),
            self._step(StepStatus(status.value), error=error),
            [self._event(f"effect_{status.value}", category=category.value, **error)],
        )

    async def _reconcile(self) -> None:
        op = self.op
        assert op is not None
        metrics = self.ctx.engine.metrics
        if op.status is not OperationStatus.RECONCILING:
            await self._apply(
                self._write(OperationStatus.RECONCILING, error=op.error),
                self._step(StepStatus.RECONCILING),
                [self._event("effect_reconciling", previous=op.status.value)],
                run=RunUpdate(RunStatus.RECONCILING),
                checkpoint=False,
            )
            self.reconciling = True
        if self.tool.reconcile is None:
            # Idempotent tool: the service deduplicates by our key, so re-sending is safe.
            if op.attempt < self.tool.retry.max_attempts:
                await asyncio.sleep(self.tool.retry.delay_s(op.attempt))
                await self._claim("effect_resent")
            else:
                await self._pause()
            return
        answer = await self._ask()
        metrics.reconciliation.labels(result=answer.answer).inc()
        if answer.answer == "succeeded":
            if answer.duplicates:
                metrics.duplicate_side_effect.labels(tool=self.tool.name).inc(answer.duplicates)
            await self._record_success(
                answer.result,
                event="effect_reconciled",
                answer="succeeded",
                duplicates=answer.duplicates,
            )
        elif answer.answer == "not_executed":
            early = await self._before_not_executed_is_trusted()
            if early > 0:
                log.info(
                    "run %s: %s at %s reported not executed; the previous holder's send may "
                    "still be on its way, asking again in %.1fs",
                    self.ctx.run.run_id,
                    self.tool.name,
                    self.step_id,
                    early,
                )
                await asyncio.sleep(early)
                return
            if op.attempt >= self.tool.retry.max_attempts:
                await self._pause(
                    f"{self.tool.name} at {self.step_id} was executed {op.attempt} times and "
                    "each time the service reported it never happened; check the service, then "
                    "resolve the step"
                )
            await asyncio.sleep(self.tool.retry.delay_s(op.attempt))
            await self._claim("effect_reconciled", answer="not_executed")
        elif answer.answer == "failed":
            category = answer.category or FailureCategory.PERMANENT_INPUT
            error = {
                "type": "Reconciled",
                "message": self._scrub(answer.detail),
                "confirmed_not_executed": True,
            }
            await self._apply(
                self._write(OperationStatus.FAILED, error=error, failure_category=category.value),
                self._step(StepStatus.FAILED, error=error),
                [self._event("effect_reconciled", answer="failed", category=category.value)],
                run=self._back_to_running(),
            )
        else:
            await self._pause(answer.detail)

    async def _before_not_executed_is_trusted(self) -> float:
        """Seconds until a "not executed" answer can be trusted (0 if it can now).

        A previous holder of the run checked its lease right before sending, but a request
        that left just before its lease ran out can reach the service later. Its deadline
        plus ``App(reconcile_grace=...)`` bounds that: only then does silence mean never.
        """
        previous = self.ctx.previous_lease_until
        if previous is None:
            return 0.0
        grace = self.ctx.engine.reconcile_grace.total_seconds()
        return previous + grace - await self.ctx.store.now()

    async def _ask(self) -> Reconciliation:
        assert self.op is not None
        assert self.tool.reconcile is not None
        operation = self._operation()
        token = context._key.set(self.key)
        try:
            for poll in range(RECONCILE_POLLS):
                try:
                    answer = await invoke(self.tool.reconcile, operation)
                except Exception as exc:
                    return Reconciliation.unresolved(f"reconcile raised {exc!r}")
                if not isinstance(answer, Reconciliation):
                    return Reconciliation.unresolved(
                        f"reconcile returned {answer!r}, not a durably.Reconciliation"
                    )
                if answer.answer != "running":
                    return answer
                await asyncio.sleep(self.tool.retry.delay_s(poll + 1))
            return Reconciliation.unresolved("still running after repeated reconciliation")
        finally:
            context._key.reset(token)

    def _operation(self, result: Any = None) -> Operation:
        op = self.op
        assert op is not None
        return Operation(
            run_id=op.run_id,
            step_id=op.step_id,
            tool=op.tool,
            arguments=self.arguments,
            idempotency_key=op.idempotency_key,
            external_operation_id=op.external_operation_id,
            attempt=op.attempt,
            result=result,
        )

    async def _pause(self, detail: str = "") -> None:
        op = self.op
        assert op is not None
        # Parallel calls of this run record their outcomes before the run is released.
        await self.ctx.quiesce(exclude=id(self))
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
        await self._apply(
            self._write(status, error=op.error or error),
            self._step(StepStatus(status.value), error=op.error or error),
            [self._event("run_paused", reason=reason.value)],
            run=RunUpdate(
                RunStatus.PAUSED, status_reason=reason.value, error=error, waiting_for=waiting
            ),
            release=True,
        )
        self.ctx.stopped = True
        raise Suspend

    def _back_to_running(self) -> RunUpdate | None:
        if not self.reconciling:
            return None
        self.reconciling = False
        return RunUpdate(RunStatus.RUNNING)

    async def _refresh(self) -> None:
        journal = await self.ctx.store.load_journal(self.ctx.run.run_id, checkpoints=0)
        if journal is not None:
            for op in journal.operations:
                if op.idempotency_key == self.key:
                    self.op = op

    # -- results ------------------------------------------------------------------------

    def _failed(self, op: OperationRecord) -> StepFailed:
        error = op.error or {}
        category = FailureCategory(op.failure_category) if op.failure_category else None
        return StepFailed(
            f"tool {self.tool.name} at {self.step_id} failed "
            f"({op.failure_category}): {error.get('type')}: {error.get('message')}",
            run_id=self.ctx.run.run_id,
            step_id=self.step_id,
            idempotency_key=self.key,
            category=category,
            error_type=str(error.get("type", "")),
            error_message=str(error.get("message", "")),
        )


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


async def compensate(ctx: RunContext, step_ids: tuple[str, ...]) -> list[str]:
    """Run the registered compensations of succeeded effects, newest first; once each."""
    # Only effects this execution has reached, so a replay compensates exactly what the
    # original execution did at this point; newest first.
    order = {step_id: i for i, step_id in enumerate(ctx.reached)}
    done_states = (OperationStatus.SUCCEEDED, OperationStatus.COMPENSATED)
    candidates = sorted(
        (o for o in ctx.operations.values() if o.status in done_states and o.step_id in order),
        key=lambda o: order[o.step_id],
        reverse=True,
    )
    done = []
    for op in candidates:
        if step_ids and op.step_id not in step_ids:
            continue
        tool = ctx.engine.registry.tool_def(op.tool, missing_ok=True)
        if tool is None or tool.compensate is None:
            continue
        undo = ctx.engine.registry.compensation_def(tool)
        operation = Operation(
            run_id=op.run_id,
            step_id=op.step_id,
            tool=op.tool,
            arguments=op.arguments,
            idempotency_key=op.idempotency_key,
            external_operation_id=op.external_operation_id,
            attempt=op.attempt,
            result=json.loads(op.result_json or "null"),
        )
        await Effect(ctx, undo, (asdict(operation),), {}, f"compensate:{op.step_id}").settle()
        current = ctx.operations[op.idempotency_key]
        if current.status is OperationStatus.SUCCEEDED:
            await ctx.commit(
                Transition(
                    events=[
                        EventWrite(
                            "effect_compensated",
                            op.step_id,
                            {"tool": op.tool, "idempotency_key": op.idempotency_key},
                        )
                    ],
                    operation=OperationWrite(
                        tenant=current.tenant,
                        idempotency_key=current.idempotency_key,
                        run_id=current.run_id,
                        step_id=current.step_id,
                        plan_version=current.plan_version,
                        tool=current.tool,
                        tool_version=current.tool_version,
                        input_hash=current.input_hash,
                        arguments_json=plain_json(current.arguments),
                        status=OperationStatus.COMPENSATED,
                        result_json=current.result_json,
                        external_operation_id=current.external_operation_id,
                        attempt=current.attempt,
                        expect_row_version=current.row_version,
                    ),
                )
            )
            ctx.operations[op.idempotency_key] = replace(
                current, status=OperationStatus.COMPENSATED, row_version=current.row_version + 1
            )
        done.append(op.step_id)
    return done
