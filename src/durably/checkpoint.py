"""Checkpoints: checksummed, versioned snapshots of a run's recoverable boundary.

A run's *journal* (the steps table) holds every recorded result; a checkpoint does not copy
it. It pins down what the journal must contain at that moment: how many results were settled
and a chained sha256 digest over them, in the order they were recorded. On resume the latest
checkpoint whose checksum holds is the anchor; results settled after it must each match the
``output_hash`` of the event that recorded them. Anything else is a corrupted journal, and the
run pauses with ``checkpoint_corrupted`` instead of continuing from a wrong state.

A plain sha256 checksum detects accidents, not a forger: anyone who can write the database
can recompute it. When the App has a secret, checkpoints are sealed with an HMAC under it
(checksum ``hmac-sha256:<hex>``) and only such a seal is trusted; a plain checksum is then
treated like a failed one, and the journal is checked against the event log instead.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from durably.errors import CheckpointCorrupted, CheckpointNotMigratable
from durably.keys import keyed_hex, plain_json, sha256_hex
from durably.status import RunStatus

CHECKPOINT_SCHEMA_VERSION = 2
"""2: ``completed_effects`` lists the keys of the run's latest confirmed effects (was: the
count and the latest key only); version 1 checkpoints are upgraded on read."""

EFFECTS_LISTED = 4
"""Confirmed effect keys a checkpoint lists: the latest ones, oldest first. Bounded, so a
run with thousands of effects writes checkpoints of the same size; the tool ledger holds
the whole list, and ``count`` says how many there are. Few, because every effect writes two
checkpoints: at 16 keys they were half of what an effect wrote."""

CHECKPOINT_EVERY = 32
"""A step's result is checkpointed only when this many results were settled since the last
checkpoint: the results in between are verified against the events that recorded them.
Effects, waits and endings are always checkpointed. With the App's secret every result is:
the event log is not sealed, and a forger could rewrite a result and its event together."""

CHECKPOINTS_KEPT = 3
"""Checkpoints a run keeps when older ones are pruned. Recovery anchors on the newest that
holds (the event log verifies everything after it, and everything, if none holds), and the
event log is the audit trail: it is never pruned."""

PRUNE_EVERY = 8
"""Checkpoints drafted between two that prune: a run's every effect, wait and sealed result
is checkpointed, and a delete with each would cost a statement more per commit. A run
holds at most ``CHECKPOINTS_KEPT + PRUNE_EVERY`` checkpoints once an execution's first
one is written (that one prunes), and its ending prunes."""

SEALED = "hmac-sha256:"
"""Prefix of a checksum keyed with the App's secret; a plain checksum is bare sha256 hex."""

CheckpointMigration = Callable[[dict[str, Any]], dict[str, Any]]
_migrations: dict[int, CheckpointMigration] = {}


def register_checkpoint_migration(
    from_version: int,
) -> Callable[[CheckpointMigration], CheckpointMigration]:
    """Register a function that upgrades a checkpoint payload from ``from_version`` to +1."""

    def register(fn: CheckpointMigration) -> CheckpointMigration:
        _migrations[from_version] = fn
        return fn

    return register


@register_checkpoint_migration(1)
def _list_completed_effects(payload: dict[str, Any]) -> dict[str, Any]:
    """Version 1 kept the count and the latest key; its list is that key alone."""
    effects = payload.get("completed_effects") or {}
    last = effects.get("last")
    listed = {"count": int(effects.get("count", 0)), "keys": [last] if last else []}
    return {**payload, "completed_effects": listed}


def chain_digest(previous: str, step_id: str, output_hash: str) -> str:
    return sha256_hex(f"{previous}|{step_id}|{output_hash}")


@dataclass(frozen=True)
class Checkpoint:
    """One recoverable boundary of a run (docs/architecture.md#checkpoints)."""

    checkpoint_id: str
    run_id: str
    state_version: int
    current_step: str | None
    status: str
    state_snapshot: dict[str, Any]
    last_event_sequence: int
    pending_action: dict[str, Any] | None
    completed_effects: dict[str, Any]
    budget_snapshot: dict[str, Any]
    created_at: float
    schema_version: int
    checksum: str

    def payload(self) -> dict[str, Any]:
        return {
            "checkpoint_id": self.checkpoint_id,
            "run_id": self.run_id,
            "state_version": self.state_version,
            "current_step": self.current_step,
            "status": self.status,
            "state_snapshot": self.state_snapshot,
            "last_event_sequence": self.last_event_sequence,
            "pending_action": self.pending_action,
            "completed_effects": self.completed_effects,
            "budget_snapshot": self.budget_snapshot,
            "created_at": self.created_at,
            "schema_version": self.schema_version,
        }

    @property
    def journal_length(self) -> int:
        return int(self.state_snapshot.get("journal_length", 0))

    @property
    def journal_digest(self) -> str:
        return str(self.state_snapshot.get("journal_digest", ""))


def checksum_of(payload: Mapping[str, Any], key: bytes | None = None) -> str:
    """The checksum of a checkpoint payload: ``hmac-sha256:<hex>`` under ``key`` (the App's
    secret), else the plain sha256 hex of its canonical JSON."""
    return _checksum(plain_json(dict(payload)), key)


