"""The store's transactions, written once: which named statements run, in which order, with
which parameters, and what their rows must show for the transaction to apply.

A plan is a generator. It yields a :class:`Round` of queries, receives their rows, and
decides what follows (another round, a refusal, or its result). A backend only executes
plans: SQLite runs every round inside one ``BEGIN IMMEDIATE ... COMMIT`` on its own clock;
PostgreSQL sends each round as one round trip, ``BEGIN`` with the first and ``COMMIT`` with
the final one, on the server's clock. So a round is a PostgreSQL round trip, and a plan has
as many as its decisions need (the commit, in :mod:`.commit_plan`, has one or two).

Statement names are those of ``sql/<backend>/queries.sql``. Parameters are named like the
fields of the records they come from, so ``vars(record)`` fills a statement off the hot path
(on it, an explicit dict costs less than copying one); ``now`` is the backend's (SQLite binds
its clock, PostgreSQL reads ``now()``), never a plan's.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, TypeVar

from durably.checkpoint import CheckpointDraft
from durably.errors import InvalidTransition, LeaseLostError, RunNotFound
from durably.keys import plain_json
from durably.status import RunStatus
from durably.store.base import (
    CHECKPOINTS_READ,
    Approval,
    Claim,
    Journal,
    Lease,
    NewRun,
    RunRecord,
)
from durably.store.rows import (
    Row,
    approval_from_row,
    checkpoint_from_row,
    event_from_row,
    loads,
    operation_from_row,
    run_from_row,
    signal_from_row,
    step_from_row,
)

T = TypeVar("T")
Rows = list[Row]


Query = tuple[str, dict[str, Any]]
"""A statement's name in ``queries.sql`` and its parameters by name (a plain tuple: the
commit path builds several per transaction)."""


@dataclass(slots=True)
class Round:
    queries: list[Query]
    final: bool = False
    """The transaction commits with this round (PostgreSQL sends COMMIT in the same trip).
    A plan that ends after a round that is not final commits with nothing more to write."""
    notify: bool = False
    """The transaction may make a run claimable: workers asleep on PostgreSQL's NOTIFY wake."""


Plan = Generator[Round, list[Rows], T]
"""Yields rounds, receives each round's rows (one list per query), returns the result.

A write without ``RETURNING`` answers an empty row per row it changed, so "no row" means
"nothing matched" for every statement (a RETURNING costs SQLite a temporary table)."""


# -- what several transactions write -------------------------------------------------


def insert_event(
    run_id: str, sequence: int, type_: str, step_id: str | None, payload: dict[str, Any]
) -> Query:
    """One event of the run's log at ``sequence``, as a query."""
    return (
        "insert_event",
        {
            "run_id": run_id,
            "sequence": sequence,
            "type": type_,
            "step_id": step_id,
            "payload_json": plain_json(payload),
        },
    )


def json_or_none(value: Any) -> str | None:
    return None if value is None else plain_json(value)


# -- the other writes -----------------------------------------------------------------


def insert_checkpoint(draft: CheckpointDraft, state_version: int, last_sequence: int) -> Query:
    """The checkpoint ``draft`` sealed at this state version and event sequence, as a query."""
    cp, payload_json = draft.seal(state_version=state_version, last_event_sequence=last_sequence)
    return (
        "insert_checkpoint",
        {
            "run_id": cp.run_id,
            "state_version": cp.state_version,
            "last_event_sequence": cp.last_event_sequence,
            "schema_version": cp.schema_version,
            "payload_json": payload_json,
            "checksum": cp.checksum,
        },
    )


def create_run(new: NewRun) -> Plan[tuple[RunRecord, bool]]:
    """Insert a queued run with its ``run_started`` event and its receipt checkpoint, or
    read the existing one."""
    (inserted,) = yield Round([("insert_run", vars(new))])
    if inserted:
        yield Round(received(new, inserted[0]["state_version"]), final=True, notify=True)
        return run_from_row(inserted[0]), True
    (existing,) = yield Round([("get_run", {"run_id": new.run_id})], final=True)
    return run_from_row(existing[0]), False


