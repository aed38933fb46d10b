"""Approvals of a tool call: bound to its run, step, input, key and plan; used once."""

from __future__ import annotations

import logging
import uuid

from durably.effect.core import EffectCore
from durably.errors import (
    ApprovalRejected,
)
from durably.execution import AwaitedApproval
from durably.keys import (
    plain_json,
)
from durably.status import StepStatus
from durably.store.base import (
    Approval,
    ApprovalRequest,
    ApprovalUse,
    EventWrite,
)

log = logging.getLogger("durably")


class Approving(EffectCore):
    """A ``requires_approval`` tool's call waits for an approval bound to exactly it."""

    async def _approval(self) -> ApprovalUse | None:
        """For ``requires_approval`` tools: the approval that authorises this very call.

        It must be bound to this run, step, input hash, idempotency key and plan version,
        be approved and unexpired; otherwise a new one is requested and the run waits.
        The store judges expiry again, by its clock, when the claim consumes it.
        """
        if not self._needs_approval():
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
        this = AwaitedApproval(
            self._step(StepStatus.WAITING_APPROVAL),
            EventWrite(
                "approval_requested" if request else "approval_waiting",
                self.step_id,
                {"approval_id": approval_id, "expires_at": expires_at},
            ),
            request,
            waiting,
        )
        await ctx.await_approval(this, exclude=id(self))
