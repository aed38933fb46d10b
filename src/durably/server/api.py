"""The JSON API: the CLI's operations over HTTP, plus ``/metrics`` and ``/api/health``.

Who may call what is decided before a route runs (:mod:`durably.server.guard`): every
mutating endpoint needs the bearer token, reads too unless they are open. durably's errors
become JSON ``{"error": <type>, "message": <what to do>}`` with a 4xx status (404 unknown
run, 409 wrong state or conflicting input, 413/422 unusable input; :mod:`.errors`), so bad
input never yields a 5xx. Request bodies are validated strictly: no coercion, no extra keys.
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from durably.app import START_OPTIONS, App
from durably.errors import DurablyError, InvalidInput
from durably.exposition import scrape
from durably.server.errors import DurablyRoute, ErrorOut, error_response
from durably.server.settings import durably_app
from durably.status import ReplayMode, RunStatus
from durably.store.base import Approval, Event
from durably.values import MAX_JSON_DEPTH
from durably.views import Run

_ERRORS: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorOut, "description": "No run with this id."},
    409: {"model": ErrorOut, "description": "The run is not in a state that allows this."},
}
_MUTATING: dict[int | str, dict[str, Any]] = {
    **_ERRORS,
    401: {"model": ErrorOut, "description": "Missing or wrong bearer token."},
    422: {"model": ErrorOut, "description": "Unusable input."},
}

log = logging.getLogger("durably.server")

router = APIRouter(route_class=DurablyRoute)

AppDep = Annotated[App, Depends(durably_app)]
# Mutating bodies: a string is never a bool ("yes"), a number never a string, no extra keys.
_STRICT = ConfigDict(extra="forbid", strict=True)

# -- models -------------------------------------------------------------------------------

_TOO_DEEP = f"(nested deeper than {MAX_JSON_DEPTH} levels: not shown; see the database)"


def clip_deep(value: Any, depth: int = 1) -> Any:
    """``value`` with what nests deeper than ``MAX_JSON_DEPTH`` replaced by a note.

    New values cannot nest that deep (the core refuses them), but rows stored before the
    limit can, and every serializer recurses: one such run must not break the run list.
    """
    if isinstance(value, dict):
        if depth > MAX_JSON_DEPTH:
            return _TOO_DEEP
        return {k: clip_deep(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        if depth > MAX_JSON_DEPTH:
            return _TOO_DEEP
        return [clip_deep(v, depth + 1) for v in value]
    return value


Stored = Annotated[Any, BeforeValidator(clip_deep)]
"""A JSON value read from the store."""
StoredObject = Annotated[dict[str, Any], BeforeValidator(clip_deep)]


class RunOut(BaseModel):
    run_id: str
    workflow: str
    status: RunStatus
    status_reason: str | None
    result: Stored = Field(description="The workflow's return value once completed.")
    error: StoredObject | None
    waiting_for: StoredObject | None
    tenant: str
    created_at: float
    updated_at: float
    pause_requested: bool = Field(
        description="An operator's pause is in force: the run is paused for it, or its "
        "worker pauses it at its next call boundary."
    )

    @classmethod
    def of(cls, run: Run) -> RunOut:
        return cls(**asdict(run))


class StepOut(BaseModel):
    step_id: str
    kind: str
    name: str
    status: str
    attempts: int
    output: Stored
    error: StoredObject | None


class EffectOut(BaseModel):
    step_id: str
    tool: str
    status: str
    idempotency_key: str
    input_hash: str
    arguments: Stored
    external_operation_id: str | None
    attempt: int
    failure_category: str | None
    result: Stored
    error: StoredObject | None
    model_call_id: str | None = Field(
        description="The recorded model call whose answer asked for this tool call."
    )


class ModelCallOut(BaseModel):
    """A recorded model call: what the model was given, its answer, usage and latency."""

    model_call_id: str
    step_id: str
    name: str
    model: str
    model_profile: str | None
    input_hash: str
    input: Stored = Field(description="What the input hash covers; null when over the limit.")
    input_bytes: int
    output: Stored
    usage: dict[str, float]
    latency_ms: float
    tool_call_ids: list[str]
    attempts: int


class ApprovalSummary(BaseModel):
    approval_id: str
    step_id: str
    kind: str
    name: str
    status: str
    payload: Stored
    input_hash: str
    idempotency_key: str | None
    plan_version: int
    requested_at: float
    expires_at: float
    decided_by: str | None
    comment: str | None


class ApprovalOut(ApprovalSummary):
    run_id: str
    decided_at: float | None
    consumed_at: float | None

    @classmethod
    def of(cls, a: Approval) -> ApprovalOut:
        return cls(
            approval_id=a.approval_id,
            run_id=a.run_id,
            step_id=a.step_id,
            kind=a.kind,
            name=a.name,
            status=a.status,
            payload=a.payload,
            input_hash=a.input_hash,
            idempotency_key=a.idempotency_key,
            plan_version=a.plan_version,
            requested_at=a.requested_at,
            expires_at=a.expires_at,
            decided_at=a.decided_at,
            decided_by=a.decided_by,
            comment=a.comment,
            consumed_at=a.consumed_at,
        )


class CheckpointOut(BaseModel):
    checkpoint_id: Any
    state_version: int | None
    status: str | None
    current_step: str | None
    last_event_sequence: int | None
    created_at: float | None
    checksum: str
    valid: bool = Field(description="Whether the checkpoint's checksum holds.")

    @classmethod
    def of(cls, c: dict[str, Any]) -> CheckpointOut:
        return cls(
            checkpoint_id=c.get("checkpoint_id"),
            state_version=c.get("state_version"),
            status=c.get("status"),
            current_step=c.get("current_step"),
            last_event_sequence=c.get("last_event_sequence"),
            created_at=c.get("created_at"),
            checksum=str(c.get("checksum", "")),
            valid=bool(c.get("valid")),
        )


class EventOut(BaseModel):
    sequence: int
    event_id: str
    type: str
    step_id: str | None
    payload: StoredObject
    created_at: float

    @classmethod
    def of(cls, e: Event) -> EventOut:
        return cls(
            sequence=e.sequence,
            event_id=e.event_id,
            type=e.type,
            step_id=e.step_id,
            payload=e.payload,
            created_at=e.created_at,
        )


class RunDetail(BaseModel):
    """``durably runs show --json`` plus the run's checkpoints and event timeline."""

    run_id: str
    workflow: str
    workflow_version: str
    tenant: str
    status: RunStatus
    status_reason: str | None
    result: Stored
    error: StoredObject | None
    waiting_for: StoredObject | None
    pause_requested: bool
    created_at: float
    updated_at: float
    steps: list[StepOut]
    effects: list[EffectOut]
    model_calls: list[ModelCallOut] = Field(description="In call order.")
    approvals: list[ApprovalSummary]
    last_event_sequence: int
    checkpoints: list[CheckpointOut] = Field(description="Newest first.")
    events: list[EventOut] = Field(description="The run's event log, in sequence order.")


