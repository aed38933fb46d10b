"""Batch claims (``Store.claim_batch``): several runs in one transaction, each leased as
``claim_next`` would lease it, none to two claimers."""

from __future__ import annotations

import asyncio
import threading
import time

import psycopg
import pytest

from durably.errors import LeaseLostError
from durably.status import RunStatus, StepStatus
from durably.store import open_store
from durably.store.base import EventWrite, RunUpdate, StepWrite, Store, Transition
from tests.contract.test_store import new_run, run, store  # noqa: F401 - the fixture

WORKFLOWS = ["wf|1"]


def test_a_batch_leases_up_to_its_limit_oldest_first(store: Store) -> None:  # noqa: F811
    for i in range(5):
        run(store.create_run(new_run(f"r{i}")))
    run(store.create_run(new_run("other", workflow="not-mine")))
    first = run(store.claim_batch("w1", 30, WORKFLOWS, 3))
    assert [c.run.run_id for c in first] == ["r0", "r1", "r2"]
    for claim in first:
        assert claim.run.status is RunStatus.RUNNING
        assert claim.run.lease_owner == "w1"
        assert claim.lease.epoch == claim.run.lease_epoch == 1
        assert not claim.recovered
    # Held runs are nobody else's, in a batch or one at a time.
    assert run(store.claim_next("w2", 30, WORKFLOWS)) is not None  # r3
    rest = run(store.claim_batch("w2", 30, WORKFLOWS, 10))
    assert [c.run.run_id for c in rest] == ["r4"]
    assert run(store.claim_batch("w2", 30, WORKFLOWS, 10)) == []
    assert run(store.claim_batch("w2", 30, WORKFLOWS, 0)) == []
    assert run(store.claim_batch("w2", 30, [], 10)) == []
    # Each claimed run's lease works like any other: its holder commits.
    run(store.commit(first[0].lease, Transition(events=[EventWrite("mine")])))


def test_each_claim_carries_its_runs_journal_as_its_transaction_left_it(
    store: Store,  # noqa: F811
) -> None:
    """A claim reads each run's journal in its own transaction: the new holder needs no read
    of its own, and a recovered run's journal already holds its ``run_recovered``."""
    for i in range(3):
        run(store.create_run(new_run(f"r{i}")))
    held = run(store.claim_run("r1", "w1", 0.05))
    assert held is not None
    step = StepWrite("s#1", 1, "step", "s", StepStatus.SUCCEEDED, "h", "1", settle=True)
    run(store.commit(held.lease, Transition(events=[EventWrite("done", "s#1")], step=step)))
    time.sleep(0.1)
    claims = sorted(run(store.claim_batch("w2", 30, WORKFLOWS, 10)), key=lambda c: c.run.run_id)
    assert [c.run.run_id for c in claims] == ["r0", "r1", "r2"]
    for claim in claims:
        assert claim.journal is not None
        assert claim.journal == run(store.load_journal(claim.run.run_id))
        assert claim.journal.run.lease_owner == "w2"
    recovered = claims[1].journal
    assert recovered is not None
    assert [s.step_id for s in recovered.steps] == ["s#1"]
    assert [e.type for e in recovered.recent_events][-1] == "run_recovered"
    assert claims[0].journal is not None
    assert claims[0].journal.steps == []


def test_a_batch_recovers_expired_leases_and_fences_their_old_holder(
    store: Store,  # noqa: F811
) -> None:
    old = []
    for i in range(3):
        run(store.create_run(new_run(f"r{i}")))
        claim = run(store.claim_run(f"r{i}", "w1", 0.05))
        assert claim is not None
        old.append(claim)
    time.sleep(0.1)
    claims = run(store.claim_batch("w2", 30, WORKFLOWS, 10))
    assert sorted(c.run.run_id for c in claims) == ["r0", "r1", "r2"]
    for claim, before in zip(sorted(claims, key=lambda c: c.run.run_id), old, strict=True):
        assert claim.recovered
        assert claim.previous_lease_until == pytest.approx(before.run.lease_until)
        assert claim.lease.epoch == before.lease.epoch + 1
        with pytest.raises(LeaseLostError):
            run(store.commit(before.lease, Transition(events=[EventWrite("late")])))
        with pytest.raises(LeaseLostError):
            run(store.heartbeat(before.lease))
        run(store.commit(claim.lease, Transition(events=[EventWrite("new holder")])))
        events = run(store.events(claim.run.run_id))
        assert [e.type for e in events] == ["run_started", "run_recovered", "new holder"]
        assert [e.sequence for e in events] == [1, 2, 3]
        assert events[1].payload["previous_owner"] == "w1"


