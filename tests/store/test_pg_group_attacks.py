"""Group commit (``store.pg_group``) and ``commit_at`` attacked on a real PostgreSQL: shared
rounds that deadlock with another store's, rounds whose connection is cut while the server
still holds them, operators' writes racing a commit at a known state. Every outcome is
read back from the database's own rows: a write reported done appears exactly once, a
write reported refused left nothing, and a write whose outcome is unknown is never
reported as either."""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import stat
import time
from dataclasses import replace

import psycopg
import pytest

from durably.checkpoint import JournalState, from_stored
from durably.errors import InvalidTransition, LeaseLostError, StoreUnavailable
from durably.status import OperationStatus, RunStatus, StepStatus
from durably.store.base import (
    Committed,
    EventWrite,
    Lease,
    NewRun,
    OperationWrite,
    RunUpdate,
    StepWrite,
    Transition,
)
from durably.store.postgres import PostgresStore
from tests.conftest import postgres_schema_url
from tests.contract.test_store import op_write
from tests.store.test_pg_group import sql, step, store_with_runs


async def until_waiting_for_locks(schema: str, count: int) -> None:
    """Until ``count`` backends of this database wait for a lock (a round held on the server)."""
    deadline = time.monotonic() + 10
    while True:
        ((waiting,),) = sql(
            schema,
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND datname = current_database()",
        )
        if waiting >= count:
            return
        assert time.monotonic() < deadline, f"{waiting} of {count} rounds reached the server"
        await asyncio.sleep(0.01)


def events_of(schema: str, run_id: str) -> list[tuple[int, str]]:
    return [
        (int(s), str(t))  # type: ignore[call-overload]
        for s, t in sql(
            schema,
            "SELECT sequence, type FROM durably_events WHERE run_id = %s ORDER BY sequence",
            run_id,
        )
    ]


def run_row(schema: str, run_id: str) -> tuple[int, int]:
    ((state_version, last_sequence),) = sql(
        schema, "SELECT state_version, last_sequence FROM durably_runs WHERE run_id = %s", run_id
    )
    return int(state_version), int(last_sequence)  # type: ignore[call-overload]


def operation(key: str, run_id: str, **changes: object) -> OperationWrite:
    """An operation being executed under the run's lease (the contract tests' own write)."""
    executing: dict[str, object] = {
        "status": OperationStatus.EXECUTING,
        "attempt": 1,
        "hold_lease": True,
    }
    return op_write(key, run_id=run_id, **{**executing, **changes})


def intent(run_id: str, at: tuple[int, int], key: str | None = None) -> Transition:
    """An effect's intent at the state its holder last saw (``commit_at`` on PostgreSQL)."""
    key = key or f"k-{run_id}"
    return Transition(
        events=[EventWrite("effect_intent", "t#1")],
        step=StepWrite("t#1", 1, "tool", "t", StepStatus.EXECUTING, "ih", idempotency_key=key),
        operation=operation(key, run_id),
        checkpoint=JournalState(run_id).draft(status="running", current_step="t#1"),
        at=at,
    )


def ending(run_id: str, at: tuple[int, int]) -> Transition:
    return Transition(
        events=[EventWrite("run_completed")],
        run=RunUpdate(RunStatus.COMPLETED, result_json="1"),
        checkpoint=JournalState(run_id).draft(status="completed", current_step=None, prune=True),
        release=True,
        at=at,
    )


def assert_sealed_where_the_run_is(schema: str, run_id: str, done: Committed) -> None:
    """The commit's answer, the run's row and the newest checkpoint agree, the checkpoint
    is intact, and the run's events run 1, 2, 3... without a gap or a repeat."""
    assert run_row(schema, run_id) == (done.state_version, done.last_sequence)
    ((payload, checksum),) = sql(
        schema,
        "SELECT payload_json, checksum FROM durably_checkpoints WHERE run_id = %s "
        "ORDER BY state_version DESC LIMIT 1",
        run_id,
    )

    sealed = json.loads(str(payload))
    assert (sealed["state_version"], sealed["last_event_sequence"]) == (
        done.state_version,
        done.last_sequence,
    )
    assert from_stored(sealed, str(checksum))
    sequences = [s for s, _ in events_of(schema, run_id)]
    assert sequences == list(range(1, done.last_sequence + 1))