_Id = Annotated[str, Field(min_length=1, max_length=200)]
_Text = Annotated[str, Field(max_length=10_000)]


class StartIn(BaseModel):
    model_config = _STRICT

    workflow: _Id = Field(description="The workflow's registered name.")
    input: dict[str, Any] | list[Any] | None = Field(
        default=None,
        description="An object gives keyword arguments, an array positional arguments.",
    )
    run_id: _Id | None = Field(
        default=None, description="Starting the same run id again returns the existing run."
    )
    tenant: _Id = "default"


class DecisionIn(BaseModel):
    model_config = _STRICT

    approval_id: _Id | None = Field(
        default=None, description="May be omitted when the run has exactly one pending."
    )
    by: _Id = "operator"
    comment: _Text | None = None


class EventIn(BaseModel):
    model_config = _STRICT

    name: _Id
    payload: Any = None
    event_id: _Id | None = Field(
        default=None,
        description="The sender's id; sending the same id again changes nothing "
        "(default: a new id, returned).",
    )


class EventDelivery(BaseModel):
    run_id: str
    name: str
    event_id: str
    result: Literal["delivered", "duplicate ignored"]


class ResolveIn(BaseModel):
    model_config = _STRICT

    outcome: Literal["succeeded", "not_executed", "failed"]
    result: Any = Field(default=None, description="With succeeded: what the tool returned.")
    by: _Id = "operator"


class CancelIn(BaseModel):
    model_config = _STRICT

    compensate: bool = Field(
        default=False, description="First run the compensations of the run's effects."
    )


class PauseIn(BaseModel):
    model_config = _STRICT

    reason: _Text | None = Field(default=None, description="Why; shown with the paused run.")
    by: _Id = "operator"


class UnpauseIn(BaseModel):
    model_config = _STRICT

    by: _Id = "operator"


class ForkIn(BaseModel):
    model_config = _STRICT

    at: str | None = Field(
        default=None,
        max_length=1000,
        description="The source's step id (or checkpoint id) to fork after; none: all it settled.",
    )
    # Strict models take enum members only as instances: spelled out, JSON strings pass.
    replay: Literal["DISABLED", "RECORDED", "SANDBOX", "LIVE_WITH_NEW_APPROVAL"] = Field(
        default="DISABLED", description="What a new tool call past the fork point does."
    )
    run_id: _Id | None = Field(default=None, description="The fork's run id (default: a new one).")


