"""The store contract: every backend must behave exactly like this."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace
from typing import TypeVar

import psycopg
import pytest

from durably.checkpoint import JournalState, from_stored
from durably.errors import InvalidTransition, LeaseLostError, SchemaTooNew
from durably.keys import sha256_hex
from durably.metrics import LedgerFigures
from durably.status import OperationStatus, RunStatus, StepStatus
from durably.store import open_store
from durably.store.base import (
    ApprovalRequest,
    EventWrite,
    Expect,
    Lease,
    NewRun,
    OperationWrite,
    RunUpdate,
    StepWrite,
    Store,
    Transition,
)
from durably.verification import verified
from tests.conftest import execute_sql

T = TypeVar("T")

# One event loop per test: a PostgreSQL pool belongs to the loop that opened it.
_loop: asyncio.AbstractEventLoop | None = None


def run(coro: Awaitable[T]) -> T:
    assert _loop is not None
    return _loop.run_until_complete(coro)


@pytest.fixture
def store(database_url: str) -> Iterator[Store]:
    global _loop  # noqa: PLW0603 - the loop of the running test, for run()
    _loop = asyncio.new_event_loop()
    s = open_store(database_url)
    run(s.migrate())
    yield s
    run(s.close())
    _loop.close()
    _loop = None


def new_run(run_id: str = "r1", workflow: str = "wf") -> NewRun:
    return NewRun(run_id, "default", workflow, "1", {"args": [], "kwargs": {}}, "{}", "h", 2)


def op_write(key: str = "k1", **changes: object) -> OperationWrite:
    base = {
        "tenant": "default",
        "idempotency_key": key,
        "run_id": "r1",
        "step_id": "t#1",
        "plan_version": 1,
        "tool": "t",
        "tool_version": "1",
        "input_hash": "ih",
        "arguments_json": "{}",
        "status": OperationStatus.INTENT_RECORDED,
    }
    base.update(changes)
    return OperationWrite(**base)  # type: ignore[arg-type]


def test_migrate_is_idempotent(store: Store) -> None:
    """Applying migrations twice applies nothing the second time."""
    assert run(store.migrate()) == []


def test_create_run_is_idempotent_on_run_id(store: Store) -> None:
    """A second create with the same id returns the stored run, not a new one."""
    first, created = run(store.create_run(new_run()))
    again, created_again = run(store.create_run(new_run()))
    assert created
    assert not created_again
    assert again.run_id == first.run_id
    assert again.status is RunStatus.QUEUED
    events = run(store.events("r1"))
    assert [e.type for e in events] == ["run_started"]


def test_start_run_creates_and_leases_the_run_in_one_transaction(store: Store) -> None:
    """``start_run`` records the run and leases it to its creator at once (its journal read
    in the same transaction); a run that exists already is returned, not claimed."""
    receipt = JournalState("r1").draft(status="queued", current_step=None)
    record, created, claim = run(store.start_run(replace(new_run(), receipt=receipt), "me", 30))
    assert created
    assert claim is not None
    assert record == claim.run
    assert record.run_id == "r1"
    assert not claim.recovered
    assert (claim.lease.owner, claim.lease.epoch) == ("me", 1)
    stored = run(store.get_run("r1"))
    assert stored is not None
    assert (stored.status, stored.lease_owner, stored.lease_epoch) == (RunStatus.RUNNING, "me", 1)
    # Both backends leave the same state: the receipt sealed before the lease, the lease
    # one state version later.
    assert (stored.state_version, stored.last_sequence) == (2, 1)
    assert claim.journal == run(store.load_journal("r1"))
    # Written by the claim's own transaction: what verifying it would find, it holds.
    assert claim.new
    assert run(verified(store, claim.journal, None)) == (JournalState("r1"), None)
    (sealed,) = claim.journal.checkpoints  # the receipt
    assert (sealed.payload["state_version"], sealed.payload["last_event_sequence"]) == (1, 1)
    assert [e.type for e in run(store.events("r1"))] == ["run_started"]
    unsealed = run(store.start_run(replace(new_run(), run_id="r2"), "me", 30))[2]
    assert unsealed is not None
    assert unsealed.journal is not None
    assert unsealed.journal.checkpoints == []
    assert unsealed.journal == run(store.load_journal("r2"))
    # Held by "me": nobody else claims it, and starting it again claims nothing.
    assert run(store.claim_next("w2", 30, ["wf|1"])) is None
    again, created_again, no_claim = run(store.start_run(new_run(), "w2", 30))
    assert (again.run_id, created_again, no_claim) == ("r1", False, None)
    run(store.commit(claim.lease, Transition(events=[EventWrite("mine")])))


@pytest.mark.parametrize("owner", [None, "me"])
def test_a_fork_is_created_whole_and_held_for_its_creator_if_named(
    store: Store, owner: str | None
) -> None:
    """``create_fork``: the run and its copied history in one transaction. Held for
    ``owner``, no worker claims it, and the owner's claim takes it as the queued run it
    is, not as one recovered from a dead holder; unheld, any worker claims it."""
    copies = [
        Transition(
            events=[EventWrite("step_forked", f"s#{n}", {"output_hash": "h"})],
            step=StepWrite(f"s#{n}", n, "step", "s", StepStatus.SUCCEEDED, "ih", "1", settle=True),
        )
        for n in (1, 2)
    ]
    created = run(store.create_fork(new_run(), copies, owner=owner, ttl_s=30))
    assert created is not None
    assert created.status is RunStatus.QUEUED
    assert created.lease_owner == owner
    events = [(e.type, e.step_id) for e in run(store.events("r1"))]
    assert events == [("run_started", None), ("step_forked", "s#1"), ("step_forked", "s#2")]
    assert run(store.create_fork(new_run(), [], owner=owner, ttl_s=30)) is None
    taken = run(store.claim_next("w2", 30, ["wf|1"]))
    if owner is None:
        assert taken is not None
        return
    assert taken is None
    claim = run(store.claim_run("r1", owner, 30))
    assert claim is not None
    assert not claim.recovered
    assert claim.journal is not None
    assert [s.step_id for s in claim.journal.steps] == ["s#1", "s#2"]


def test_only_one_owner_claims_a_run(store: Store) -> None:
    """A live lease excludes every other claimer; the epoch grows on each claim."""
    run(store.create_run(new_run()))
    first = run(store.claim_run("r1", "w1", 30))
    assert first is not None
    assert not first.new  # its journal was read back: it is verified
    assert first.run.status is RunStatus.RUNNING
    assert run(store.claim_run("r1", "w2", 30)) is None
    assert run(store.claim_next("w2", 30, ["wf|1"])) is None


def test_expired_lease_is_taken_over_and_old_owner_is_fenced(store: Store) -> None:
    """After expiry another worker claims (recovered=True); the old owner's writes fail."""
    run(store.create_run(new_run()))
    old = run(store.claim_run("r1", "w1", 0.05))
    assert old is not None
    time.sleep(0.1)
    new = run(store.claim_next("w2", 30, ["wf|1"]))
    assert new is not None
    assert new.recovered
    assert new.lease.epoch == old.lease.epoch + 1
    with pytest.raises(LeaseLostError):
        run(store.commit(old.lease, Transition(events=[EventWrite("late")])))
    with pytest.raises(LeaseLostError):
        run(store.heartbeat(old.lease))
    assert "late" not in [e.type for e in run(store.events("r1"))]
    assert "run_recovered" in [e.type for e in run(store.events("r1"))]