# -- deadlocks between two stores' shared rounds --------------------------------------


def deadlocks(schema: str) -> int:
    ((n,),) = sql(
        schema, "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"
    )
    return int(n)  # type: ignore[call-overload]


def test_shared_rounds_of_two_stores_that_deadlock_both_commit_once(postgres_schema: str) -> None:
    """Two stores (two processes, say) each send one shared round for the same two runs, in
    opposite orders: the first waits for a lock on r0, the second takes r1 and waits behind
    it; once r0 is free they deadlock, the server refuses one round, and its writes go
    again alone. Every write applies exactly
    once; nothing hangs."""
    url = postgres_schema_url(postgres_schema)
    deadlocks_before = deadlocks(postgres_schema)

    async def main() -> list[object]:
        async with store_with_runs(postgres_schema, 2) as (a, (l0, l1)):
            b = PostgresStore(url)
            try:
                with psycopg.connect(url) as holder:
                    holder.execute("SELECT 1 FROM durably_runs WHERE run_id = 'r0' FOR UPDATE")
                    first = asyncio.gather(
                        a.commit(l0, step("a0")), a.commit(l1, step("a1")), return_exceptions=True
                    )
                    await until_waiting_for_locks(postgres_schema, 1)  # a: r0 first
                    second = asyncio.gather(
                        b.commit(l1, step("b1")), b.commit(l0, step("b0")), return_exceptions=True
                    )
                    await until_waiting_for_locks(postgres_schema, 2)  # b: r1 held, r0 next
                    holder.commit()  # a takes r0, then waits for b's r1: a deadlock
                    return [*await asyncio.wait_for(first, 15), *await asyncio.wait_for(second, 15)]
            finally:
                await b.close()

    outcomes = asyncio.run(main())
    assert not [o for o in outcomes if isinstance(o, BaseException)], outcomes
    for run_id, mine in (("r0", {"a0", "b0"}), ("r1", {"a1", "b1"})):
        written = events_of(postgres_schema, run_id)
        assert {t for _, t in written if t in mine} == mine
        assert [s for s, _ in written] == list(range(1, len(written) + 1))
        assert len(written) == 1 + len(mine)  # run_started, then each write once
    deadline = time.monotonic() + 10  # a backend reports its statistics when idle or gone
    while deadlocks(postgres_schema) == deadlocks_before:
        assert time.monotonic() < deadline, "the two rounds never deadlocked"
        time.sleep(0.05)


# -- an operator's write racing a commit at a known state ------------------------------