class ReplayIn(BaseModel):
    model_config = _STRICT

    mode: str = Field(
        default="RECORDED",
        max_length=40,
        description="How calls are answered; only RECORDED (the run's own record) is supported.",
    )


class DivergenceOut(BaseModel):
    kind: str = Field(
        description="other_call, other_arguments, new_call, missing_call, other_result or stopped."
    )
    step_id: str | None
    name: str | None
    message: str
    recorded_step_id: str | None


class ReplayOut(BaseModel):
    run_id: str
    what_if_run_id: str = Field(description="The fork the what-if ran as (cancelled if stopped).")
    mode: ReplayMode
    reproduced: bool
    matched: list[str] = Field(description="The calls made alike before the divergence.")
    divergence: DivergenceOut | None
    status: RunStatus
    result: Stored
    recorded_result: Stored
    result_hash: str | None
    recorded_result_hash: str | None
    notes: list[str]


class ResumeIn(BaseModel):
    """No options yet; a body, if sent, must be ``{}`` (a typo is refused, not ignored)."""

    model_config = _STRICT


class Health(BaseModel):
    status: Literal["ok"]


# -- endpoints ----------------------------------------------------------------------------


@router.get(
    "/api/health",
    tags=["meta"],
    response_model=Health,
    responses={503: {"model": ErrorOut, "description": "The database cannot be opened."}},
)
async def health(app: AppDep) -> Any:
    """The server is up and its database is open (503 otherwise).

    Anyone may ask, so the answer says nothing about the database (its path or URL); the
    reason is in the server's log.
    """
    try:
        await app.open()
    except DurablyError as exc:
        log.warning("health: the database cannot be opened: %s", exc)
        return error_response(
            503, "StoreUnavailable", "the database cannot be opened; see the server's log"
        )
    return Health(status="ok")


@router.get(
    "/metrics",
    tags=["meta"],
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text."}},
)
async def metrics(app: AppDep) -> Response:
    """This process's Prometheus metrics, with the ledger's figures read from the store now
    (the same on every scrape target: see docs/architecture.md#metrics)."""
    return Response(content=await scrape(app.engine), media_type=CONTENT_TYPE_LATEST)