def _checksum(text: str, key: bytes | None) -> str:
    return sha256_hex(text) if key is None else SEALED + keyed_hex(key, "checkpoint", text)


def checksum_holds(payload: Mapping[str, Any], checksum: str, key: bytes | None) -> bool:
    """Whether ``checksum`` proves ``payload``. With a key only its seal does: a plain
    checksum may be a forger's; without one only a plain checksum can be checked."""
    return hmac.compare_digest(checksum_of(payload, key).encode(), checksum.encode())


def from_stored(payload: dict[str, Any], checksum: str, key: bytes | None = None) -> Checkpoint:
    """Verify a stored checkpoint (see :func:`checksum_holds`), then migrate it to the
    current schema version.

    Raises :class:`CheckpointCorrupted` if the checksum does not prove what is stored,
    :class:`CheckpointNotMigratable` if it does but its schema version cannot be read.
    """
    if not checksum_holds(payload, checksum, key):
        checkpoint_id = payload.get("checkpoint_id")
        if key is not None and not checksum.startswith(SEALED):
            why = "is not sealed with the App's secret (a plain checksum can be forged)"
        elif key is None and checksum.startswith(SEALED):
            why = (
                "is sealed with a secret this App does not have; configure the same "
                "App(secret_key=...) or $DURABLY_SECRET_KEY in every process"
            )
        else:
            why = "failed its checksum"
        raise CheckpointCorrupted(f"checkpoint {checkpoint_id} {why}", run_id=payload.get("run_id"))
    version = int(payload["schema_version"])
    if version > CHECKPOINT_SCHEMA_VERSION:
        raise CheckpointNotMigratable(
            f"checkpoint {payload.get('checkpoint_id')} has schema_version {version}, newer "
            f"than this durably reads ({CHECKPOINT_SCHEMA_VERSION}); run it with the newer "
            "durably that wrote it",
            run_id=payload.get("run_id"),
        )
    while version < CHECKPOINT_SCHEMA_VERSION:
        upgrade = _migrations.get(version)
        if upgrade is None:
            raise CheckpointNotMigratable(
                f"checkpoint {payload.get('checkpoint_id')} has schema_version {version}, "
                f"with no registered migration to {version + 1}; register one with "
                "durably.register_checkpoint_migration, then resume the run",
                run_id=payload.get("run_id"),
            )
        payload = upgrade(dict(payload))
        version += 1
        payload["schema_version"] = version
    fields = dict(payload)
    fields["checksum"] = checksum
    return Checkpoint(**fields)


@dataclass
class JournalState:
    """What the runtime knows about a run's journal; drafts the next checkpoint from it."""

    run_id: str
    length: int = 0
    digest: str = ""
    effects_completed: int = 0
    recent_effects: tuple[str, ...] = ()
    """The latest :data:`EFFECTS_LISTED` confirmed effect keys (a tuple: a copy of this
    state made before a commit must not share it)."""
    budget: dict[str, Any] = field(default_factory=dict)
    key: bytes | None = field(default=None, repr=False)
    """The App's secret, which seals the checkpoints drafted from here (None: plain)."""
    unchecked: int = 0
    """Results settled since the last checkpoint drafted."""
    unpruned: int = field(default=0, compare=False)
    """Checkpoints drafted since the last that pruned (see :data:`PRUNE_EVERY`). An
    execution of a run read back from the store starts at ``PRUNE_EVERY`` (what earlier
    executions left is not known), unless it has just reported checkpoints as corrupted."""

    def copy(self) -> JournalState:
        """A copy to go back to if a commit is refused. Shallow, as ``dataclasses.replace``
        made it at several times the cost (every commit takes one): no field is changed in
        place (``budget`` is replaced, ``recent_effects`` is a tuple)."""
        twin = object.__new__(JournalState)
        twin.__dict__.update(self.__dict__)
        return twin

    def settle(self, step_id: str, output_hash: str) -> None:
        """Add a result to the journal, by the sha256 of its JSON (its event's
        ``output_hash``: computed once per result)."""
        self.length += 1
        self.unchecked += 1
        self.digest = chain_digest(self.digest, step_id, output_hash)

    def effect_completed(self, idempotency_key: str) -> None:
        self.effects_completed += 1
        self.recent_effects = (*self.recent_effects, idempotency_key)[-EFFECTS_LISTED:]

    def draft(
        self,
        *,
        status: str,
        current_step: str | None,
        pending_action: dict[str, Any] | None = None,
        prune: bool = False,
    ) -> CheckpointDraft:
        """The next checkpoint; ``prune``: it replaces all but the newest
        :data:`CHECKPOINTS_KEPT` of the run's checkpoints, as every :data:`PRUNE_EVERY`-th
        does anyway."""
        self.unchecked = 0
        prune = prune or self.unpruned >= PRUNE_EVERY
        self.unpruned = 0 if prune else self.unpruned + 1
        return CheckpointDraft(
            run_id=self.run_id,
            current_step=current_step,
            status=status,
            state_snapshot={"journal_length": self.length, "journal_digest": self.digest},
            pending_action=pending_action,
            completed_effects={"count": self.effects_completed, "keys": list(self.recent_effects)},
            budget_snapshot=dict(self.budget),
            prune=prune,
            key=self.key,
        )

    def periodic(self, *, current_step: str) -> CheckpointDraft | None:
        """A running run's checkpoint after a step's result, if one is due (see
        :data:`CHECKPOINT_EVERY`): most step commits write no checkpoint."""
        if self.unchecked < (1 if self.key else CHECKPOINT_EVERY):
            return None
        return self.draft(status=RunStatus.RUNNING, current_step=current_step)


