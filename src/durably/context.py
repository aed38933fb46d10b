"""The run the current code belongs to, carried in contextvars (and into tool threads)."""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING

from durably.errors import OutsideRunError

if TYPE_CHECKING:
    from durably.runtime import RunContext

_run: ContextVar[RunContext | None] = ContextVar("durably_run", default=None)
_key: ContextVar[str | None] = ContextVar("durably_idempotency_key", default=None)


@dataclass(frozen=True)
class RunInfo:
    """What workflow code may know about its run."""

    run_id: str
    tenant: str
    workflow: str
    workflow_version: str
    plan_version: int


def active() -> RunContext:
    ctx = _run.get()
    if ctx is None:
        raise OutsideRunError(
            "this must be called inside a workflow run (app.run / app.start + a worker); "
            "to call the plain function, use its .fn attribute"
        )
    return ctx


def current_run() -> RunInfo:
    """The run this code is executing in."""
    ctx = active()
    run = ctx.run
    return RunInfo(run.run_id, run.tenant, run.workflow, run.workflow_version, ctx.plan_version)


def idempotency_key() -> str:
    """The stable idempotency key of the tool call being executed; send it to the service.

    Example::

        @app.tool(idempotent=True)
        def send_email(to: str, body: str) -> dict:
            return mailer.send(to, body, idempotency_key=durably.idempotency_key())
    """
    key = _key.get()
    if key is None:
        raise OutsideRunError(
            "durably.idempotency_key() is only available while a tool (or its reconcile or "
            "compensate function) is executing"
        )
    return key