@pytest.mark.parametrize("new_row", [False, True], ids=["upsert", "new_row"])
def test_a_step_commit_writes_its_event_and_row(store: Store, new_row: bool) -> None:
    """A step's commit writes its event and its row, settled at that event, whether its
    writer knows the row is new (on PostgreSQL ``commit_step``: one statement, a plain
    insert) or not (an upsert); a later commit of the same step updates that row."""
    run(store.create_run(new_run()))
    claim = run(store.claim_run("r1", "w1", 30))
    assert claim is not None
    first = StepWrite(
        "s#1", 1, "step", "s", StepStatus.FAILED, "h", error={"m": "x"}, attempts=1, new_row=new_row
    )
    done = run(
        store.commit(claim.lease, Transition(events=[EventWrite("step_failed", "s#1")], step=first))
    )
    again = StepWrite(
        "s#1", 1, "step", "s", StepStatus.SUCCEEDED, "h", "1", attempts=2, settle=True
    )
    last = run(
        store.commit(
            claim.lease, Transition(events=[EventWrite("step_succeeded", "s#1")], step=again)
        )
    )
    journal = run(store.load_journal("r1"))
    assert journal is not None
    (row,) = journal.steps
    assert (row.status, row.output_json, row.attempts, row.settled_sequence) == (
        StepStatus.SUCCEEDED,
        "1",
        2,
        last.last_sequence,
    )
    events = [(e.sequence, e.type) for e in run(store.events("r1"))][-2:]
    assert events == [(done.last_sequence, "step_failed"), (last.last_sequence, "step_succeeded")]
    assert journal.run.last_sequence == last.last_sequence