@pytest.mark.parametrize("first", ["operator", "holder"])
@pytest.mark.parametrize("operator", ["signal", "pause", "cancel"])
def test_an_operators_write_racing_a_commit_at_a_known_state_is_never_lost(
    postgres_schema: str, operator: str, first: str
) -> None:
    """The run's holder commits an effect's intent at the state it last saw while an
    operator delivers an event, asks for a pause or a cancel: both queue on the run's row.
    Whichever goes first, both apply once, the commit is sealed where the run really was
    (after the operator's write, if that went first), and a pause or cancel that went
    first reaches the holder in the commit's answer."""

    async def main() -> tuple[Committed, object]:
        async with store_with_runs(postgres_schema, 1) as (store, (lease,)):
            at = run_row(postgres_schema, "r0")

            def operators_write() -> asyncio.Future[object]:
                if operator == "signal":
                    return asyncio.ensure_future(store.deliver_signal("r0", "e1", "n", "{}"))
                if operator == "pause":
                    return asyncio.ensure_future(store.request_pause("r0", '{"by": "op"}'))
                return asyncio.ensure_future(store.request_cancel("r0", compensate=False))

            with psycopg.connect(postgres_schema_url(postgres_schema)) as holder:
                holder.execute("SELECT 1 FROM durably_runs WHERE run_id = 'r0' FOR UPDATE")
                if first == "operator":
                    other = operators_write()
                    await until_waiting_for_locks(postgres_schema, 1)
                commit = asyncio.ensure_future(store.commit(lease, intent("r0", at)))
                if first == "holder":
                    await until_waiting_for_locks(postgres_schema, 1)
                    other = operators_write()
                await until_waiting_for_locks(postgres_schema, 2)
                holder.commit()
                done = await asyncio.wait_for(commit, 10)
                return done, await asyncio.wait_for(other, 10)

    done, _ = asyncio.run(main())
    written = events_of(postgres_schema, "r0")
    assert [t for _, t in written].count("effect_intent") == 1
    assert [s for s, _ in written] == list(range(1, len(written) + 1))
    assert len(written) == (3 if operator in ("signal", "pause") else 2)
    ((payload, checksum),) = sql(
        postgres_schema,
        "SELECT payload_json, checksum FROM durably_checkpoints WHERE run_id = 'r0' "
        "AND state_version = %s",
        done.state_version,
    )

    sealed = json.loads(str(payload))
    assert (sealed["state_version"], sealed["last_event_sequence"]) == (
        done.state_version,
        done.last_sequence,
    )
    assert from_stored(sealed, str(checksum))
    intent_at = next(s for s, t in written if t == "effect_intent")
    assert done.last_sequence == intent_at
    ((row_version,),) = sql(postgres_schema, "SELECT row_version FROM durably_tool_operations")
    assert row_version == done.operation_row_version == 1
    if first == "operator":
        assert intent_at == written[-1][0]
        assert (done.pause_requested is not None) == (operator == "pause")
        assert (done.cancel_requested > 0) == (operator == "cancel")
    else:
        assert intent_at == 2
        assert done.pause_requested is None
        assert done.cancel_requested == 0
    if first == "holder":  # the operator's write came after: the run moved on from the commit
        assert run_row(postgres_schema, "r0") >= (done.state_version, done.last_sequence)


# -- a shared round cut off while the server holds it --------------------------------


def cut_client_side(port: int) -> None:
    """Shut down this process's socket whose local port is ``port`` (a pooled connection's),
    as a network failure would: libpq reads the end of the stream, the server learns
    nothing until it writes."""
    for fd in map(int, os.listdir("/proc/self/fd")):
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
        except OSError:  # the directory's own descriptor, gone by now
            continue
        s = socket.socket(fileno=os.dup(fd))
        try:
            if s.family in (socket.AF_INET, socket.AF_INET6) and s.getsockname()[1] == port:
                s.shutdown(socket.SHUT_RDWR)
                return
        except OSError:
            pass
        finally:
            s.close()
    raise AssertionError(f"no socket of ours on port {port}")


async def until_gone(schema: str, pid: int) -> None:
    """Until the backend ``pid`` has ended (a cut round's, once it ran or was ended)."""
    deadline = time.monotonic() + 10
    while sql(schema, "SELECT 1 FROM pg_stat_activity WHERE pid = %s", pid):
        assert time.monotonic() < deadline, f"backend {pid} lives on"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("cut", ["client", "server"])