def start_run(
    new: NewRun, owner: str, ttl_s: float, sent_at: float, *, one_statement: bool
) -> Plan[tuple[RunRecord, bool, Claim | None]]:
    """``create_run`` with the new run already leased to its creator, who executes it: no
    worker is woken for it, and no claim reads back a journal this transaction wrote. The
    run already there in its place is read after it, in the same transaction.

    ``one_statement``: the backend's ``start_run`` also writes the run's event and receipt
    (a data-modifying ``WITH``), so the whole start is one round.
    """
    # What create_run writes, its receipt sealed at the state before the lease.
    writes = received(new, 1)
    event_json = writes[0][1]["payload_json"]
    receipt = writes[1][1] if len(writes) > 1 else None
    params = {
        **vars(new),
        "owner": owner,
        "ttl": ttl_s,
        "event_json": event_json,
        "receipt": receipt is not None,
        "schema_version": None if receipt is None else receipt["schema_version"],
        "checkpoint_json": None if receipt is None else receipt["payload_json"],
        "checksum": None if receipt is None else receipt["checksum"],
    }
    existing: Rows = []
    if one_statement:
        started, existing = yield Round(
            [("start_run", params), ("get_run", {"run_id": new.run_id})], final=True
        )
    else:
        (started,) = yield Round([("start_run", params)])
        if started:
            yield Round(writes, final=True)
        else:
            (existing,) = yield Round([("get_run", {"run_id": new.run_id})], final=True)
    if not started:
        return run_from_row(existing[0]), False, None
    run = run_from_row(started[0])
    lease = Lease(run.run_id, owner, run.lease_epoch, ttl_s)
    journal = _new_journal(run, event_json, receipt)
    return run, True, Claim(run, lease, False, sent_at=sent_at, journal=journal, new=True)


def _new_journal(run: RunRecord, event_json: str, receipt: dict[str, Any] | None) -> Journal:
    """A new run's journal as ``start_run`` wrote it: its ``run_started`` event (stamped
    with the run's own creation time: one ``now()`` per transaction) and, if sealed, its
    receipt checkpoint, which covers that event."""
    if receipt is not None:
        checkpoints, recent = [checkpoint_from_row(receipt)], []
    else:
        first = {
            "run_id": run.run_id,
            "sequence": 1,
            "type": "run_started",
            "step_id": None,
            "payload_json": event_json,
            "created_at": run.created_at,
        }
        checkpoints, recent = [], [event_from_row(first)]
    return Journal(
        run=run,
        steps=[],
        operations=[],
        checkpoints=checkpoints,
        signals=[],
        approvals=[],
        recent_events=recent,
    )


def _started(new: NewRun) -> dict[str, Any]:
    """The payload of a new run's ``run_started`` event."""
    return {"workflow": new.workflow, "version": new.workflow_version}


def received(new: NewRun, state_version: int) -> list[Query]:
    """A new run's ``run_started`` event and its receipt checkpoint, sealed at
    ``state_version``."""
    queries = [insert_event(new.run_id, 1, "run_started", None, _started(new))]
    if new.receipt is not None:
        # The task is received: a recoverable boundary before anything runs.
        queries.append(insert_checkpoint(new.receipt, state_version, 1))
    return queries


def expire_leases(owners: Any) -> Plan[int]:
    """End the leases of ``owners`` (bound as a list), whose processes are gone: their runs
    and the operations they held. How many runs were freed."""
    runs, _ = yield Round(
        [
            ("expire_run_leases", {"owners": owners}),
            ("expire_operation_leases", {"owners": owners}),
        ],
        final=True,
        notify=True,
    )
    return len(runs)