@pytest.mark.parametrize("new_row", [False, True], ids=["upsert", "new_row"])
def test_a_step_commit_by_a_fenced_owner_writes_nothing(store: Store, new_row: bool) -> None:
    """A step's commit (on PostgreSQL one statement whose writes select from the fence) by
    an owner that lost the lease leaves no step row, no event and the run row as it was."""
    run(store.create_run(new_run()))
    old = run(store.claim_run("r1", "w1", 0.05))
    assert old is not None
    time.sleep(0.1)
    assert run(store.claim_next("w2", 30, ["wf|1"])) is not None
    before = run(store.load_journal("r1"))
    assert before is not None
    step = StepWrite(
        "s#1", 1, "step", "s", StepStatus.SUCCEEDED, "h", "1", settle=True, new_row=new_row
    )
    with pytest.raises(LeaseLostError):
        run(store.commit(old.lease, Transition(events=[EventWrite("late", "s#1")], step=step)))
    after = run(store.load_journal("r1"))
    assert after is not None
    assert after.steps == []
    assert after.run == before.run
    assert "late" not in [e.type for e in run(store.events("r1"))]


def test_a_run_cannot_be_deleted(store: Store, database_url: str) -> None:
    """A run's row is kept with its events, steps and checkpoints, which would otherwise meet
    the next run of its id: a delete behind durably's back, on a connection of its own
    (foreign keys enforced or not), is refused and leaves the run as it was."""
    run(store.create_run(new_run()))
    before = run(store.load_journal("r1"))
    with pytest.raises((sqlite3.IntegrityError, psycopg.errors.RestrictViolation)) as refused:
        execute_sql(database_url, "DELETE FROM durably_runs WHERE run_id = ?", ("r1",))
    assert "cannot be deleted" in str(refused.value)
    assert run(store.load_journal("r1")) == before


def at_state(run_id: str, at: tuple[int, int], kind: str) -> Transition:
    """A commit naming the state its holder last saw (on PostgreSQL ``commit_at`` while the
    run is still there): an execution's ending, an effect's intent, or its outcome."""
    status = "completed" if kind == "ending" else "running"
    draft = JournalState(run_id).draft(status=status, current_step=None, prune=True)
    if kind == "ending":
        return Transition(
            events=[EventWrite("run_completed")],
            run=RunUpdate(RunStatus.COMPLETED, result_json="1"),
            checkpoint=draft,
            release=True,
            at=at,
        )
    executing, key = kind == "intent", f"k-{run_id}"
    operation = (
        op_write(key, run_id=run_id, status=OperationStatus.EXECUTING, attempt=1, hold_lease=True)
        if executing
        else op_write(
            key,
            run_id=run_id,
            status=OperationStatus.SUCCEEDED,
            result_json="1",
            expect_row_version=1,
        )
    )
    step = StepWrite(
        "t#1",
        1,
        "tool",
        "t",
        StepStatus.EXECUTING if executing else StepStatus.SUCCEEDED,
        "ih",
        output_json=None if executing else "1",
        idempotency_key=key,
        settle=not executing,
    )
    return Transition(
        events=[EventWrite(f"effect_{kind}", "t#1")],
        step=step,
        operation=operation,
        checkpoint=draft,
        at=at,
    )


def before_commit_at(store: Store, lease: Lease, kind: str) -> tuple[int, int]:
    """What a commit of ``kind`` follows (an effect's outcome, its intent), committed by
    ``lease``'s holder; the state it left the run in."""
    if kind == "outcome":
        intent = at_state(lease.run_id, (0, 0), "intent")
        done = run(store.commit(lease, replace(intent, at=None)))
    else:
        done = run(store.commit(lease, Transition(events=[EventWrite("step")])))
    return (done.state_version, done.last_sequence)