def test_a_shared_round_cut_off_is_never_reported_as_done_or_refused_wrongly(
    postgres_schema: str, cut: str
) -> None:
    """A shared round of a step's commit, an effect's intent (``commit_at``) and a new
    run's start is held on the server by a lock on the first run's row, and its connection
    is cut: by the network (``client``: the server still runs the round once the lock
    goes, and commits it) or by the server (``server``: the backend is ended, nothing of
    the round applies). Whatever each caller is told must be what the rows show: done
    means written once, refused means not written, unknown (StoreUnavailable) either;
    never twice."""
    url = postgres_schema_url(postgres_schema)
    new = NewRun("n1", "default", "wf", "1", {}, "{}", "h", 2)

    async def main() -> list[object]:
        async with store_with_runs(postgres_schema, 2) as (store, (l0, l1)):
            at = run_row(postgres_schema, "r1")
            with psycopg.connect(url) as holder:
                holder.execute("SELECT 1 FROM durably_runs WHERE run_id = 'r0' FOR UPDATE")
                outcomes = asyncio.gather(
                    store.commit(l0, step("x")),
                    store.commit(l1, intent("r1", at)),
                    store.start_run(new, "w1", 30),
                    return_exceptions=True,
                )
                await until_waiting_for_locks(postgres_schema, 1)
                ((pid, port),) = sql(
                    postgres_schema,
                    "SELECT pid, client_port FROM pg_stat_activity "
                    "WHERE wait_event_type = 'Lock' AND datname = current_database()",
                )
                if cut == "client":
                    cut_client_side(int(port))  # type: ignore[call-overload]
                    # Nothing it waits for needs r0: a write that went again alone would.
                    await asyncio.wait({outcomes}, timeout=10)
                    held_back = not outcomes.done()
                    holder.commit()
                    assert not held_back, "a write of the cut round went again, behind r0"
                else:
                    sql(postgres_schema, "SELECT pg_terminate_backend(%s)", pid)
                    await until_gone(postgres_schema, int(pid))  # type: ignore[call-overload]
                    holder.commit()
                answered = await asyncio.wait_for(outcomes, 10)
            await until_gone(postgres_schema, int(pid))  # type: ignore[call-overload]
            return answered

    stepped, intended, started = asyncio.run(main())
    applied_step = [t for _, t in events_of(postgres_schema, "r0")].count("x")
    applied_intent = [t for _, t in events_of(postgres_schema, "r1")].count("effect_intent")
    operations = sql(postgres_schema, "SELECT run_id, row_version FROM durably_tool_operations")
    assert len(operations) == applied_intent
    started_events = [t for _, t in events_of(postgres_schema, "n1")]
    assert started_events == ["run_started"]  # one start, however it was reported
    for told, applied in ((stepped, applied_step), (intended, applied_intent)):
        assert applied in (0, 1)
        if isinstance(told, StoreUnavailable):
            continue  # unknown: either is right, the holder reads the run back
        assert not isinstance(told, BaseException) or isinstance(
            told, (InvalidTransition, LeaseLostError)
        ), told
        assert applied == (0 if isinstance(told, BaseException) else 1), (told, applied)
    assert not isinstance(started, BaseException), started
    if cut == "client":  # the server ran the round after all: both are written
        assert (applied_step, applied_intent) == (1, 1)
        assert isinstance(stepped, StoreUnavailable)
        assert isinstance(intended, StoreUnavailable)


# -- many runs' commits, seeded refusals ---------------------------------------------


SQUAT = (
    "INSERT INTO durably_events (run_id, sequence, type, step_id, payload_json, created_at) "
    "VALUES (%s, %s, 'squatter', NULL, '{}', 0)"
)


