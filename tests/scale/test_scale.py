"""Attacks on many worker processes sharing one PostgreSQL database.

Every test runs ``purchase`` from ``scaleapp`` (a step, an idempotent order, a reconciled
coupon, an idempotent email, a step) for one new customer per run, on a fresh schema, with
real worker processes, and judges by the shop's own records: each customer must end with
exactly one order, one coupon and one email, whatever was done to the workers or the
database. The event log must stay gap-free and show each run finished once.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.scale.cluster import Cluster
from tests.scale.conftest import FINAL, STUCK, Scale, WorkerProc, pid_of, wait_until

pytestmark = pytest.mark.scale

TOOL_STEPS = ("place_order#1", "issue_coupon#1", "send_email#1")


def fresh_events(step_id: str) -> list[tuple[str, str | None]]:
    """A tool call executed once without trouble: intent (with claim), outcome."""
    return [("effect_intent_recorded", step_id), ("effect_succeeded", step_id)]


def check_event_logs(scale: Scale) -> dict[str, list[dict[str, Any]]]:
    """Every run's log is gap-free (1..n, n = the run's last_sequence), starts once,
    settles each tool call once and ends with its one ``run_completed``."""
    runs = scale.db.runs()
    events = scale.db.events()
    assert set(events) == {s.run_id for s in scale.runs}
    for run_id, log in events.items():
        sequences = [e["sequence"] for e in log]
        assert sequences == list(range(1, len(log) + 1)), (run_id, sequences)
        assert runs[run_id]["last_sequence"] == len(log), run_id
        types = Counter(e["type"] for e in log)
        assert types["run_started"] == 1, (run_id, types)
        assert types["run_completed"] == 1, (run_id, types)
        assert log[-1]["type"] == "run_completed", (run_id, [e["type"] for e in log])
        for step_id in TOOL_STEPS:
            settled = [
                e
                for e in log
                if e["step_id"] == step_id
                and (
                    e["type"] == "effect_succeeded"
                    or (e["type"] == "effect_reconciled" and e["payload"]["answer"] == "succeeded")
                )
            ]
            assert len(settled) == 1, (run_id, step_id, [e["type"] for e in log])
    return events


def assert_all_completed(scale: Scale) -> None:
    statuses = scale.db.statuses()
    assert statuses == Counter({"completed": len(scale.runs)}), statuses
    runs = scale.db.runs()
    held = [r for r, row in runs.items() if row["lease_owner"] is not None]
    assert not held, f"completed runs still leased: {held}"


def report(title: str, **facts: Any) -> None:
    """Shown with ``pytest -s`` (and on failure): what a test observed."""
    print(f"\n[scale] {title}: " + ", ".join(f"{k}={v}" for k, v in facts.items()))


# -- 1. two workers race for the same ready runs -----------------------------------------


def test_two_workers_race_for_the_same_ready_runs(scale: Scale, tmp_path: Path) -> None:
    """Two processes (4 slots each), released at the same instant onto 20 ready runs:
    each run is claimed and executed by exactly one of them, start to finish, and each
    effect reaches the shop once, without any re-send or reconciliation."""
    runs = scale.start_runs(20)
    go = tmp_path / "go"
    racers = [scale.synchronised_worker(n, go, concurrency=4) for n in ("a", "b")]
    for w in racers:
        wait_until(lambda w=w: "ready" in w.stdout() or not w.alive(), 60, f"{w.name} ready")
        assert w.alive(), w.explain()
    t0 = time.monotonic()
    go.touch()
    for w in racers:
        assert w.wait(60) == 0, w.explain()
    elapsed = time.monotonic() - t0
    a, b = (w.result() for w in racers)

    assert_all_completed(scale)
    # Each run was claimed once in all: a run claimed by both would be counted twice.
    assert a["executed"] + b["executed"] == len(runs), (a, b)
    # Both got work: the two really raced for the same runs.
    assert a["executed"] > 0, (a, b)
    assert b["executed"] > 0, (a, b)

    events = check_event_logs(scale)
    for run_id, log in events.items():
        types = [e["type"] for e in log]
        assert "run_recovered" not in types, (run_id, types)
        assert "run_released" not in types, (run_id, types)
        expected = [("run_started", None), ("step_succeeded", "begin#1")]
        for step_id in TOOL_STEPS:
            expected += fresh_events(step_id)
        expected += [("step_succeeded", "finish#1"), ("run_completed", None)]
        assert [(e["type"], e["step_id"]) for e in log] == expected, run_id

    # The first and the last step of every run ran in the same process, one of the two,
    # and each process ran exactly as many runs as it says it executed.
    results = scale.db.rows("SELECT run_id, result_json FROM durably_runs")
    pids: Counter[int] = Counter()
    for row in results:
        first, last = json.loads(row["result_json"])["pids"]
        assert first == last, (row["run_id"], first, last)
        pids[first] += 1
    assert pids == Counter({a["pid"]: a["executed"], b["pid"]: b["executed"]}), (pids, a, b)

    scale.assert_each_effect_once()
    requests = scale.shop.effects()["requests_by_method"]
    n = len(runs)
    for path in ("/orders", "/coupons", "/emails"):
        assert requests.get(f"POST {path}") == n, requests
    assert "GET /coupons" not in requests, requests
    report(
        "race",
        runs=n,
        executed_a=a["executed"],
        executed_b=b["executed"],
        start_skew_ms=round(abs(a["started"] - b["started"]) * 1000, 1),
        seconds=round(elapsed, 2),
    )


# -- 2. a worker frozen mid-effect past its lease ----------------------------------------

BLOCKED = {
    # kind: (shop path, the blocked tool's step id, events the new owner writes for it: the
    # run is reconciling until the call is settled, in the commit that settles it)
    "idempotent": (
        "/orders",
        "place_order#1",
        [
            ("run_reconciling", None),
            ("effect_reconciling", "place_order#1"),
            ("effect_resent", "place_order#1"),
            ("run_reconciled", None),
            ("effect_succeeded", "place_order#1"),
        ],
    ),
    "reconciled": (
        "/coupons",
        "issue_coupon#1",
        [
            ("run_reconciling", None),
            ("effect_reconciling", "issue_coupon#1"),
            ("effect_reconciled", "issue_coupon#1"),
            ("run_reconciled", None),
        ],
    ),
}
HELD_BACK_S = 3.0
"""How long the shop holds back its answer after committing the effect."""


def check_takeover_log(scale: Scale, run_id: str, kind: str, stale_owner: str) -> None:
    """The event log holds the stale owner's writes, the takeover naming it, then only the
    new owner's writes (settling the blocked effect once) and nothing after completion."""
    _, blocked_step, settled_by_new = BLOCKED[kind]
    events = check_event_logs(scale)[run_id]
    recovered = [e for e in events if e["type"] == "run_recovered"]
    assert len(recovered) == 1, recovered
    assert recovered[0]["payload"]["previous_owner"] == stale_owner, recovered
    by_stale = [("run_started", None), ("step_succeeded", "begin#1")]
    by_new: list[tuple[str, str | None]] = []
    for step_id in TOOL_STEPS:
        if step_id == blocked_step:
            by_stale.append(("effect_intent_recorded", step_id))
            by_new += settled_by_new
        elif by_new:
            by_new += fresh_events(step_id)
        else:
            by_stale += fresh_events(step_id)
    by_new += [("step_succeeded", "finish#1"), ("run_completed", None)]
    expected = [*by_stale, ("run_recovered", None), *by_new]
    assert [(e["type"], e["step_id"]) for e in events] == expected