@router.get("/api/runs", tags=["runs"])
async def list_runs(
    app: AppDep,
    status: RunStatus | None = None,
    workflow: Annotated[str | None, Query(max_length=200)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> list[RunOut]:
    """Runs, newest first."""
    runs = await app.list_runs_async(status=status, workflow=workflow, limit=limit)
    return [RunOut.of(r) for r in runs]


@router.get("/api/runs/{run_id}", tags=["runs"], responses={404: _ERRORS[404]})
async def get_run(app: AppDep, run_id: str) -> RunDetail:
    """Everything about a run: steps, effects, approvals, checkpoints and its event log."""
    doc = await app.describe_async(run_id)
    checkpoints = await app.checkpoints_async(run_id)
    events = await app.events_async(run_id)
    return RunDetail(
        **doc,
        checkpoints=[CheckpointOut.of(c) for c in checkpoints],
        events=[EventOut.of(e) for e in events],
    )


@router.post(
    "/api/runs",
    tags=["runs"],
    status_code=201,
    responses={
        401: _MUTATING[401],
        409: {"model": ErrorOut, "description": "The run id exists with another input."},
        422: {"model": ErrorOut, "description": "Unknown workflow or unusable input."},
    },
)
async def start_run(app: AppDep, body: StartIn) -> RunOut:
    """Queue a run for a worker (idempotent on ``run_id``)."""
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    if isinstance(body.input, dict):
        kwargs = body.input
    elif isinstance(body.input, list):
        args = body.input
    clash = sorted(START_OPTIONS & kwargs.keys())
    if clash:
        raise InvalidInput(
            f"input keys {clash} cannot be passed by keyword over the API; pass the input as "
            "an array of positional arguments"
        )
    rid = await app.start_async(
        body.workflow, *args, run_id=body.run_id, tenant=body.tenant, **kwargs
    )
    return RunOut.of(await app.get_run_async(rid))


async def _decide(
    app: App, run_id: str, body: DecisionIn | None, decision: Literal["approved", "rejected"]
) -> ApprovalOut:
    body = body or DecisionIn()
    approval = await app.decide_async(
        run_id, body.approval_id, decision, by=body.by, comment=body.comment
    )
    return ApprovalOut.of(approval)


@router.post(
    "/api/runs/{run_id}/approvals/approve",
    tags=["approvals"],
    responses=_MUTATING,
)
async def approve(app: AppDep, run_id: str, body: DecisionIn | None = None) -> ApprovalOut:
    """Approve the run's pending approval; a worker then continues the run."""
    return await _decide(app, run_id, body, "approved")


@router.post(
    "/api/runs/{run_id}/approvals/reject",
    tags=["approvals"],
    responses=_MUTATING,
)
async def reject(app: AppDep, run_id: str, body: DecisionIn | None = None) -> ApprovalOut:
    """Reject the run's pending approval; the workflow sees ApprovalRejected."""
    return await _decide(app, run_id, body, "rejected")


@router.post("/api/runs/{run_id}/events", tags=["events"], responses=_MUTATING)
async def send_event(app: AppDep, run_id: str, body: EventIn) -> EventDelivery:
    """Send an event to a run, once per ``event_id``."""
    import uuid

    event_id = body.event_id or uuid.uuid4().hex
    result = await app.send_event_async(run_id, body.name, body.payload, event_id=event_id)
    return EventDelivery(run_id=run_id, name=body.name, event_id=event_id, result=result)


@router.post(
    "/api/runs/{run_id}/effects/{step_id}/resolve",
    tags=["effects"],
    responses=_MUTATING,
)
async def resolve_effect(app: AppDep, run_id: str, step_id: str, body: ResolveIn) -> RunOut:
    """Settle an effect whose outcome is unknown; the run becomes queued (a cancelled run
    stays cancelled, with the outcome recorded)."""
    if body.result is not None and body.outcome != "succeeded":
        raise InvalidInput("result goes only with outcome succeeded", run_id=run_id)
    run = await app.resolve_effect_async(
        run_id, step_id, body.outcome, result=body.result, by=body.by
    )
    return RunOut.of(run)


@router.post("/api/runs/{run_id}/resume", tags=["runs"], responses=_MUTATING)
async def resume(app: AppDep, run_id: str, body: ResumeIn | None = None) -> RunOut:
    """Resume a paused run and execute it here until it completes, fails or stops."""
    del body  # validated only
    return RunOut.of(await app.resume_async(run_id))


@router.post("/api/runs/{run_id}/cancel", tags=["runs"], responses=_MUTATING)
async def cancel(app: AppDep, run_id: str, body: CancelIn | None = None) -> RunOut:
    """Cancel a run at its next call boundary (a run held by a worker may still show running)."""
    compensate = body.compensate if body else False
    return RunOut.of(await app.cancel_async(run_id, compensate=compensate))


@router.post("/api/runs/{run_id}/pause", tags=["runs"], responses=_MUTATING)
async def pause(app: AppDep, run_id: str, body: PauseIn | None = None) -> RunOut:
    """Pause a run at its next call boundary: a queued or waiting run at once, one held by a
    worker once its call in flight is recorded (it may still show running, with
    ``pause_requested``). Pausing again changes nothing."""
    spec = body or PauseIn()
    return RunOut.of(await app.pause_async(run_id, reason=spec.reason, by=spec.by))


@router.post("/api/runs/{run_id}/unpause", tags=["runs"], responses=_MUTATING)
async def unpause(app: AppDep, run_id: str, body: UnpauseIn | None = None) -> RunOut:
    """Queue an operator-paused run again for a worker (a paused wait waits again); 409 for
    a run no operator paused, or one paused for another reason."""
    spec = body or UnpauseIn()
    return RunOut.of(await app.unpause_async(run_id, by=spec.by))


@router.post("/api/runs/{run_id}/fork", tags=["runs"], responses=_MUTATING)
async def fork(app: AppDep, run_id: str, body: ForkIn | None = None) -> RunOut:
    """A new queued run whose history, up to ``at``, is this run's; new tool calls past it
    follow ``replay`` (DISABLED: nothing real is sent)."""
    spec = body or ForkIn()
    forked = await app.fork_async(
        run_id, at=spec.at, replay=ReplayMode(spec.replay), new_run_id=spec.run_id
    )
    return RunOut.of(forked)


@router.post("/api/runs/{run_id}/replay", tags=["runs"], responses=_MUTATING)
async def replay(app: AppDep, run_id: str, body: ReplayIn | None = None) -> ReplayOut:
    """What-if: execute this completed run again with the server's code, every call answered
    from its record, and report whether it reproduces or where it first diverges."""
    spec = body or ReplayIn()
    report = await app.replay_async(run_id, mode=spec.mode)
    return ReplayOut.model_validate(report.to_dict())