class Wave:
    """The runs' commits drawn for one wave, each with what it meets on the server."""

    def __init__(self, store: PostgresStore, schema: str, squatter: Lease, number: int) -> None:
        self.store, self.schema, self.squatter, self.number = store, schema, squatter, number
        self.commits: list[tuple[Lease, str, Transition]] = []
        self.squats: list[tuple[str, int]] = []

    async def draw(self, lease: Lease, kind: str, at: tuple[int, int]) -> None:
        run_id, event = lease.run_id, f"w{self.number}"
        key = f"k-{run_id}-{self.number}"
        t = step(event)
        if kind != "step":
            t = replace(intent(run_id, at, key), events=[EventWrite(event, "t#1")])
        if kind == "stale":  # the run moves on: the holder's state is stale
            assert await self.store.deliver_signal(run_id, f"e{self.number}", "n", "{}")
        elif kind == "taken_key":  # another run recorded this operation first
            taken = intent(self.squatter.run_id, (0, 0), key)
            await self.store.commit(self.squatter, replace(taken, at=None))
        elif kind == "squatted":  # a stray row takes the sequence of the commit's event
            sequence = run_row(self.schema, run_id)[1] + 1
            self.squats.append((run_id, sequence))
            sql(self.schema, SQUAT, run_id, sequence)
        elif kind == "stolen":  # the lease ran out and another owner claimed the run
            sql(
                self.schema,
                "UPDATE durably_runs SET lease_owner = 'w2', lease_epoch = lease_epoch + 1 "
                "WHERE run_id = %s",
                run_id,
            )
        self.commits.append((lease, kind, t))

    async def commit(self) -> list[object]:
        answers = asyncio.gather(
            *(self.store.commit(lease, t) for lease, _, t in self.commits),
            return_exceptions=True,
        )
        try:
            return await asyncio.wait_for(answers, 15)
        finally:
            for run_id, sequence in self.squats:  # gone again: the run goes on
                sql(
                    self.schema,
                    "DELETE FROM durably_events WHERE run_id = %s AND sequence = %s",
                    run_id,
                    sequence,
                )


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_many_runs_commit_together_each_applied_once_or_refused_whole(
    postgres_schema: str, seed: int
) -> None:
    """Waves of commits of many runs at once through one store (shared rounds), each run's
    commit drawn at random: a step, an effect's intent at the state its holder saw, the
    same at a state the run has left (an event arrived), an intent whose operation another
    run recorded first, a commit whose event's sequence a stray row took, a commit under a
    lease another owner took. Each caller's answer and the rows agree: what succeeded is
    written once, sealed where the run is; what was refused left nothing."""
    rng = random.Random(seed)
    kinds = ["step", "intent", "stale", "taken_key", "squatted", "stolen"]
    expected: dict[str, list[str]] = {}
    operations: dict[str, int] = {}

    async def main() -> None:
        async with store_with_runs(postgres_schema, 11) as (store, leases):
            squatter = leases.pop()  # records the operations the others then find taken
            at = {lease.run_id: run_row(postgres_schema, lease.run_id) for lease in leases}
            expected.update({lease.run_id: ["run_started"] for lease in leases})
            live = list(leases)
            for number in range(6):
                wave = Wave(store, postgres_schema, squatter, number)
                for lease in live:
                    await wave.draw(lease, rng.choice(kinds), at[lease.run_id])
                answers = await wave.commit()
                for (lease, kind, _), answer in zip(wave.commits, answers, strict=True):
                    run_id = lease.run_id
                    if kind == "stale":
                        expected[run_id].append("event_received")
                    if kind == "stolen":
                        assert isinstance(answer, LeaseLostError), (kind, answer)
                        live.remove(lease)
                    elif kind in ("taken_key", "squatted"):
                        assert isinstance(answer, InvalidTransition), (kind, answer)
                        assert not isinstance(answer, LeaseLostError)
                        operations[squatter.run_id] = operations.get(squatter.run_id, 0) + (
                            kind == "taken_key"
                        )
                    else:
                        assert isinstance(answer, Committed), (kind, answer)
                        expected[run_id].append(f"w{number}")
                        at[run_id] = (answer.state_version, answer.last_sequence)
                        assert run_row(postgres_schema, run_id) == at[run_id]
                        if kind != "step":
                            operations[run_id] = operations.get(run_id, 0) + 1
                            assert_sealed_where_the_run_is(postgres_schema, run_id, answer)
            assert len(live) < len(leases)  # some lease was taken: the draw covered it

    asyncio.run(main())
    for run_id, types in expected.items():
        written = events_of(postgres_schema, run_id)
        assert [t for _, t in written] == types, run_id
        assert [s for s, _ in written] == list(range(1, len(written) + 1))
    recorded = sql(
        postgres_schema, "SELECT run_id, count(*) FROM durably_tool_operations GROUP BY run_id"
    )
    assert dict(recorded) == operations  # type: ignore[arg-type]


# -- cancelled while a refused round's writes go again alone --------------------------


