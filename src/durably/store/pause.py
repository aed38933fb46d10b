"""The store's transactions for an operator's pause, as plans (see :mod:`.plans`).

The request is kept on the run (``pause_requested``) until it is withdrawn: a run nobody
holds pauses when it is asked to; a held one learns of it from its next commit's fence and
pauses at its next call boundary, or, if that commit starts a wait, in the commit itself.
"""

from __future__ import annotations

from durably.errors import InvalidTransition
from durably.status import PauseReason, RunStatus
from durably.store.base import WAITING, RunRecord
from durably.store.plans import Plan, Round, check_open, insert_event
from durably.store.rows import loads, run_from_row


def request_pause(run_id: str, request_json: str) -> Plan[RunRecord]:
    """``Store.request_pause``: the request recorded (once), and the run paused now if it is
    queued or waits and nobody holds it; else its holder pauses it at its next boundary."""
    locked, clock = yield Round([("lock_run_record", {"run_id": run_id}), ("clock", {})])
    check_open(run_id, locked[0] if locked else None)
    run = run_from_row(locked[0])
    if run.pause_requested is not None:
        return run  # asked before: nothing more to record
    held = run.lease_owner is not None and (run.lease_until or 0) >= float(clock[0]["now"])
    at_once = not held and run.status in (RunStatus.QUEUED, *WAITING)
    payload = {**loads(request_json), "at_once": at_once}
    event = "run_paused" if at_once else "pause_requested"
    updated, _ = yield Round(
        [
            ("request_pause", {"run_id": run_id, "request": request_json, "at_once": at_once}),
            insert_event(run_id, run.last_sequence + 1, event, None, payload),
        ],
        final=True,
    )
    return run_from_row(updated[0])


def withdraw_pause(run_id: str, by: str) -> Plan[RunRecord]:
    """``Store.withdraw_pause``: an operator-paused run queued, or a pending request
    withdrawn; refused for a run no operator asked to pause."""
    (locked,) = yield Round([("lock_run_record", {"run_id": run_id})])
    check_open(run_id, locked[0] if locked else None)
    run = run_from_row(locked[0])
    operator_paused = run.status is RunStatus.PAUSED and run.status_reason == PauseReason.OPERATOR
    if run.pause_requested is None and not operator_paused:
        raise InvalidTransition(
            f"run {run_id} is {run.status}"
            + (f" ({run.status_reason})" if run.status_reason else "")
            + "; no operator paused it, so there is nothing to unpause"
            + (
                "; settle the cause (`durably resolve`, then `durably resume`)"
                if run.status is RunStatus.PAUSED
                else ""
            ),
            run_id=run_id,
        )
    if run.status is RunStatus.PAUSED and not operator_paused:
        raise InvalidTransition(
            f"run {run_id} is paused for {run.status_reason}, which unpause cannot settle: "
            "settle it first (`durably resolve`, then `durably resume`); the run then stops "
            "at the operator's pause, and `durably unpause` continues it",
            run_id=run_id,
        )
    payload = {"by": by, "withdrawn": not operator_paused}
    updated, _ = yield Round(
        [
            ("withdraw_pause", {"run_id": run_id, "resume": operator_paused}),
            insert_event(run_id, run.last_sequence + 1, "run_unpaused", None, payload),
        ],
        final=True,
        notify=operator_paused,
    )
    return run_from_row(updated[0])