@pytest.mark.parametrize("kind", sorted(BLOCKED))
def test_sigstopped_worker_is_fenced_after_takeover(scale: Scale, kind: str) -> None:
    """Worker A is frozen (SIGSTOP) while its request is in flight and the shop has already
    committed the effect; its 1 s lease runs out. Worker B takes the run over
    (``run_recovered`` naming A), settles the effect without repeating it (re-send with the
    same key / ask the shop), and completes the run. Then A is thawed (SIGCONT): the shop's
    answer reaches it, and its late write is rejected by the lease fence; it logs that its
    lease was lost and writes nothing more. The log holds A's events, the takeover, and
    then only B's."""
    path, blocked_step, _ = BLOCKED[kind]
    table = path.strip("/")
    [run] = scale.start_runs(1)
    scale.shop.add_fault(path, "delay_after_commit", times=1, seconds=HELD_BACK_S)
    a = scale.worker("a", until_idle=True, lease_ttl=1.0)

    def committed_at_shop() -> bool:
        assert a.alive(), a.explain()
        rows = scale.shop.effects()[table]
        return any(r["request"]["customer"] == run.customer for r in rows)

    wait_until(committed_at_shop, 60, f"A's {path} request to be committed at the shop")
    a.signal(signal.SIGSTOP)
    frozen_at = time.monotonic()
    [op] = scale.db.rows(
        "SELECT status, lease_owner FROM durably_tool_operations WHERE step_id = %s",
        (blocked_step,),
    )
    assert op["status"] == "executing", op
    assert pid_of(op["lease_owner"]) == a.pid, op

    wait_until(lambda: scale.db.lease_expired(run.run_id), 10, "A's lease to expire")
    b = scale.worker("b", until_idle=True, lease_ttl=1.0)
    assert b.wait(60) == 0, b.explain()
    took_over_in = time.monotonic() - frozen_at
    assert scale.db.statuses() == Counter({"completed": 1})
    assert a.alive(), "A must still be frozen while B finishes"

    a.signal(signal.SIGCONT)
    assert a.wait(30) == 0, a.explain()
    a_id, a_executed = a.exit_line() or pytest.fail(a.explain())
    b_id, b_executed = b.exit_line() or pytest.fail(b.explain())
    assert (pid_of(a_id), a_executed) == (a.pid, 1)
    assert (pid_of(b_id), b_executed) == (b.pid, 1)
    a_log = a.stderr()
    assert f"run {run.run_id}: stopped" in a_log, f"A did not stop on its lost lease:\n{a_log}"
    assert "was lost" in a_log, f"A did not report its lost lease:\n{a_log}"
    assert "Traceback" not in a_log, a_log
    check_takeover_log(scale, run.run_id, kind, a_id)

    # The run's final state is B's: its result holds what B learnt, and its last step ran
    # in B while its first (recorded by A) was not run again.
    [row] = scale.db.rows("SELECT result_json FROM durably_runs")
    result = json.loads(row["result_json"])
    assert result["pids"] == [a.pid, b.pid], result["pids"]
    effects = scale.assert_each_effect_once()
    requests = effects["requests_by_method"]
    if kind == "idempotent":
        # A's POST and B's re-send with the same key: one order, the second answer a replay.
        assert requests.get("POST /orders") == 2, requests
        assert result["order"]["replayed"] is True, result["order"]
        assert result["order"]["order_id"] == effects["orders"][0]["id"]
    else:
        # B asked the shop instead of posting again: one coupon, the one A created.
        assert requests.get("POST /coupons") == 1, requests
        assert requests.get("GET /coupons", 0) >= 1, requests
        assert result["coupon"]["coupon_id"] == effects["coupons"][0]["id"]
    [op] = scale.db.rows(
        "SELECT status, lease_owner, attempt FROM durably_tool_operations WHERE step_id = %s",
        (blocked_step,),
    )
    assert op["status"] == "succeeded", op
    assert op["lease_owner"] is None, op
    report(
        f"sigstop/{kind}",
        takeover_and_finish_s=round(took_over_in, 2),
        attempts=op["attempt"],
        requests=dict(sorted(requests.items())),
    )