def test_a_write_going_again_alone_when_every_task_is_cancelled_is_never_reported_done(
    postgres_schema: str,
) -> None:
    """A shared round is refused (a stray row took r1's next sequence) before it touched
    r0, so r0's write goes again alone, and waits there for a lock on r0. Then every task
    is cancelled, as ``asyncio.run`` does on its way out: the round's own task with them.
    r0's caller must not be told its commit returned: it was not written then (the
    server may still write it once the lock goes), so it is cancelled, or told the outcome
    is unknown."""
    told: dict[str, object] = {}

    async def commit(store: PostgresStore, lease: Lease) -> None:
        try:
            told[lease.run_id] = await store.commit(lease, step("x"))
        except BaseException as exc:
            told[lease.run_id] = exc
            raise

    async def main(holder: psycopg.Connection[object]) -> None:
        store = PostgresStore(postgres_schema_url(postgres_schema))
        await store.migrate()
        for run_id in ("r0", "r1"):
            await store.create_run(NewRun(run_id, "default", "wf", "1", {}, "{}", "h", 2))
        l0, l1 = [(await store.claim_run(r, "w1", 30)).lease for r in ("r0", "r1")]  # type: ignore[union-attr]
        sql(postgres_schema, SQUAT, "r1", run_row(postgres_schema, "r1")[1] + 1)
        holder.execute("SELECT 1 FROM durably_runs WHERE run_id = 'r0' FOR UPDATE")
        left = [asyncio.ensure_future(commit(store, lease)) for lease in (l1, l0)]
        await until_waiting_for_locks(postgres_schema, 1)  # r0's write, alone
        assert "r1" in told  # refused again alone: a unique violation
        ((pid,),) = sql(
            postgres_schema,
            "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND datname = current_database()",
        )
        waiting.append(int(pid))  # type: ignore[call-overload]
        assert not left[1].done()
        # The callers and the shared round's task cancelled at once, r0's write in flight,
        # as asyncio.run does with every task on its way out; then the store closed. Not
        # asyncio.run itself: psycopg_pool's workers swallow a cancellation that lands
        # while they reconnect (the cut connection's replacement), and it would never end.
        ours = [*left, *store._gathering._rounds]
        for task in ours:
            task.cancel()
        # A caller whose write is never settled waits for it through any cancellation: the
        # test fails (and leaves its loop unfinished) rather than hang.
        _, pending = await asyncio.wait(ours, timeout=10)
        assert not pending, "a cancelled caller still waits for its write's outcome"
        await store.close()

    waiting: list[int] = []
    with psycopg.connect(postgres_schema_url(postgres_schema)) as holder:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(main(holder))
        finally:
            loop.close()
        holder.rollback()
    asyncio.run(until_gone(postgres_schema, waiting[0]))  # it may still commit, unanswered
    assert isinstance(told["r1"], InvalidTransition)
    assert isinstance(told["r0"], (asyncio.CancelledError, StoreUnavailable)), told["r0"]
    assert [t for _, t in events_of(postgres_schema, "r0")] in (
        ["run_started"],
        ["run_started", "x"],
    )


# -- cancel storms ------------------------------------------------------------------


@pytest.mark.parametrize("seed", [7, 8, 9])
def test_a_cancel_storm_never_reports_a_write_that_did_not_happen(
    postgres_schema: str, seed: int
) -> None:
    """Waves of many runs' commits (steps and intents at a known state), some held on the
    server by a lock on their run's row, with runs cancelled at random points: before
    their round goes, while it waits on the server, after it answered. A caller told its
    commit returned finds it written once; any write is written at most once; every run's
    events stay gap-free; nothing hangs."""
    rng = random.Random(seed)
    url = postgres_schema_url(postgres_schema)

    async def main() -> None:
        async with store_with_runs(postgres_schema, 12) as (store, leases):
            for number in range(4):
                told: dict[str, object] = {}

                async def commit(lease: Lease, t: Transition, told: dict[str, object]) -> None:
                    told[lease.run_id] = await store.commit(lease, t)
                    await asyncio.sleep(0)  # a cancel meant for later lands here

                locked = rng.sample([lease.run_id for lease in leases], 3)
                with psycopg.connect(url) as holder:
                    holder.execute(
                        "SELECT 1 FROM durably_runs WHERE run_id = ANY(%s) FOR UPDATE", [locked]
                    )
                    tasks = {}
                    for lease in leases:
                        event = EventWrite(f"w{number}", "t#1")
                        t = step(f"w{number}")
                        if rng.random() < 0.5:
                            at = run_row(postgres_schema, lease.run_id)
                            key = f"k-{lease.run_id}-{number}"
                            t = replace(intent(lease.run_id, at, key), events=[event])
                        tasks[lease.run_id] = asyncio.ensure_future(commit(lease, t, told))
                    # One locked run is spared: its round surely waits on the server.
                    victims = rng.sample(sorted(set(tasks) - {locked[0]}), 6)
                    for turn in range(8):
                        for run_id in victims:
                            if rng.random() < 0.2:
                                tasks[run_id].cancel()
                        await asyncio.sleep(0)
                        if turn == 4:
                            await until_waiting_for_locks(postgres_schema, 1)
                    for run_id in victims:
                        tasks[run_id].cancel()
                    await asyncio.wait(tasks.values(), timeout=0.2)
                    holder.commit()
                    await asyncio.wait_for(
                        asyncio.gather(*tasks.values(), return_exceptions=True), 15
                    )
                await until_no_lock_waits(postgres_schema)
                for run_id, task in tasks.items():
                    written = [t for _, t in events_of(postgres_schema, run_id)]
                    assert written.count(f"w{number}") <= 1, (run_id, written)
                    if run_id in told:  # returned: a commit, written
                        assert isinstance(told[run_id], Committed), (run_id, told[run_id])
                        assert written.count(f"w{number}") == 1, (run_id, told[run_id])
                    elif not task.cancelled():
                        raise AssertionError(f"{run_id}: {task.exception()!r}")
                    sequences = [s for s, _ in events_of(postgres_schema, run_id)]
                    assert sequences == list(range(1, len(sequences) + 1))
                    assert run_row(postgres_schema, run_id)[1] == len(sequences)

    asyncio.run(main())


