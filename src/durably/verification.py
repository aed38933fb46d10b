"""A run's journal, verified before the run resumes: against its newest checkpoint that holds
(and the events after it), else every checkpoint and the whole event log; and the tool
ledger against the journal (docs/architecture.md#checkpoints).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from durably.checkpoint import JournalState, SettledResult, verify_journal
from durably.errors import CheckpointCorrupted
from durably.keys import sha256_hex
from durably.status import OperationStatus
from durably.store.base import (
    Event,
    EventWrite,
    Journal,
    OperationRecord,
    Store,
)


def journal_state(
    run_id: str, settled: list[SettledResult], ops: list[OperationRecord], key: bytes | None
) -> JournalState:
    state = JournalState(run_id=run_id, key=key)
    for result in sorted(settled, key=lambda r: r.settled_sequence):
        state.settle(result.step_id, result.output_hash)
    # In the order they were confirmed, as the execution counted them: the sequence that
    # settled each call (intents of one commit, a fork's copies, share a created_at).
    confirmed = {r.step_id: r.settled_sequence for r in settled}
    for op in sorted(ops, key=lambda o: (confirmed.get(o.step_id, math.inf), o.created_at)):
        if op.status is OperationStatus.SUCCEEDED and op.result_json is not None:
            state.effect_completed(op.idempotency_key)
    return state


async def verified(
    store: Store, journal: Journal, key: bytes | None
) -> tuple[JournalState, EventWrite | None]:
    """The journal's state, verified against its checkpoints (and the event log if needed).

    ``key``, the App's secret, is the only seal trusted on a checkpoint and seals the next.
    Raises :class:`CheckpointCorrupted` if the journal cannot be trusted. The event returned
    (if any) reports checkpoints that failed their checksum; commit it with the next write.
    """
    run_id = journal.run.run_id
    settled = [
        SettledResult(s.step_id, s.settled_sequence, sha256_hex(s.output_json or "null"))
        for s in journal.steps
        if s.settled_sequence is not None
    ]
    stored = [(c.payload, c.checksum) for c in journal.checkpoints]
    try:
        verification = verify_journal(
            settled, stored, _output_hashes(journal.recent_events), key, run_id
        )
    except CheckpointCorrupted:
        verification = None
    if verification is None or verification.corrupted_checkpoints:
        # The slow path: read every checkpoint and the event log, check all against them.
        stored = [(c.payload, c.checksum) for c in await store.checkpoints(run_id)]
        events = await store.events(run_id)
        verification = verify_journal(settled, stored, _output_hashes(events), key, run_id)
    _check_ledger_matches_journal(journal)
    state = journal_state(run_id, settled, journal.operations, key)
    if not verification.corrupted_checkpoints:
        return state, None
    anchor = verification.anchor
    return state, EventWrite(
        "checkpoint_corrupted",
        None,
        {
            "checkpoint_ids": verification.corrupted_checkpoints,
            "recovered_from": anchor.checkpoint_id if anchor else "event_log",
        },
    )


def _output_hashes(events: list[Event]) -> Callable[[int], dict[str, str]]:
    """``{step_id: output_hash}`` recorded by ``events`` after a sequence. Events missing
    from ``events`` verify nothing: a result they recorded fails, and the slow path reads
    the whole log."""

    def after(sequence: int) -> dict[str, str]:
        return {
            e.step_id: str(e.payload["output_hash"])
            for e in events
            if e.sequence > sequence and e.step_id and e.payload.get("output_hash")
        }

    return after


def _check_ledger_matches_journal(journal: Journal) -> None:
    """Every settled tool result must be its operation's recorded result, and vice versa.

    The journal is verified against checkpoints and events; the tool ledger is checked
    against the journal, so neither an altered result nor an altered status is replayed.
    """
    ops = {o.idempotency_key: o for o in journal.operations}
    done = (OperationStatus.SUCCEEDED, OperationStatus.COMPENSATED)
    for step in journal.steps:
        if step.kind != "tool" or step.idempotency_key is None:
            continue
        op = ops.get(step.idempotency_key)
        settled = step.settled_sequence is not None
        if op is None:
            bad = settled
        elif refused_result(op):
            bad = settled  # it happened, and waits for an operator to give its outcome
        elif settled or op.status in done:
            bad = (
                not settled
                or op.status not in done
                or op.result_json is None
                or sha256_hex(op.result_json) != sha256_hex(step.output_json or "null")
            )
        else:
            bad = False
        if bad:
            raise CheckpointCorrupted(
                f"the tool ledger disagrees with the verified journal at {step.step_id} "
                f"(operation {step.idempotency_key}); it was altered. Inspect the run's events "
                "before resolving it by hand",
                run_id=journal.run.run_id,
                step_id=step.step_id,
            )


def refused_result(op: OperationRecord) -> bool:
    """The operation took effect but its result could not be stored (the run paused)."""
    return op.status is OperationStatus.SUCCEEDED and op.result_json is None and bool(op.error)