@pytest.mark.parametrize("kind", ["ending", "intent", "outcome"])
def test_a_commit_at_a_known_state_applies_whole_where_the_run_is_or_not_at_all(
    store: Store, kind: str
) -> None:
    """A commit names the state its holder last saw: at that state, or at another (an event
    arrived since), it is sealed where the run really is, with its operation written once;
    under a lost lease nothing of it applies."""
    run(store.create_run(new_run()))
    old = run(store.claim_run("r1", "w1", 0.05))
    assert old is not None
    at = before_commit_at(store, old.lease, kind)
    time.sleep(0.1)
    assert run(store.claim_next("w2", 30, ["wf|1"])) is not None
    before = run(store.load_journal("r1"))
    with pytest.raises(LeaseLostError):
        run(store.commit(old.lease, at_state("r1", at, kind)))
    assert run(store.load_journal("r1")) == before

    def committed_where_the_run_is(run_id: str, stale: bool) -> None:
        run(store.create_run(new_run(run_id)))
        claim = run(store.claim_run(run_id, "w1", 30))
        assert claim is not None
        at = before_commit_at(store, claim.lease, kind)
        if stale:  # the run moved after the holder's last commit
            assert run(store.deliver_signal(run_id, "e1", "aside", "{}"))
        done = run(store.commit(claim.lease, replace(at_state(run_id, at, kind), read_back=True)))
        journal = run(store.load_journal(run_id))
        assert journal is not None
        stored = journal.run
        assert (stored.status is RunStatus.COMPLETED) == (kind == "ending")
        assert (stored.lease_owner is None) == (kind == "ending")
        assert (done.state_version, done.last_sequence) == (
            stored.state_version,
            stored.last_sequence,
        )
        # Read back in the commit's own transaction; nothing moved the run since.
        assert done.run == stored
        newest = journal.checkpoints[0]
        assert (newest.payload["state_version"], newest.payload["last_event_sequence"]) == (
            stored.state_version,
            stored.last_sequence,
        )
        assert from_stored(newest.payload, newest.checksum)
        events = [e.type for e in run(store.events(run_id))]
        assert events[-1] == ("run_completed" if kind == "ending" else f"effect_{kind}")
        assert ("event_received" in events) == stale
        if kind != "ending":
            (op,) = journal.operations
            assert done.operation_row_version == op.row_version == (1 if kind == "intent" else 2)
            assert op.status is at_state(run_id, at, kind).operation.status  # type: ignore[union-attr]
            (step,) = journal.steps
            assert (step.settled_sequence == stored.last_sequence) == (kind == "outcome")

    committed_where_the_run_is("r2", stale=False)
    committed_where_the_run_is("r3", stale=True)


def test_commit_assigns_gap_free_sequences(store: Store) -> None:
    """Events get consecutive sequences per run, across commits."""
    run(store.create_run(new_run()))
    claim = run(store.claim_run("r1", "w1", 30))
    assert claim is not None
    run(store.commit(claim.lease, Transition(events=[EventWrite("a"), EventWrite("b")])))
    done = run(store.commit(claim.lease, Transition(events=[EventWrite("c")])))
    assert done.run is None  # not read back unless asked
    assert [e.sequence for e in run(store.events("r1"))] == [1, 2, 3, 4]


@pytest.mark.parametrize("named_state", [False, True])
def test_commit_is_atomic(store: Store, named_state: bool) -> None:
    """A failed operation precondition rolls back the events, step and checkpoint with it,
    also where the commit names the state the run is at (on PostgreSQL ``commit_at`` first)."""
    run(store.create_run(new_run()))
    claim = run(store.claim_run("r1", "w1", 30))
    assert claim is not None
    intent = run(
        store.commit(claim.lease, Transition(events=[EventWrite("intent")], operation=op_write()))
    )
    before = run(store.load_journal("r1"))
    assert before is not None
    bad = Transition(
        events=[EventWrite("should_vanish")],
        step=StepWrite("t#1", 1, "tool", "t", StepStatus.SUCCEEDED, "ih", output_json="1"),
        operation=op_write(status=OperationStatus.SUCCEEDED, expect_row_version=99),
        checkpoint=JournalState("r1").draft(status="running", current_step="t#1"),
        at=(intent.state_version, intent.last_sequence) if named_state else None,
    )
    with pytest.raises(InvalidTransition):
        run(store.commit(claim.lease, bad))
    after = run(store.load_journal("r1"))
    assert after is not None
    assert after.steps == before.steps == []
    assert after.operations == before.operations
    assert after.checkpoints == before.checkpoints
    assert after.run.last_sequence == before.run.last_sequence
    assert "should_vanish" not in [e.type for e in run(store.events("r1"))]


