"""What a run looks like to its callers: the :class:`Run` and the JSON document behind
``runs show --json``, the console and the API, built from the store's records alone."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from durably.checkpoint import checksum_holds
from durably.status import RunStatus
from durably.store.base import Journal, RunRecord, StoredCheckpoint


@dataclass(frozen=True)
class Run:
    """A run as its caller sees it."""

    run_id: str
    workflow: str
    status: RunStatus
    result: Any
    error: dict[str, Any] | None
    status_reason: str | None
    waiting_for: dict[str, Any] | None
    tenant: str
    created_at: float
    updated_at: float
    pause_requested: bool = False
    """An operator's pause is in force: the run is paused for it, or its worker pauses it at
    its next call boundary."""

    @classmethod
    def from_record(cls, r: RunRecord) -> Run:
        return cls(
            run_id=r.run_id,
            workflow=r.workflow,
            status=r.status,
            result=None if r.result_json is None else _loads(r.result_json),
            error=r.error,
            status_reason=r.status_reason,
            waiting_for=r.waiting_for,
            tenant=r.tenant,
            created_at=r.created_at,
            updated_at=r.updated_at,
            # A request the run finished before reaching a boundary holds nothing any more.
            pause_requested=r.pause_requested is not None and not r.status.is_final,
        )


def _loads(text: str) -> Any:
    return json.loads(text)


def describe(journal: Journal) -> dict[str, Any]:
    """Everything about a run as plain JSON: the document behind ``runs show --json``."""
    run = Run.from_record(journal.run)
    ops = {o.step_id: o for o in journal.operations}
    # Intents of one commit (a fork's copies, parallel branches) share a created_at.
    positions = {s.step_id: s.position for s in journal.steps}
    made = sorted(ops.values(), key=lambda o: (o.created_at, positions.get(o.step_id, -1)))
    calls = model_calls(journal)
    # The model call whose answer asked for the tool call that an effect's step id names.
    asked_by = {i: c["model_call_id"] for c in calls for i in c["tool_call_ids"]}
    return {
        "run_id": run.run_id,
        "workflow": run.workflow,
        "workflow_version": journal.run.workflow_version,
        "tenant": run.tenant,
        "status": run.status.value,
        "status_reason": run.status_reason,
        "result": run.result,
        "error": run.error,
        "waiting_for": run.waiting_for,
        "pause_requested": run.pause_requested,
        "created_at": run.created_at,
        "updated_at": run.updated_at,
        "steps": [
            {
                "step_id": s.step_id,
                "kind": s.kind,
                "name": s.name,
                "status": s.status.value,
                "input_hash": s.input_hash,
                "attempts": s.attempts,
                "output": None if s.output_json is None else _loads(s.output_json),
                "error": s.error,
            }
            for s in journal.steps
        ],
        "effects": [
            {
                "step_id": o.step_id,
                "tool": o.tool,
                "status": o.status.value,
                "idempotency_key": o.idempotency_key,
                "input_hash": o.input_hash,
                "arguments": o.arguments,
                "external_operation_id": o.external_operation_id,
                "attempt": o.attempt,
                "failure_category": o.failure_category,
                "result": None if o.result_json is None else _loads(o.result_json),
                "error": o.error,
                "model_call_id": asked_by.get(o.step_id),
            }
            for o in made
        ],
        "model_calls": calls,
        "approvals": [
            {
                "approval_id": a.approval_id,
                "step_id": a.step_id,
                "kind": a.kind,
                "name": a.name,
                "status": a.status,
                "payload": a.payload,
                "input_hash": a.input_hash,
                "idempotency_key": a.idempotency_key,
                "plan_version": a.plan_version,
                "requested_at": a.requested_at,
                "expires_at": a.expires_at,
                "decided_by": a.decided_by,
                "comment": a.comment,
            }
            for a in journal.approvals
        ],
        "last_event_sequence": journal.run.last_sequence,
    }


def model_calls(journal: Journal) -> list[dict[str, Any]]:
    """The run's recorded model calls in call order, each with its answer."""
    return [
        {
            **s.model_call,
            "step_id": s.step_id,
            "name": s.name,
            "input_hash": s.input_hash,
            "attempts": s.attempts,
            "output": None if s.output_json is None else _loads(s.output_json),
        }
        for s in journal.steps
        if s.model_call is not None
    ]


def checkpoints(stored: list[StoredCheckpoint], key: bytes | None) -> list[dict[str, Any]]:
    """Checkpoints as shown, each with its checksum and whether it holds under ``key``."""
    return [
        {**s.payload, "checksum": s.checksum, "valid": checksum_holds(s.payload, s.checksum, key)}
        for s in stored
    ]