def claim(pick: Plan[Rows], owner: str, ttl_s: float, sent_at: float) -> Plan[list[Claim]]:
    """The claims of the runs ``pick`` leased (their rows as leased, with ``old_status``,
    ``old_owner`` and ``old_until`` from before), recording each recovery and reading each
    journal: one more round for however many runs, so a batch costs a single claim's round
    trips, and the new holder resumes from what its claim's own transaction read."""
    rows = yield from pick
    if not rows:
        return []
    recovered = [_recovered(row) for row in rows]
    recoveries: list[Query] = []
    reads: list[list[Query]] = []
    for row, was_in_flight in zip(rows, recovered, strict=True):
        if was_in_flight:
            run_id = row["run_id"]
            payload = {"previous_owner": row["old_owner"], "lease_until": row["old_until"]}
            recoveries += [
                ("next_sequence", {"run_id": run_id}),
                insert_event(run_id, row["last_sequence"] + 1, "run_recovered", None, payload),
            ]
        reads.append(_journal_queries(row["run_id"], CHECKPOINTS_READ))
    # After the recoveries, in the same transaction: each journal holds its run_recovered.
    # Every writer of a run's journal locks its row first, and this claim holds those locks:
    # the reads agree with each other without a snapshot of their own.
    answers = yield Round([*recoveries, *(q for r in reads for q in r)], final=True)
    answers = answers[len(recoveries) :]
    claims: list[Claim] = []
    for row, was_in_flight, queries in zip(rows, recovered, reads, strict=True):
        journal, answers = _journal(answers[: len(queries)]), answers[len(queries) :]
        run = run_from_row(row)
        claims.append(
            Claim(
                run=run,
                lease=Lease(run.run_id, owner, run.lease_epoch, ttl_s),
                recovered=was_in_flight,
                previous_lease_until=row["old_until"] if was_in_flight else None,
                sent_at=sent_at,
                journal=journal,
            )
        )
    return claims


def _recovered(claimed: Row) -> bool:
    """Whether a claimed run was in flight under any owner (a dead worker, or this one after
    a failed commit or a cut connection): its effects are reconciled before anything else."""
    return bool(claimed["old_status"] != RunStatus.QUEUED and claimed["old_owner"] is not None)


def deliver_signal(run_id: str, event_id: str, name: str, payload_json: str) -> Plan[bool]:
    """``Store.deliver_signal``: the signal once per event id, its event, the run due if
    it waits for that name. The run's row is locked first: its own commits serialise.

    An event id already delivered is a duplicate (False), whatever it carries this time and
    even once the run has finished: the id names the event (webhook senders deduplicate
    retries by it), and a sender whose first delivery's answer was lost must not learn
    that it failed."""
    locked, inserted, known = yield Round(
        [
            ("lock_run", {"run_id": run_id}),
            (
                "insert_signal",
                {
                    "run_id": run_id,
                    "event_id": event_id,
                    "name": name,
                    "payload_json": payload_json,
                },
            ),
            ("signal_known", {"run_id": run_id, "event_id": event_id}),
        ]
    )
    if known and not inserted:
        return False
    check_open(run_id, locked[0] if locked else None)
    run = locked[0]
    due = wakes(run["status"], run["waiting_for_json"], name)
    payload = {"name": name, "event_id": event_id, "wakes_run": due}
    received = insert_event(run_id, run["last_sequence"] + 1, "event_received", None, payload)
    yield Round([("bump_run", {"run_id": run_id, "due": due}), received], final=True, notify=True)
    return True


def decide_approval(
    run_id: str, approval_id: str | None, decision: str, by: str, comment: str | None
) -> Plan[tuple[Approval, bool]]:
    """``Store.decide_approval``: expiry is judged by the store's clock."""
    locked, found, clock = yield Round(
        [
            ("lock_run", {"run_id": run_id}),
            ("approvals", {"run_id": run_id, "approval_id": approval_id}),
            ("clock", {}),
        ]
    )
    check_open(run_id, locked[0] if locked else None)
    target = pending_approval(run_id, approval_id, [approval_from_row(r) for r in found])
    expired = target.expires_at <= float(clock[0]["now"])
    run = locked[0]
    if expired:
        # The clock's doing, not the caller's: their decision came too late and is refused,
        # so neither it nor its comment is recorded in their name.
        status, decided_by, noted = "expired", None, None
    else:
        status, decided_by, noted = decision, by, comment
    payload = {"approval_id": target.approval_id, "decision": status, "by": decided_by}
    if expired:
        payload["noticed_by"] = by
    decided, *_ = yield Round(
        [
            (
                "decide_approval",
                {
                    "approval_id": target.approval_id,
                    "status": status,
                    "by": decided_by,
                    "comment": noted,
                },
            ),
            ("bump_run", {"run_id": run_id, "due": run["status"] == RunStatus.WAITING_APPROVAL}),
            insert_event(
                run_id, run["last_sequence"] + 1, "approval_decided", target.step_id, payload
            ),
        ],
        final=True,
        notify=True,
    )
    return approval_from_row(decided[0]), expired