@pytest.mark.parametrize("new_row", [False, True], ids=["upsert", "new_row"])
def test_a_commit_in_one_round_is_atomic(store: Store, database_url: str, new_row: bool) -> None:
    """A step's commit is one round (on PostgreSQL one pipeline, its own implicit
    transaction): a statement failing after the fence leaves nothing of it, fence included."""
    run(store.create_run(new_run()))
    claim = run(store.claim_run("r1", "w1", 30))
    assert claim is not None
    before = run(store.load_journal("r1"))
    assert before is not None
    execute_sql(  # a row squatting the sequence this commit's event will take
        database_url,
        "INSERT INTO durably_events (run_id, sequence, type, step_id, payload_json, created_at)"
        " VALUES (?, ?, 'squatter', NULL, '{}', 0)",
        ("r1", before.run.last_sequence + 1),
    )
    step = StepWrite(
        "s#1", 1, "step", "s", StepStatus.SUCCEEDED, "h", "1", settle=True, new_row=new_row
    )
    with pytest.raises((InvalidTransition, sqlite3.IntegrityError)):
        run(store.commit(claim.lease, Transition(events=[EventWrite("done", "s#1")], step=step)))
    after = run(store.load_journal("r1"))
    assert after is not None
    assert after.steps == []
    assert (after.run.last_sequence, after.run.state_version) == (
        before.run.last_sequence,
        before.run.state_version,
    )


def test_concurrent_commits_apply_or_refuse_each_on_its_own(store: Store) -> None:
    """Commits of several runs made at the same moment (SQLite groups them into one
    transaction): a refused one undoes only its own writes, never another run's."""
    for run_id in ("r1", "r2", "r3"):
        run(store.create_run(new_run(run_id)))
    claims = [run(store.claim_run(run_id, "w1", 30)) for run_id in ("r1", "r2", "r3")]
    assert all(c is not None for c in claims)
    leases = [c.lease for c in claims if c is not None]
    stale = replace(leases[1], epoch=leases[1].epoch - 1)
    bad = Transition(
        events=[EventWrite("intent")],
        operation=op_write("k2", run_id="r2", expect_row_version=7),
    )

    async def together() -> list[object]:
        return await asyncio.gather(
            store.commit(leases[0], Transition(events=[EventWrite("a")])),
            store.commit(stale, Transition(events=[EventWrite("lost")])),
            store.commit(leases[1], bad),
            store.commit(leases[2], Transition(events=[EventWrite("c")])),
            return_exceptions=True,
        )

    first, lost, refused, third = run(together())
    assert isinstance(lost, LeaseLostError)
    assert isinstance(refused, InvalidTransition)
    assert not isinstance(first, BaseException)
    assert not isinstance(third, BaseException)
    types = {r: [e.type for e in run(store.events(r))] for r in ("r1", "r2", "r3")}
    assert types["r1"][-1] == "a"
    assert types["r3"][-1] == "c"
    assert "lost" not in types["r2"]
    assert "intent" not in types["r2"]
    journal = run(store.load_journal("r2"))
    assert journal is not None
    assert journal.operations == []
    assert journal.run.last_sequence == len(types["r2"])


def test_operation_key_is_unique(store: Store) -> None:
    """Inserting a second operation with the same (tenant, key) is refused."""
    run(store.create_run(new_run()))
    claim = run(store.claim_run("r1", "w1", 30))
    assert claim is not None
    run(store.commit(claim.lease, Transition(events=[], operation=op_write())))
    with pytest.raises(InvalidTransition):
        run(store.commit(claim.lease, Transition(events=[], operation=op_write())))


def test_an_operation_is_found_by_its_key_whichever_run_recorded_it(store: Store) -> None:
    """``operation`` reads one operation by (tenant, key), with the origin its insert named;
    another tenant's key, or an unknown one, is nothing."""
    run(store.create_run(new_run()))
    claim = run(store.claim_run("r1", "w1", 30))
    assert claim is not None
    write = op_write(status=OperationStatus.SUCCEEDED, result_json='"ok"', origin_key="k0")
    run(store.commit(claim.lease, Transition(events=[], operation=write)))
    found = run(store.operation("default", "k1"))
    assert found is not None
    assert (found.run_id, found.status, found.result_json) == (
        "r1",
        OperationStatus.SUCCEEDED,
        '"ok"',
    )
    assert found.origin_key == "k0"
    assert run(store.operation("other", "k1")) is None
    assert run(store.operation("default", "k2")) is None


