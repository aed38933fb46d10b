"""Reconciliation of an effect whose outcome is unknown."""

from __future__ import annotations

import asyncio
import logging

from durably import context
from durably.definitions import invoke
from durably.effect.core import EffectCore
from durably.reconcile import Reconciliation
from durably.status import FailureCategory, OperationStatus, RunStatus, StepStatus
from durably.store.base import (
    RunUpdate,
)

log = logging.getLogger("durably")


RECONCILE_POLLS = 5
_ASKING = ("reconciling_since", "asks", "last_answer")
"""What the operation's error records of a reconciliation that asks again later."""


class Reconciling(EffectCore):
    """An unknown outcome is asked about (``reconcile=``) or re-sent with the same key
    (``idempotent=True``), never re-executed blindly."""

    async def _reconcile(self) -> None:
        op = self.op
        assert op is not None
        metrics = self.ctx.engine.metrics
        if op.status is not OperationStatus.RECONCILING:
            # A new reconciliation (also after an operator's resume): a new horizon.
            fresh = {k: v for k, v in (op.error or {}).items() if k not in _ASKING}
            await self._apply(
                self._write(OperationStatus.RECONCILING, error=fresh or None),
                self._step(StepStatus.RECONCILING),
                [self._event("effect_reconciling", previous=op.status.value)],
                run=RunUpdate(RunStatus.RECONCILING),
                checkpoint=False,
            )
            self.reconciling = True
        if self.tool.reconcile is None or self.sandboxed:
            # Idempotent tool: the service deduplicates by our key, so re-sending is safe.
            # A sandbox call is sent again to the sandbox: the real service, which never saw
            # it, is not asked about it.
            if op.attempt < self.tool.retry.max_attempts:
                await asyncio.sleep(self._retry_delay(op))
                await self._claim("effect_resent", resend=True)
            else:
                await self._pause()
            return
        answer = await self._ask()
        metrics.reconciliation.labels(result=answer.answer).inc()
        if answer.answer == "succeeded":
            # The effect had happened: this call is answered without a second one (the
            # duplicates it reports are counted from the ledger's effect_reconciled event).
            metrics.idempotency_hit.labels(tool=self.tool.name).inc()
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
            if self._cancel_pending:
                # Known not to have happened, and the run is cancelled: recorded as such,
                # never sent again.
                await self._apply(
                    self._write(OperationStatus.INTENT_RECORDED),
                    self._step(StepStatus.INTENT_RECORDED),
                    [self._event("effect_reconciled", answer="not_executed")],
                    run=self._back_to_running(),
                )
                self.ctx.stop_for_cancel()
            await asyncio.sleep(self.tool.retry.delay_s(op.attempt))
            await self._claim("effect_reconciled", answer="not_executed")
        elif answer.answer == "running":
            await self._ask_later(answer.detail)
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

    async def _ask_later(self, detail: str) -> None:
        """The service cannot tell yet: release the run and ask again on a durable timer,
        with backoff, until ``reconcile_for`` has passed since the first ask; only then
        does a person have to look."""
        op = self.op
        assert op is not None
        now = await self.ctx.store.now()
        state = op.error or {}
        since = float(state.get("reconciling_since", now))
        asks = int(state.get("asks", 0)) + 1
        left = self.tool.reconcile_for.total_seconds() - (now - since)
        if left <= 0:
            await self._pause(
                f"{self.tool.name} at {self.step_id}: the service could not say whether it "
                f"happened after {asks} asks over {now - since:.0f}s ({detail}); check it, "
                "then resolve the step"
            )
        retry_at = now + max(min(self.tool.retry.delay_s(asks), left), 0.05)
        error = {**state, "reconciling_since": since, "asks": asks, "last_answer": detail}
        waiting = {
            "kind": "reconcile",
            "step_id": self.step_id,
            "tool": self.tool.name,
            "retry_at": retry_at,
        }
        await self.ctx.release(
            lambda: self._apply(
                self._write(OperationStatus.RECONCILING, error=error),
                self._step(StepStatus.RECONCILING, error=error),
                [self._event("effect_reconcile_later", asks=asks, retry_at=retry_at)],
                run=RunUpdate(RunStatus.RECONCILING, waiting_for=waiting, available_at=retry_at),
                release=True,
            ),
            exclude=id(self),
        )

    async def _before_not_executed_is_trusted(self) -> float:
        """Seconds until a "not executed" answer can be trusted (0 if it can now).

        Whoever sent this call last (a previous holder of the run, or this execution before
        its call timed out) stopped sending at the end of its send window, recorded with the
        operation; a request that left just before can still reach the service later. That
        moment plus ``App(reconcile_grace=...)`` bounds it: only then does silence mean never.
        The window is kept through pauses and resumes, so an operator's ``resume`` waits too.
        """
        window_end = self._send_window_end()
        if window_end is None:
            return 0.0
        grace = self.ctx.engine.reconcile_grace.total_seconds()
        return window_end + grace - await self.ctx.store.now()

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
                    # The lookup failed, not the operation: ask again later.
                    return Reconciliation("running", detail=f"reconcile raised {exc!r}")
                if not isinstance(answer, Reconciliation):
                    return Reconciliation.unresolved(
                        f"reconcile returned {answer!r}, not a durably.Reconciliation"
                    )
                if answer.answer != "running":
                    return answer
                await asyncio.sleep(self.tool.retry.delay_s(poll + 1))
            return Reconciliation("running", detail="still running after repeated asks")
        finally:
            context._key.reset(token)