def request_cancel(run_id: str, compensate: bool) -> Plan[RunRecord]:
    """``Store.request_cancel``: flagged, and due now if it waits or nobody holds it."""
    (locked,) = yield Round([("lock_run", {"run_id": run_id})])
    check_open(run_id, locked[0] if locked else None)
    (updated,) = yield Round(
        [("request_cancel", {"run_id": run_id, "cancel": 2 if compensate else 1})],
        final=True,
        notify=True,
    )
    return run_from_row(updated[0])


# -- reads ------------------------------------------------------------------------------


def load_journal(run_id: str, checkpoints: int) -> Plan[Journal | None]:
    """What a worker resumes from, in one round of a read-only snapshot."""
    answers = yield Round(_journal_queries(run_id, checkpoints), final=True)
    return _journal(answers)


def _journal_queries(run_id: str, checkpoints: int) -> list[Query]:
    """The reads of a run's journal, answered in this order (see :func:`_journal`)."""
    return [
        ("get_run", {"run_id": run_id}),
        ("steps", {"run_id": run_id}),
        # Every operation has its step row (same transaction), so the steps' keys find
        # them without an index on run_id to maintain per effect.
        ("operations", {"run_id": run_id}),
        ("latest_checkpoints", {"run_id": run_id, "limit": checkpoints}),
        ("pending_signals", {"run_id": run_id}),
        ("approvals", {"run_id": run_id, "approval_id": None}),
        ("events_after_checkpoint", {"run_id": run_id}),
    ]


def _journal(answers: list[Rows]) -> Journal | None:
    run, steps, ops, cps, signals, approvals, recent = answers
    if not run:
        return None
    return Journal(
        run=run_from_row(run[0]),
        steps=sorted((step_from_row(r) for r in steps), key=lambda s: s.position),
        operations=[operation_from_row(r) for r in ops],
        checkpoints=[checkpoint_from_row(r) for r in cps],
        signals=[signal_from_row(r) for r in signals],
        approvals=[approval_from_row(r) for r in approvals],
        recent_events=[event_from_row(r) for r in recent],
    )


# -- the rules the plans check --------------------------------------------------------


def lease_lost(lease: Lease) -> LeaseLostError:
    return LeaseLostError(
        f"lease on run {lease.run_id} (owner {lease.owner}, epoch {lease.epoch}) was lost: "
        "another worker took the run over; this worker stops working on it",
        run_id=lease.run_id,
    )


def pending_approval(run_id: str, approval_id: str | None, approvals: list[Approval]) -> Approval:
    """The approval a decision is about, or the InvalidTransition that says why none is."""
    pending = [a for a in approvals if a.status == "requested"]
    if approval_id is not None and not pending:
        if not approvals:
            raise InvalidTransition(f"run {run_id} has no approval {approval_id!r}", run_id=run_id)
        done = approvals[0]
        raise InvalidTransition(
            f"approval {approval_id} of run {run_id} is already {done.status}"
            + (f" (by {done.decided_by})" if done.decided_by else "")
            + "; a decision is recorded once",
            run_id=run_id,
        )
    if not pending:
        latest = approvals[-1] if approvals else None
        detail = ""
        if latest is not None:
            detail = f"; its latest approval {latest.approval_id} is {latest.status}"
            if latest.decided_by:
                detail += f" (by {latest.decided_by})"
        raise InvalidTransition(f"run {run_id} has no pending approval{detail}", run_id=run_id)
    if len(pending) > 1:
        ids = ", ".join(a.approval_id for a in pending)
        raise InvalidTransition(
            f"run {run_id} has {len(pending)} pending approvals ({ids}); name one", run_id=run_id
        )
    return pending[0]


def wakes(status: str, waiting_for_json: str | None, event_name: str) -> bool:
    """Whether an event of ``event_name`` ends the run's current wait (both stores' rule)."""
    waiting = loads(waiting_for_json) or {}
    return status == RunStatus.WAITING_EXTERNAL and waiting.get("event") == event_name


def check_open(run_id: str, run: Row | None) -> None:
    """Raise unless the run exists and is not finished."""
    if run is None:
        raise RunNotFound(f"no run {run_id!r}", run_id=run_id)
    if RunStatus(run["status"]).is_final:
        raise InvalidTransition(
            f"run {run_id} is {run['status']} (final); nothing more can be delivered to it or "
            "decided for it",
            run_id=run_id,
        )