# -- 3. SIGKILL at random moments --------------------------------------------------------

CHAOS_SEED = int(os.environ.get("SCALE_CHAOS_SEED", "20260"))
"""Fixed, so a failure replays the same kill schedule; override to explore others."""
CHAOS_RUNS = 100
CHAOS_WORKERS = 4
CHAOS_KILLS = 8
CHAOS_TOOL_DELAY_S = 0.1


def finish_until_idle(scale: Scale, n: int) -> int:
    """Run ``worker --until-idle`` until all ``n`` runs are final; return how many passes.

    A killed worker's runs become runnable once its lease expired: wait for that before
    each pass (an until-idle worker does not wait for other workers' live leases).
    """
    passes = 0
    while sum(scale.db.statuses()[s] for s in FINAL) < n:
        passes += 1
        assert passes <= 5, f"runs still unfinished after {passes - 1} passes"
        wait_until(
            lambda: (
                not scale.db.rows(
                    "SELECT 1 FROM durably_runs WHERE lease_owner IS NOT NULL "
                    "AND lease_until >= extract(epoch FROM now())"
                )
            ),
            10,
            "every lease to be released or expired",
        )
        final = scale.worker(f"final-{passes}", concurrency=6, until_idle=True, lease_ttl=1.0)
        assert final.wait(60) == 0, final.explain()
    return passes