@dataclass(frozen=True)
class CheckpointDraft:
    """A checkpoint before the store assigns its sequence and state version."""

    run_id: str
    current_step: str | None
    status: str
    state_snapshot: dict[str, Any]
    pending_action: dict[str, Any] | None
    completed_effects: dict[str, Any]
    budget_snapshot: dict[str, Any]
    prune: bool = False
    key: bytes | None = field(default=None, repr=False, compare=False)

    def seal(self, *, state_version: int, last_event_sequence: int) -> tuple[Checkpoint, str]:
        """Complete the checkpoint inside the store's transaction: it and its payload JSON.

        The id is ``<run_id>:<state_version>``: unique, and derivable without an index.
        """
        unsealed = Checkpoint(
            checkpoint_id=f"{self.run_id}:{state_version}",
            run_id=self.run_id,
            state_version=state_version,
            current_step=self.current_step,
            status=self.status,
            state_snapshot=self.state_snapshot,
            last_event_sequence=last_event_sequence,
            pending_action=self.pending_action,
            completed_effects=self.completed_effects,
            budget_snapshot=self.budget_snapshot,
            created_at=time.time(),
            schema_version=CHECKPOINT_SCHEMA_VERSION,
            checksum="",
        )
        text = plain_json(unsealed.payload())
        return replace(unsealed, checksum=_checksum(text, self.key)), text


@dataclass(frozen=True)
class SettledResult:
    """A journal entry as stored: the order it was recorded in and the hash of its output."""

    step_id: str
    settled_sequence: int
    output_hash: str


@dataclass(frozen=True)
class Verification:
    anchor: Checkpoint | None
    corrupted_checkpoints: list[str]


def verify_journal(
    results: Iterable[SettledResult],
    stored_checkpoints: Sequence[tuple[dict[str, Any], str]],
    recorded_hashes_after: Callable[[int], Mapping[str, str]],
    key: bytes | None = None,
    run_id: str | None = None,
) -> Verification:
    """Check the journal against the newest checkpoint that passes its checksum.

    ``stored_checkpoints`` are (payload, checksum) pairs, newest first; ``key`` is the App's
    secret (see :func:`checksum_holds`); ``run_id``, the run being verified: a checkpoint of
    another run (copied over, seal and all) is not an anchor.
    ``recorded_hashes_after(seq)`` returns ``{step_id: output_hash}`` from the events after
    ``seq``; it is only called when results were settled after the anchor.
    Raises :class:`CheckpointCorrupted` when the journal cannot be verified, and
    :class:`CheckpointNotMigratable` from the newest intact checkpoint: an older one is no
    fallback for a readable-by-newer-code one, which is not corrupted.
    """
    corrupted: list[str] = []
    anchor: Checkpoint | None = None
    for payload, checksum in stored_checkpoints:
        if run_id is not None and payload.get("run_id") != run_id:
            # A checkpoint sealed for another run proves nothing about this one.
            corrupted.append(str(payload.get("checkpoint_id")))
            continue
        try:
            anchor = from_stored(payload, checksum, key)
            break
        except CheckpointCorrupted:
            corrupted.append(str(payload.get("checkpoint_id")))
    ordered = sorted(results, key=lambda r: r.settled_sequence)
    anchor_seq = anchor.last_event_sequence if anchor else 0
    before = [r for r in ordered if r.settled_sequence <= anchor_seq]
    after = [r for r in ordered if r.settled_sequence > anchor_seq]
    run_id = anchor.run_id if anchor else None
    if anchor is not None:
        digest = ""
        for r in before:
            digest = chain_digest(digest, r.step_id, r.output_hash)
        if len(before) != anchor.journal_length or digest != anchor.journal_digest:
            raise CheckpointCorrupted(
                f"the recorded results of run {anchor.run_id} do not match checkpoint "
                f"{anchor.checkpoint_id}; the journal was altered. Inspect the run's events "
                "before resolving it by hand",
                run_id=anchor.run_id,
            )
    if after:
        recorded = recorded_hashes_after(anchor_seq)
        bad = [r.step_id for r in after if recorded.get(r.step_id) != r.output_hash]
        if bad:
            raise CheckpointCorrupted(
                f"recorded results {bad} do not match the event log; the journal was altered",
                run_id=run_id,
            )
    return Verification(anchor=anchor, corrupted_checkpoints=corrupted)