def test_racing_batch_claimers_never_hold_the_same_run(
    store: Store,  # noqa: F811
) -> None:
    """Three claimers, each on its own connection and thread, take batches until nothing
    is left: every run is claimed exactly once, at epoch 1."""
    runs = 60
    for i in range(runs):
        run(store.create_run(new_run(f"r{i:03d}")))
    taken: list[list[tuple[str, int]]] = [[] for _ in range(3)]
    failures: list[BaseException] = []
    start = threading.Barrier(3)

    async def claimer(me: int) -> None:
        mine = open_store(store.url)
        try:
            start.wait()
            empty = 0
            while empty < 3:
                claims = await mine.claim_batch(f"w{me}", 30, WORKFLOWS, 4)
                taken[me] += [(c.run.run_id, c.lease.epoch) for c in claims]
                empty = 0 if claims else empty + 1
                await asyncio.sleep(0)
        finally:
            await mine.close()

    def thread(me: int) -> None:
        try:
            asyncio.run(claimer(me))
        except BaseException as exc:  # reported below, on the test's thread
            failures.append(exc)

    threads = [threading.Thread(target=thread, args=(me,)) for me in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not failures, failures
    claimed = [run_id for mine in taken for run_id, _ in mine]
    assert sorted(claimed) == [f"r{i:03d}" for i in range(runs)]
    assert {epoch for mine in taken for _, epoch in mine} == {1}
    owners = {r.run_id: r.lease_owner for r in run(store.list_runs(limit=runs))}
    for me, mine in enumerate(taken):
        assert all(owners[run_id] == f"w{me}" for run_id, _ in mine)


def test_a_held_run_is_due_again_when_its_lease_runs_out(store: Store) -> None:  # noqa: F811
    """A claim and each heartbeat make a run due when the lease they give runs out, so a
    claim never walks the runs other workers hold; a commit extends the lease alone (the
    run is due no later than its lease runs out). A release, or its owner found dead, makes
    it due at once."""
    for i in range(3):
        run(store.create_run(new_run(f"r{i}")))
    claims = run(store.claim_batch("w1", 30, WORKFLOWS, 3))
    for claim in claims:
        assert claim.run.available_at == claim.run.lease_until
    r0, r1, r2 = (c.lease for c in claims)

    def held(run_id: str) -> tuple[float, float]:
        r = run(store.get_run(run_id))
        assert r is not None
        assert r.lease_until is not None
        return r.available_at, r.lease_until

    time.sleep(0.05)
    until = run(store.heartbeat(r0))
    assert held("r0") == (until, until)
    due, _ = held("r0")
    time.sleep(0.05)
    run(store.commit(r0, Transition(events=[EventWrite("mine")])))
    assert held("r0")[0] == due < held("r0")[1]
    assert run(store.claim_batch("w2", 30, WORKFLOWS, 3)) == []
    # Released by its holder, or its holder found dead: due now, claimed at once.
    run(store.commit(r1, Transition(events=[EventWrite("handed_over")], release=True)))
    assert run(store.expire_leases(["w1"])) == 2
    again = run(store.claim_batch("w2", 30, WORKFLOWS, 3))
    assert sorted(c.run.run_id for c in again) == ["r0", "r1", "r2"]
    assert [c.recovered for c in sorted(again, key=lambda c: c.run.run_id)] == [
        True,
        False,
        True,
    ]
    with pytest.raises(LeaseLostError):
        run(store.heartbeat(r2))


def test_an_idle_worker_wakes_when_the_next_run_is_due(store: Store) -> None:  # noqa: F811
    """``next_wakeup``: the earliest timer of a waiting run, not later because runs are held
    (their leases, heartbeated, run out later still), and now once a lease has run out."""
    for i in range(3):
        run(store.create_run(new_run(f"r{i}")))
    waiting, held, paused = run(store.claim_batch("w1", 600, WORKFLOWS, 3))
    timer = run(store.now()) + 100

    def wakes_in() -> float:
        due = run(store.next_wakeup(WORKFLOWS))
        assert due is not None
        return due - time.time()

    wait = RunUpdate(RunStatus.WAITING_EXTERNAL, available_at=timer)
    run(store.commit(waiting.lease, Transition(events=[], run=wait, release=True)))
    pause = RunUpdate(RunStatus.PAUSED)
    run(store.commit(paused.lease, Transition(events=[], run=pause, release=True)))
    run(store.heartbeat(held.lease))
    assert 98 < wakes_in() <= 100
    run(store.expire_leases(["w1"]))  # the holder found dead: due now
    assert wakes_in() <= 0


def test_a_dead_holders_runs_are_due_once_their_leases_run_out(store: Store) -> None:  # noqa: F811
    """Whatever the holder wrote last (a heartbeat, commits, a new status) and whatever an
    operator asked meanwhile (a cancel, a pause, an event), a run whose holder died is
    claimed once its lease has run out, and not before."""
    for run_id in ("steps", "cancel", "pause", "event"):
        run(store.create_run(new_run(run_id)))
    # Long enough that the writes below all come before any of these leases runs out.
    claims = {c.run.run_id: c for c in run(store.claim_batch("w1", 2.0, WORKFLOWS, 4))}
    time.sleep(0.1)
    lease = claims["steps"].lease
    run(store.heartbeat(lease))
    time.sleep(0.1)
    run(store.commit(lease, Transition(events=[EventWrite("a")])))
    reconciling = RunUpdate(RunStatus.RECONCILING)
    run(store.commit(lease, Transition(events=[EventWrite("b")], run=reconciling)))
    run(store.request_cancel("cancel", compensate=False))
    run(store.request_pause("pause", '{"by": "op"}'))
    run(store.deliver_signal("event", "e1", "go", "{}"))
    # The holder dies here.
    leases = {}
    for run_id in claims:
        r = run(store.get_run(run_id))
        assert r is not None
        assert r.lease_until is not None
        assert r.available_at <= r.lease_until
        leases[run_id] = r.lease_until
    assert run(store.claim_batch("w2", 30, WORKFLOWS, 10)) == []
    while run(store.now()) <= max(leases.values()):
        time.sleep(0.01)
    time.sleep(0.02)
    taken = run(store.claim_batch("w2", 30, WORKFLOWS, 10))
    assert {c.run.run_id for c in taken} == set(claims)
    assert all(c.recovered for c in taken)


def test_a_commit_behind_a_lock_never_shortens_the_lease(postgres_schema: str) -> None:
    """On PostgreSQL the writes of several runs share one round, one transaction whose
    now() is its start. A run's fence that waits behind another run's row lock applies
    after that run's own heartbeat, which started later: the lease stays the heartbeat's
    (its holder counts on it), and the run is due when it runs out."""
    from tests.conftest import postgres_schema_url

    url = postgres_schema_url(postgres_schema)

    async def scenario() -> tuple[float, float, float, bool]:
        s = open_store(url)
        await s.migrate()
        try:
            for run_id in ("a", "x"):
                await s.create_run(new_run(run_id))
            claims = {c.run.run_id: c for c in await s.claim_batch("w1", 2.0, WORKFLOWS, 2)}
            # Another transaction holds run a's row (an operator's, say).
            other = await psycopg.AsyncConnection.connect(url)
            await other.execute("SELECT 1 FROM durably_runs WHERE run_id = 'a' FOR UPDATE")
            # Both holders' step commits are ready together: one round, a's first.
            steps = [
                asyncio.create_task(s.commit(claims[r].lease, Transition([EventWrite("s")])))
                for r in ("a", "x")
            ]
            await asyncio.sleep(0.5)
            renewed = await s.heartbeat(claims["x"].lease)
            await asyncio.sleep(0.5)
            await other.commit()
            await other.close()
            await asyncio.gather(*steps)
            x = await s.get_run("x")
            assert x is not None
            assert x.lease_until is not None
            # x's holder dies here: once its lease has run out, another worker claims it.
            while await s.now() <= x.lease_until + 0.05:
                await asyncio.sleep(0.01)
            taken = await s.claim_batch("w2", 30, WORKFLOWS, 10)
            return renewed, x.lease_until, x.available_at, "x" in {c.run.run_id for c in taken}
        finally:
            await s.close()

    renewed, lease_until, available_at, taken = asyncio.run(scenario())
    assert lease_until >= renewed
    assert available_at <= lease_until
    assert taken