async def until_no_lock_waits(schema: str) -> None:
    deadline = time.monotonic() + 10
    while sql(
        schema,
        "SELECT 1 FROM pg_stat_activity WHERE datname = current_database() "
        "AND pid <> pg_backend_pid() AND state = 'active'",
    ):
        assert time.monotonic() < deadline, "a cut round still runs on the server"
        await asyncio.sleep(0.01)


# -- a stale holder's commit at a known state racing the new owner ---------------------


@pytest.mark.parametrize("kind", ["intent", "ending"])
def test_a_stale_holders_commit_at_racing_the_new_owners_claim_writes_nothing(
    postgres_schema: str, kind: str
) -> None:
    """The old holder's commit at the state it saw waits on the run's row (sharing its
    round with another run's step) while its lease ran out and a new owner takes the run
    in the transaction holding that row. The old holder is told its lease is lost and
    nothing of its commit exists; the other run's step is written once; the new owner's
    own commit at the state it found then applies whole."""
    url = postgres_schema_url(postgres_schema)

    async def main() -> tuple[list[object], Committed]:
        async with store_with_runs(postgres_schema, 2) as (store, (old, other)):
            at = run_row(postgres_schema, "r0")
            t = intent("r0", at) if kind == "intent" else ending("r0", at)
            with psycopg.connect(url) as holder:
                holder.execute("SELECT 1 FROM durably_runs WHERE run_id = 'r0' FOR UPDATE")
                answers = asyncio.gather(
                    store.commit(old, t), store.commit(other, step("x")), return_exceptions=True
                )
                await until_waiting_for_locks(postgres_schema, 1)
                holder.execute(  # what a claim by w2 of the run whose lease ran out does
                    "UPDATE durably_runs SET lease_owner = 'w2', lease_epoch = lease_epoch + 1, "
                    "lease_until = extract(epoch FROM now()) + 30 WHERE run_id = 'r0'"
                )
                holder.commit()
                told = await asyncio.wait_for(answers, 10)
            new = Lease("r0", "w2", old.epoch + 1, 30)
            again = intent("r0", at) if kind == "intent" else ending("r0", at)
            return told, await store.commit(new, again)

    (stale, stepped), done = asyncio.run(main())
    assert isinstance(stale, LeaseLostError), stale
    assert isinstance(stepped, Committed), stepped
    assert [t for _, t in events_of(postgres_schema, "r1")].count("x") == 1
    written = [t for _, t in events_of(postgres_schema, "r0")]
    assert written == ["run_started", "effect_intent" if kind == "intent" else "run_completed"]
    assert_sealed_where_the_run_is(postgres_schema, "r0", done)
    operations = sql(postgres_schema, "SELECT lease_owner FROM durably_tool_operations")
    assert operations == ([("w2",)] if kind == "intent" else [])