def test_operation_update_is_conditional_on_row_version(store: Store) -> None:
    """Two writers holding the same row version: only the first update applies."""
    run(store.create_run(new_run()))
    claim = run(store.claim_run("r1", "w1", 30))
    assert claim is not None
    step = StepWrite("t#1", 1, "tool", "t", StepStatus.INTENT_RECORDED, "ih", idempotency_key="k1")
    done = run(store.commit(claim.lease, Transition(events=[], operation=op_write(), step=step)))
    assert done.operation_row_version == 1
    claim_op = op_write(status=OperationStatus.EXECUTING, expect_row_version=1, hold_lease=True)
    second = run(store.commit(claim.lease, Transition(events=[], operation=claim_op)))
    assert second.operation_row_version == 2
    with pytest.raises(InvalidTransition):
        run(store.commit(claim.lease, Transition(events=[], operation=claim_op)))
    journal = run(store.load_journal("r1"))
    assert journal is not None
    (op,) = journal.operations
    assert op.status is OperationStatus.EXECUTING
    assert op.lease_owner == "w1"


def test_checkpoint_is_sealed_with_sequence_and_checksum(store: Store) -> None:
    """The stored checkpoint carries the commit's last sequence and a valid checksum."""
    run(store.create_run(new_run()))
    claim = run(store.claim_run("r1", "w1", 30))
    assert claim is not None
    state = JournalState("r1")
    state.settle("s#1", sha256_hex('{"a":1}'))
    committed = run(
        store.commit(
            claim.lease,
            Transition(
                events=[EventWrite("step_succeeded", "s#1")],
                step=StepWrite(
                    "s#1",
                    1,
                    "step",
                    "s",
                    StepStatus.SUCCEEDED,
                    "ih",
                    output_json='{"a":1}',
                    settle=True,
                ),
                checkpoint=state.draft(status="running", current_step="s#1"),
            ),
        )
    )
    (stored,) = run(store.checkpoints("r1"))
    cp = from_stored(stored.payload, stored.checksum)
    assert cp.last_event_sequence == committed.last_sequence
    assert cp.state_version == committed.state_version
    assert cp.journal_length == 1
    assert cp.current_step == "s#1"
    journal = run(store.load_journal("r1"))
    assert journal is not None
    assert journal.steps[0].settled_sequence == committed.last_sequence


def test_operator_guard_requires_unchanged_unleased_run(store: Store) -> None:
    """An Expect guard fails while a worker holds the run or after the run changed."""
    record, _ = run(store.create_run(new_run()))
    claim = run(store.claim_run("r1", "w1", 30))
    assert claim is not None
    with pytest.raises(InvalidTransition):
        run(store.commit(Expect("r1", record.state_version), Transition(events=[])))
    run(
        store.commit(
            claim.lease, Transition(events=[], run=RunUpdate(RunStatus.PAUSED), release=True)
        )
    )
    current = run(store.get_run("r1"))
    assert current is not None
    assert current.lease_owner is None
    run(
        store.commit(
            Expect("r1", current.state_version),
            Transition(events=[EventWrite("resolved")], run=RunUpdate(RunStatus.QUEUED)),
        )
    )
    with pytest.raises(InvalidTransition):
        run(store.commit(Expect("r1", current.state_version), Transition(events=[])))


def test_paused_and_waiting_runs_are_not_claimed(store: Store) -> None:
    """Only queued, running and reconciling runs are runnable."""
    run(store.create_run(new_run()))
    claim = run(store.claim_run("r1", "w1", 30))
    assert claim is not None
    run(
        store.commit(
            claim.lease, Transition(events=[], run=RunUpdate(RunStatus.PAUSED), release=True)
        )
    )
    assert run(store.claim_next("w2", 30, ["wf|1"])) is None
    assert run(store.next_wakeup(["wf|1"])) is None