def test_sigkill_chaos_over_four_workers(scale: Scale) -> None:
    """Four workers (3 slots each, 1 s leases) drive 100 runs while a seeded chaos loop
    SIGKILLs a random worker every 0.3-0.8 s and starts a replacement (8 kills). Then the
    survivors are stopped with SIGTERM (they release their runs at the next call boundary)
    and ``worker --until-idle`` is run until nothing is runnable. Every run completes, each
    customer has exactly one order, coupon and email at the shop, and no run is stuck."""
    scale.start_runs(CHAOS_RUNS)
    rng = random.Random(CHAOS_SEED)
    t0 = time.monotonic()

    def spawn(name: str) -> WorkerProc:
        return scale.worker(name, concurrency=3, lease_ttl=1.0, tool_delay=CHAOS_TOOL_DELAY_S)

    workers = [spawn(f"w{i}") for i in range(CHAOS_WORKERS)]
    for w in workers:
        wait_until(lambda w=w: w.handles_sigterm() or not w.alive(), 30, f"{w.name} up")
    killed: list[int] = []
    unfinished_at_kill: list[int] = []
    for k in range(CHAOS_KILLS):
        time.sleep(rng.uniform(0.3, 0.8))
        statuses = scale.db.statuses()
        unfinished = CHAOS_RUNS - sum(statuses[s] for s in FINAL)
        if unfinished == 0:
            break
        i = rng.randrange(CHAOS_WORKERS)
        victim = workers[i]
        # Kill a working process, not one still importing (that would test nothing).
        wait_until(lambda v=victim: v.handles_sigterm() or not v.alive(), 30, "a worker up")
        assert victim.alive(), f"a worker died on its own\n{victim.explain()}"
        victim.kill()
        killed.append(victim.pid)
        unfinished_at_kill.append(unfinished)
        workers[i] = spawn(f"w{i}-after-kill-{k + 1}")
    chaos_s = time.monotonic() - t0

    # Stop the survivors gracefully, mid-work: a SIGTERMed worker releases its runs.
    for w in workers:
        assert w.alive(), f"a worker died on its own\n{w.explain()}"
    for w in workers:
        assert w.terminate(timeout=20) == 0, w.explain()
    released = scale.db.statuses()

    # Then until-idle workers until nothing is left.
    passes = finish_until_idle(scale, CHAOS_RUNS)
    total_s = time.monotonic() - t0

    assert_all_completed(scale)
    statuses = scale.db.statuses()
    assert not any(statuses[s] for s in STUCK), statuses
    scale.assert_each_effect_once()
    events = check_event_logs(scale)

    all_events = [e for log in events.values() for e in log]
    recoveries = [e for e in all_events if e["type"] == "run_recovered"]
    spawned = {w.pid for w in scale.workers}
    owners = [pid_of(e["payload"]["previous_owner"]) for e in recoveries]
    assert set(owners) <= spawned, owners
    # Runs taken from a worker that was alive: its lease ran out (it then got fenced).
    from_live = sum(1 for pid in owners if pid not in killed)
    kinds = Counter(e["type"] for e in all_events)
    duplicates = sum(
        e["payload"].get("duplicates") or 0 for e in all_events if e["type"] == "effect_reconciled"
    )
    assert duplicates == 0
    requests = scale.shop.effects()["requests_by_method"]
    report(
        "chaos",
        seed=CHAOS_SEED,
        kills=len(killed),
        unfinished_at_each_kill=unfinished_at_kill,
        chaos_s=round(chaos_s, 1),
        unfinished_after_sigterm=CHAOS_RUNS - sum(released[s] for s in FINAL),
        final_passes=passes,
        total_s=round(total_s, 1),
        run_recovered=len(recoveries),
        recovered_from_live_workers=from_live,
        effect_resent=kinds["effect_resent"],
        effect_reconciled=kinds["effect_reconciled"],
        run_released=kinds["run_released"],
        requests=dict(sorted(requests.items())),
    )
    assert len(killed) == CHAOS_KILLS, "the work ran out before the chaos did"


# -- 4. PostgreSQL restarted under the workers --------------------------------------------

STORE_ERRORS = r"stopped executing|stopped \(StoreUnavailable|store unavailable"
"""Log lines of a worker execution or claim stopped by a store error."""