def test_checkpoints_sealed_by_commit_at_in_shared_rounds_keep_the_newest_ones(
    postgres_schema: str,
) -> None:
    """Periodic checkpoints committed at a known state (``commit_at``), several runs' at
    once in shared rounds, each pruning: every run keeps exactly its newest checkpoints,
    each intact and sealed at its own commit, as the two-round commit would keep them."""
    kept = 3  # durably.checkpoint.CHECKPOINTS_KEPT

    async def main() -> None:
        async with store_with_runs(postgres_schema, 4) as (store, leases):
            at = {lease.run_id: run_row(postgres_schema, lease.run_id) for lease in leases}
            for number in range(6):
                answers = await asyncio.gather(
                    *(
                        store.commit(
                            lease,
                            Transition(
                                events=[EventWrite(f"cp{number}")],
                                checkpoint=JournalState(lease.run_id).draft(
                                    status="running", current_step=None, prune=True
                                ),
                                at=at[lease.run_id],
                            ),
                        )
                        for lease in leases
                    )
                )
                for lease, done in zip(leases, answers, strict=True):
                    at[lease.run_id] = (done.state_version, done.last_sequence)
                    assert_sealed_where_the_run_is(postgres_schema, lease.run_id, done)
                    versions = [
                        v
                        for (v,) in sql(
                            postgres_schema,
                            "SELECT state_version FROM durably_checkpoints WHERE run_id = %s "
                            "ORDER BY state_version DESC",
                            lease.run_id,
                        )
                    ]
                    assert versions[0] == done.state_version
                    assert len(versions) == min(kept, number + 1)  # these runs have no receipt

    asyncio.run(main())


def test_a_cancelled_run_waits_for_its_own_outcome_not_for_the_other_writes_of_its_round(
    postgres_schema: str,
) -> None:
    """A shared round of r2, r0 and r1 waits on r2's row, whose holder also took r2's next
    sequence; r0 is cancelled meanwhile. The round is refused and each write goes again
    alone: r2's fails, r0's is written at once, r1's waits for a lock someone else holds.
    r0's caller learns its commit was written and is cancelled then, without waiting for
    r1's lock; r1 still commits once that lock goes."""
    url = postgres_schema_url(postgres_schema)
    told: dict[str, object] = {}

    async def commit(store: PostgresStore, lease: Lease) -> None:
        told[lease.run_id] = await store.commit(lease, step("x"))
        await asyncio.sleep(30)

    async def main() -> None:
        async with store_with_runs(postgres_schema, 3) as (store, (l0, l1, l2)):
            with psycopg.connect(url) as r1_holder, psycopg.connect(url) as r2_holder:
                r1_holder.execute("SELECT 1 FROM durably_runs WHERE run_id = 'r1' FOR UPDATE")
                r2_holder.execute("SELECT 1 FROM durably_runs WHERE run_id = 'r2' FOR UPDATE")
                r2_holder.execute(SQUAT, ("r2", run_row(postgres_schema, "r2")[1] + 1))
                tasks = [asyncio.ensure_future(commit(store, lease)) for lease in (l2, l0, l1)]
                await until_waiting_for_locks(postgres_schema, 1)  # the round, on r2
                tasks[1].cancel()
                r2_holder.commit()  # the round is refused: r2's sequence is taken
                await asyncio.wait([tasks[1]], timeout=5)
                r0_done_alone = tasks[1].done()
                r1_holder.commit()
                await asyncio.wait_for(until_told(told, "r1"), 10)
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                assert r0_done_alone, "r0's caller waited for r1's lock"

    asyncio.run(main())
    assert isinstance(told["r0"], Committed)
    assert isinstance(told["r1"], Committed)
    assert [t for _, t in events_of(postgres_schema, "r0")].count("x") == 1
    assert [t for _, t in events_of(postgres_schema, "r1")].count("x") == 1
    assert [t for _, t in events_of(postgres_schema, "r2")].count("x") == 0


async def until_told(told: dict[str, object], run_id: str) -> None:
    while run_id not in told:
        await asyncio.sleep(0.01)
