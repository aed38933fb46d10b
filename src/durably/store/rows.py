"""Rows to records: both backends name their columns alike, and a row is addressed by name
(a ``sqlite3.Row``, a psycopg dict row, or a dict merged from them)."""

from __future__ import annotations

from typing import Any

from durably.keys import json_value
from durably.status import OperationStatus, RunStatus, StepStatus
from durably.store.base import (
    Approval,
    Event,
    OperationRecord,
    RunRecord,
    Signal,
    StepRecord,
    StoredCheckpoint,
)

Row = Any


def loads(text: str | None) -> Any:
    return None if text is None else json_value(text)


def run_from_row(r: Row) -> RunRecord:
    return RunRecord(
        run_id=r["run_id"],
        tenant=r["tenant_id"],
        workflow=r["workflow"],
        workflow_version=r["workflow_version"],
        plan_version=r["plan_version"],
        status=RunStatus(r["status"]),
        status_reason=r["status_reason"],
        input=loads(r["input_json"]),
        input_hash=r["input_hash"],
        result_json=r["result_json"],
        error=loads(r["error_json"]),
        waiting_for=loads(r["waiting_for_json"]),
        lease_owner=r["lease_owner"],
        lease_until=r["lease_until"],
        lease_epoch=r["lease_epoch"],
        state_version=r["state_version"],
        last_sequence=r["last_sequence"],
        available_at=r["available_at"],
        created_at=r["created_at"],
        updated_at=r["updated_at"],
        cancel_requested=int(r["cancel_requested"]),
        key_scheme=int(r["key_scheme"]),
        pause_requested=loads(r["pause_requested"]),
    )


def step_from_row(r: Row) -> StepRecord:
    return StepRecord(
        run_id=r["run_id"],
        step_id=r["step_id"],
        position=r["position"],
        kind=r["kind"],
        name=r["name"],
        status=StepStatus(r["status"]),
        input_hash=r["input_hash"],
        output_json=r["output_json"],
        error=loads(r["error_json"]),
        idempotency_key=r["idempotency_key"],
        attempts=r["attempts"],
        settled_sequence=r["settled_sequence"],
        created_at=r["created_at"],
        updated_at=r["updated_at"],
        model_call=loads(r["model_call_json"]),
    )


def operation_from_row(r: Row) -> OperationRecord:
    return OperationRecord(
        tenant=r["tenant_id"],
        idempotency_key=r["idempotency_key"],
        run_id=r["run_id"],
        step_id=r["step_id"],
        plan_version=r["plan_version"],
        tool=r["tool_name"],
        tool_version=r["tool_version"],
        input_hash=r["input_hash"],
        arguments=loads(r["arguments_json"]),
        status=OperationStatus(r["status"]),
        result_json=r["result_json"],
        error=loads(r["error_json"]),
        failure_category=r["failure_category"],
        external_operation_id=r["external_operation_id"],
        attempt=r["attempt"],
        lease_owner=r["lease_owner"],
        lease_until=r["lease_until"],
        lease_epoch=r["lease_epoch"],
        row_version=r["row_version"],
        created_at=r["created_at"],
        updated_at=r["updated_at"],
        origin_key=r["origin_key"],
    )


def checkpoint_from_row(r: Row) -> StoredCheckpoint:
    return StoredCheckpoint(payload=loads(r["payload_json"]), checksum=r["checksum"])


def signal_from_row(r: Row) -> Signal:
    return Signal(
        event_id=r["event_id"],
        name=r["name"],
        payload=loads(r["payload_json"]),
        received_at=r["received_at"],
    )


def approval_from_row(r: Row) -> Approval:
    return Approval(
        approval_id=r["approval_id"],
        run_id=r["run_id"],
        step_id=r["step_id"],
        kind=r["kind"],
        name=r["name"],
        payload=loads(r["payload_json"]),
        input_hash=r["input_hash"],
        idempotency_key=r["idempotency_key"],
        plan_version=r["plan_version"],
        status=r["status"],
        requested_at=r["requested_at"],
        expires_at=r["expires_at"],
        decided_at=r["decided_at"],
        decided_by=r["decided_by"],
        comment=r["comment"],
        consumed_at=r["consumed_at"],
    )


def event_from_row(r: Row) -> Event:
    return Event(
        run_id=r["run_id"],
        sequence=r["sequence"],
        event_id=f"{r['run_id']}:{r['sequence']}",
        type=r["type"],
        step_id=r["step_id"],
        payload=loads(r["payload_json"]),
        created_at=r["created_at"],
    )