def test_postgres_restart_under_the_workers(scale: Scale, pg_cluster: Cluster) -> None:
    """Two workers (2 slots each) drive 120 runs whose tools are slowed a little; while runs
    are in flight PostgreSQL is restarted with ``-m immediate`` (every connection cut, a
    commit in flight lost or ambiguous), up to three times until one restart has cut a
    worker's transaction. The same worker processes survive, reconnect (pool and LISTEN)
    and finish everything on their own: every run completed, each effect once."""
    n = 120
    scale.start_runs(n)
    workers = [
        scale.worker(f"w{i}", concurrency=2, lease_ttl=2.0, tool_delay=0.01) for i in range(2)
    ]

    def unfinished() -> int | None:
        for w in workers:
            assert w.alive(), f"a worker died with the database\n{w.explain()}"
        rows = scale.db.try_rows(
            "SELECT count(*) AS n FROM durably_runs WHERE status = ANY(%s)", (list(FINAL),)
        )
        return None if rows is None else n - int(rows[0]["n"])

    def cut() -> int:
        """Executions stopped by a store error (they are continued from the store)."""
        logs = "".join(w.stderr() for w in workers)
        return len(re.findall(STORE_ERRORS, logs))

    restarts: list[dict[str, Any]] = []
    t0 = time.monotonic()
    done_at_last = 0
    while len(restarts) < 3 and cut() == 0:
        # Land mid-run: some runs finished since the last restart, many still to go, and
        # some in flight. Completions come in bursts (the slots run alike runs in step), so
        # the moment just after one may find every slot between two claims: wait past it.
        seen: dict[str, Counter[str]] = {}

        def mid_run(d: int = done_at_last, seen: dict[str, Counter[str]] = seen) -> bool:
            if unfinished() is None:
                return False
            seen["before"] = statuses = scale.db.statuses()
            return sum(statuses[s] for s in FINAL) >= d + 3 and statuses["running"] > 0

        wait_until(mid_run, 60, "runs to complete between restarts, others in flight", every=0.02)
        before = seen["before"]
        if n - sum(before[s] for s in FINAL) < 15:
            break
        [booted] = scale.db.rows("SELECT pg_postmaster_start_time() AS at")
        started = time.monotonic()
        try:
            restart = pg_cluster.pg_ctl("restart", "-m", "immediate")
            assert restart.returncode == 0, restart.stdout + restart.stderr
        finally:
            pg_cluster.ensure_up()
        [rebooted] = scale.db.rows("SELECT pg_postmaster_start_time() AS at")
        assert rebooted["at"] > booted["at"], "the server was not restarted"
        assert before["running"] > 0, f"no run was in flight at the restart: {before}"
        done_at_last = sum(before[s] for s in FINAL)
        restarts.append(
            {
                "completed": before["completed"],
                "running": before["running"],
                "seconds": round(time.monotonic() - started, 2),
            }
        )
    assert restarts, "the runs finished before any restart"

    wait_until(lambda: unfinished() == 0, 90, "the workers to finish every run", every=0.1)
    finished_s = time.monotonic() - t0
    for w in workers:
        assert w.terminate(timeout=20) == 0, w.explain()
    executions = sum((w.exit_line() or ("", 0))[1] for w in workers)

    assert_all_completed(scale)
    scale.assert_each_effect_once()
    events = check_event_logs(scale)
    logs = "".join(w.stderr() for w in workers)
    assert "Traceback" not in logs, logs[-5000:]
    kinds = Counter(e["type"] for log in events.values() for e in log)
    report(
        "postgres restart",
        restarts=restarts,
        all_completed_after_s=round(finished_s, 2),
        executions_cut_by_store_errors=cut(),
        executions=executions,
        pool_reconnect_attempts=logs.count("error connecting in"),
        heartbeats_failed=logs.count("heartbeat failed"),
        leases_lost=logs.count("was lost"),
        run_recovered=kinds["run_recovered"],
        effect_resent=kinds["effect_resent"],
        effect_reconciled=kinds["effect_reconciled"],
    )


# -- 5. the slots of one worker share one connection pool ---------------------------------


def test_concurrent_slots_of_one_worker_share_one_pool(
    scale: Scale, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker with 4 slots: all four claim at once on start, each asking the store for
    the loop's pool. One pool must be opened, shared, and closed with the store; a pool
    opened by a losing slot and then dropped keeps its connections and background tasks
    alive until garbage collection ("Task was destroyed but it is pending!" in every
    multi-slot worker's log, seen in the tests above)."""
    import asyncio

    import durably.store.postgres as pg
    from durably.store.pg_pool import Pool
    from tests.scale import scaleapp

    opened: list[Pool] = []

    class RecordingPool(Pool):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            opened.append(self)

    monkeypatch.setattr(pg, "Pool", RecordingPool)
    scale.start_runs(4)  # its App is closed again: its pool is not counted below
    opened.clear()
    app = scaleapp.build(scale.url)
    worker = app.worker(concurrency=4)

    async def main() -> tuple[int, int, int]:
        try:
            executed = await worker.run_async(until_idle=True)
        finally:
            await app.close_async()
        left_open = [p for p in opened if not p.closed]
        for pool in left_open:  # do not leak them into the rest of the session
            await pool.close()
        return executed, len(opened), len(left_open)

    monkeypatch.setenv("SHOP_URL", scale.shop.url)
    try:
        executed, pools, left_open = asyncio.run(main())
    finally:
        app.close()
    assert executed == 4
    assert (pools, left_open) == (1, 0), (
        f"{pools} pools opened for one event loop by 4 concurrent slots, {left_open} of them "
        "still open after the store was closed"
    )
