"""The run the current code belongs to, carried in contextvars (and into tool threads)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar, cast

from durably.errors import OutsideRunError
from durably.values import check_text

if TYPE_CHECKING:
    from durably.execution import RunContext

P = ParamSpec("P")
R = TypeVar("R")

_run: ContextVar[RunContext | None] = ContextVar("durably_run", default=None)
_key: ContextVar[str | None] = ContextVar("durably_idempotency_key", default=None)
_external_ids: ContextVar[list[str] | None] = ContextVar("durably_external_ids", default=None)


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


def external_id(value: str) -> None:
    """Record the service's id for the tool call being executed, as soon as the tool knows
    it (a job accepted, an order number assigned), before the final answer.

    If the call's outcome then turns out unknown (a timeout, a broken connection), the id
    is kept with the operation and ``reconcile`` gets it as ``op.external_operation_id``:
    the service can be asked by its own id instead of a search.

    Example::

        @app.tool(reconcile=lambda op: jobs.status(op.external_operation_id))
        def render(doc: str) -> dict:
            job = jobs.submit(doc, idempotency_key=durably.idempotency_key())
            durably.external_id(job.id)
            return jobs.wait(job.id)
    """
    ids = _external_ids.get()
    if ids is None:
        raise OutsideRunError("durably.external_id() is only available while a tool is executing")
    ids.append(check_text(str(value), "external id"))


def check_lease() -> None:
    """Raise :class:`LeaseLostError` if this worker may no longer own the run.

    Call it in a tool right before the request leaves (cheap: no round trip, it reads this
    process's monotonic clock against the lease deadline). A worker paused between its
    claim and its send (GC, SIGSTOP, a slow connect) would otherwise send after another
    worker took the run over and settled the same call. Once raised, the run's execution
    in this process stops; the worker that owns the run now settles the call.

    Example::

        @app.tool(reconcile=find_coupon)
        def issue_coupon(customer: str) -> dict:
            payload = build(customer)
            durably.check_lease()
            return shop.post("/coupons", payload)
    """
    active().check_lease()


def fencing_token() -> int:
    """The run's lease epoch: it grows each time another worker takes the run over.

    Send it to a service that can refuse requests carrying a smaller token than one it has
    already seen for the same operation (a fencing token), closing the window between
    :func:`check_lease` and the request's arrival.
    """
    return active().lease.epoch


def fenced(send: Callable[P, R]) -> Callable[P, R]:
    """Wrap a function that sends requests so every call checks the lease first.

    Inside a run it calls :func:`check_lease` before each call; outside one (unit tests,
    scripts) it calls straight through. Works for plain and ``async def`` functions.

    Example::

        @durably.fenced
        def post_json(url: str, body: dict) -> dict: ...
    """
    if inspect.iscoroutinefunction(send):

        @functools.wraps(send)
        async def checked_async(*args: P.args, **kwargs: P.kwargs) -> Any:
            if _run.get() is not None:
                check_lease()
            return await send(*args, **kwargs)

        return cast(Callable[P, R], checked_async)

    @functools.wraps(send)
    def checked(*args: P.args, **kwargs: P.kwargs) -> R:
        if _run.get() is not None:
            check_lease()
        return send(*args, **kwargs)

    return checked
