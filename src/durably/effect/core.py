"""The core of one effect: its identity, its ledger row and the transitions that write it."""

from __future__ import annotations

import logging
import time
from typing import Any

from durably.definitions import ToolDef, bind_arguments
from durably.errors import (
    NonDeterminismError,
    PayloadTooLarge,
    StepFailed,
)
from durably.execution import RunContext
from durably.keys import (
    idempotency_key,
    input_hash,
    plain_json,
    sha256_hex,
)
from durably.reconcile import Operation
from durably.redaction import redact, scrub
from durably.status import FailureCategory, OperationStatus, ReplayMode, RunStatus, StepStatus
from durably.store.base import (
    ApprovalUse,
    EventWrite,
    OperationRecord,
    OperationWrite,
    RunUpdate,
    StepWrite,
    Transition,
)

log = logging.getLogger("durably")


_SETTLED = (OperationStatus.SUCCEEDED, OperationStatus.FAILED, OperationStatus.COMPENSATED)


class EffectCore:
    """One tool call inside a run: its identity (step id, input hash, idempotency key), its
    ledger row, and the transitions that write it. The phases of the protocol are mixins
    over this core (recording, approval, reconciliation); ``Effect`` assembles them."""

    def __init__(
        self,
        ctx: RunContext,
        tool: ToolDef,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        explicit_step_id: str | None,
        *,
        key: str | None = None,
    ) -> None:
        """``key``: the call's idempotency key, if it is not derived from where the run makes
        the call (an undo's, shared by every run holding a record of the effect it undoes)."""
        self.ctx = ctx
        self.tool = tool
        self.args = args
        self.kwargs = kwargs
        self.step_id, self.position = ctx.allocate(tool.name, explicit_step_id)
        ctx.count("tool_calls")
        self.arguments = bind_arguments(tool, args, kwargs)
        secret = ctx.engine.secret_key if tool.redact else None
        self.input_hash = input_hash(tool.name, tool.version, self.arguments, key=secret)
        run = ctx.run
        self.key = key or idempotency_key(
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
        self.tool_version = tool.version
        op = self.op
        # Recorded under another version of the tool (deployed since): still the same call if
        # its arguments hash the same under that version. It keeps its key, version and
        # result; only calls made from now on use the new version.
        if (
            op is not None
            and op.tool_version != tool.version
            and op.input_hash != self.input_hash
            and input_hash(tool.name, op.tool_version, self.arguments, key=secret) == op.input_hash
        ):
            self.input_hash = op.input_hash
            self.tool_version = op.tool_version
        if ctx.what_if() and recorded is not None and recorded.input_hash != self.input_hash:
            # Not an idempotency conflict (no alert): the what-if code asks another call.
            raise ctx.diverged(
                "other_arguments",
                self.step_id,
                tool.name,
                f"tool {tool.name} at {self.step_id} is called with other arguments than "
                f"run {run.input['fork']['of']} recorded; nothing was sent",
            )
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
        self.compensating = False
        """A compensation of a cancelled run: it goes on while the run is cancelling."""
        self.resending = False
        """The claimed attempt re-sends one of unknown outcome under its key: until the
        service answers it, whether the call took effect stays unknown."""

    def _write(self, status: OperationStatus, **changes: Any) -> OperationWrite:
        op = self.op
        fields: dict[str, Any] = dict(
            tenant=self.ctx.run.tenant,
            idempotency_key=self.key,
            run_id=self.ctx.run.run_id,
            step_id=self.step_id,
            plan_version=self.ctx.plan_version,
            tool=self.tool.name,
            tool_version=self.tool_version,
            input_hash=self.input_hash,
            arguments_json=self.arguments_json,
            status=status,
            result_json=None,
            error=None,
            failure_category=None if op is None else op.failure_category,
            attempt=0 if op is None else op.attempt,
            expect_row_version=None if op is None else op.row_version,
            send_deadline=self._send_window_end(),
        )
        fields.update(changes)
        return OperationWrite(**fields)

    def _send_window_end(self) -> float | None:
        """The latest moment (store clock) a send of this call may have started, as far as
        this execution knows: the deadline recorded with the operation, or the lease of the
        holder this execution took the run over from, whichever is later."""
        known = [
            t
            for t in (
                None if self.op is None else self.op.lease_until,
                self.ctx.previous_lease_until,
            )
            if t is not None
        ]
        return max(known) if known else None

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
        release: bool = False,
        settle: str | None = None,
        use_approval: ApprovalUse | None = None,
    ) -> None:
        """Commit one ledger transition; ``settle``: the result JSON to add to the journal.

        Its checkpoint names the call as the run's pending action while the call is not
        settled (recorded, executing, unknown, being reconciled): what recovery must do first.
        """
        ctx = self.ctx
        if run is not None and run.status is RunStatus.RUNNING:
            # Out of ``reconciling``: every call it was for is settled.
            events = [*events, EventWrite("run_reconciled", None, {})]
        pending_action = (
            None
            if write.status in _SETTLED
            else {
                "tool": self.tool.name,
                "step_id": self.step_id,
                "idempotency_key": self.key,
                "status": write.status.value,
            }
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
            settle=None if settle is None else (self.step_id, sha256_hex(settle)),
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
            lease_until=committed.lease_until if held else write.send_deadline,
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

    def _retry_delay(self, op: OperationRecord) -> float:
        """Seconds before the next attempt after ``op``'s last: the retry policy's backoff,
        or longer if the service said when to come back (``retry_after``)."""
        delay = self.tool.retry.delay_s(op.attempt)
        return max(delay, float((op.error or {}).get("retry_after_s", 0)))

    def _replay_mode(self) -> ReplayMode | None:
        """The replay mode of the fork this call is in (None: not a fork)."""
        fork = self.ctx.run.input.get("fork")
        return ReplayMode(fork["replay"]) if isinstance(fork, dict) else None

    def _needs_approval(self) -> bool:
        return self.tool.requires_approval or (
            self._replay_mode() is ReplayMode.LIVE_WITH_NEW_APPROVAL
        )

    def _scrub(self, text: str) -> str:
        """``text`` (a message a tool or a reconciler wrote) without the redacted values."""
        return scrub(self.tool, self.arguments, text)

    def _back_to_running(self) -> RunUpdate | None:
        """``running`` again once this call is settled (or re-sent), unless a call the run
        found unsettled when it was recovered still is."""
        unsettled = self.ctx.unsettled
        was_unsettled = self.key in unsettled
        unsettled.discard(self.key)
        if not (self.reconciling or was_unsettled) or unsettled:
            return None
        self.reconciling = False
        return RunUpdate(RunStatus.RUNNING)

    async def _refresh(self) -> None:
        journal = await self.ctx.store.load_journal(self.ctx.run.run_id, checkpoints=0)
        if journal is not None:
            for op in journal.operations:
                if op.idempotency_key == self.key:
                    self.op = op

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

    # -- implemented by the phase mixins; declared here so that each phase can use the others

    async def _claim(
        self,
        event: str,
        *,
        use_approval: ApprovalUse | None = None,
        resend: bool = False,
        **payload: Any,
    ) -> None:
        raise NotImplementedError

    async def _record_success(
        self, result: Any, *, event: str = "effect_succeeded", **payload: Any
    ) -> None:
        raise NotImplementedError

    async def _record_failure(self, exc: BaseException) -> None:
        raise NotImplementedError

    async def _pause(self, detail: str = "") -> None:
        raise NotImplementedError

    @property
    def sandboxed(self) -> bool:
        raise NotImplementedError

    @property
    def _cancel_pending(self) -> bool:
        """The run is cancelled, and this call is not one of its compensations."""
        return bool(self.ctx.cancel_requested) and not self.compensating

    def _stop_if_cancelled(self) -> None:
        """For a call with nothing under way (never sent, or known not to have taken
        effect): a cancel stops it here, as it stops a new call."""
        if self._cancel_pending:
            self.ctx.stop_for_cancel()