def test_a_pause_asked_while_held_is_kept_by_the_wait_the_holder_commits(store: Store) -> None:
    """A holder learns of a pause only from its commits: one asked just before it commits
    a wait pauses the run instead of letting it wait (a cancel would go first)."""
    run(store.create_run(new_run()))
    claim = run(store.claim_run("r1", "w1", 30))
    assert claim is not None
    request = '{"type": "OperatorPause", "message": "paused by ana", "by": "ana"}'
    asked = run(store.request_pause("r1", request))
    assert (asked.status, asked.pause_requested) == (
        RunStatus.RUNNING,
        {"type": "OperatorPause", "message": "paused by ana", "by": "ana"},
    )
    assert run(store.request_pause("r1", request)) == asked  # asked twice: nothing more
    waiting = RunUpdate(RunStatus.WAITING_EXTERNAL, waiting_for={"event": "paid"})
    committed = run(store.commit(claim.lease, Transition(events=[], run=waiting, release=True)))
    assert committed.pause_requested is not None
    paused = run(store.get_run("r1"))
    assert paused is not None
    assert (paused.status, paused.status_reason) == (RunStatus.PAUSED, "operator_pause")
    assert paused.waiting_for == {"event": "paid"}
    assert paused.error is not None
    assert paused.error["by"] == "ana"
    assert [e.type for e in run(store.events("r1"))] == ["run_started", "pause_requested"]
    assert run(store.claim_next("w2", 30, ["wf|1"])) is None
    queued = run(store.withdraw_pause("r1", "ana"))
    assert (queued.status, queued.pause_requested, queued.error) == (RunStatus.QUEUED, None, None)
    assert run(store.claim_next("w2", 30, ["wf|1"])) is not None


def test_list_runs_filters(store: Store) -> None:
    run(store.create_run(new_run("a", "wf")))
    run(store.create_run(new_run("b", "other")))
    assert {r.run_id for r in run(store.list_runs())} == {"a", "b"}
    assert [r.run_id for r in run(store.list_runs(workflow="other"))] == ["b"]
    assert run(store.list_runs(status=RunStatus.COMPLETED)) == []


def test_newer_schema_is_refused(
    store: Store, database_url: str, bump_schema: Callable[[str], None]
) -> None:
    """A database migrated by newer code is refused with SchemaTooNew, and left untouched."""
    bump_schema(database_url)
    newer = open_store(database_url)
    with pytest.raises(SchemaTooNew):
        run(newer.migrate())
    run(newer.close())


def test_ledger_figures_are_read_from_what_was_recorded(store: Store) -> None:
    """What the ledger metrics read: unknown or reconciling operations per tool, duplicates
    reconciliations found, forks blocked, approvals that ran out."""
    run(store.create_run(new_run()))
    claim = run(store.claim_run("r1", "w1", 30))
    assert claim is not None
    assert run(store.ledger_figures()) == LedgerFigures()
    step = StepWrite("t#1", 1, "tool", "t", StepStatus.UNKNOWN, "ih", idempotency_key="k1")
    now = run(store.now())
    gone = ApprovalRequest("a1", "t#1", "tool", "t", "{}", "ih", "k1", 1, now - 1)
    reconciled = [
        EventWrite("effect_reconciled", "t#1", {"tool": "t", "duplicates": 2}),
        EventWrite("effect_reconciled", "u#1", {"tool": "u", "answer": "failed"}),
        EventWrite("effect_reconciled", "t#2", {"tool": "t", "duplicates": 1}),
        EventWrite("effect_reconciled", "t#3", {"tool": "t", "duplicates": 0}),
        EventWrite("run_paused", None, {"reason": "replay_blocked", "type": "ReplayBlocked"}),
        EventWrite("run_paused", None, {"reason": "effect_state_unknown"}),
    ]
    run(
        store.commit(
            claim.lease,
            Transition(
                events=reconciled,
                step=step,
                operation=op_write(status=OperationStatus.UNKNOWN),
                request_approvals=(gone,),
            ),
        )
    )
    _, expired = run(store.decide_approval("r1", "a1", "approved", "ann", None))
    assert expired
    figures = run(store.ledger_figures())
    ((tool, (count, since)),) = figures.unresolved.items()
    assert (tool, count) == ("t", 1)
    assert since <= time.time()
    assert figures.duplicates == {"t": 3}
    assert (figures.replays_blocked, figures.approvals_expired) == (1, 1)
