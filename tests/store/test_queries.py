"""Each backend's named statements: the same names, the same parameters, the same rules.

The plans (``store/plans.py``) and ``SQLStore`` name statements; each backend's
``queries.sql`` must hold every one of them, taking the same parameters: only dialect,
placeholders and the clock differ.
"""

from __future__ import annotations

import ast
import re
import time
from pathlib import Path
from typing import Any

import pytest

from durably.store.base import CLAIMABLE, NewRun
from durably.store.queries import queries

STORE = Path(__file__).resolve().parents[2] / "src" / "durably" / "store"
OWN = {
    # SQLite's RETURNING shows only the new row: a claim reads the run, then leases it.
    "sqlite": {"take_lease"},
    # LISTEN/NOTIFY and the migrators' advisory lock exist only there (and the catalog read
    # after waiting for it); so does a data-modifying WITH, which makes a step's commit and
    # an execution's ending one statement each.
    "postgres": {
        "listen",
        "notify",
        # SQLite's lock wait is its connection's busy timeout.
        "bound_lock_waits",
        "migration_lock",
        "migrations_table_committed",
        "commit_step",
        "commit_at",
        # A planner setting around a batch's claim (SQLite's planner needs none).
        "claim_in_index_order",
        "claim_done_in_index_order",
    },
}
PLACEHOLDER = {
    "sqlite": re.compile(r"(?<![:\w]):(\w+)"),
    "postgres": re.compile(r"%\((\w+)\)s"),
}


def named_by_neutral_code() -> set[str]:
    """Statement names in the backend-neutral modules: ``(name, {params})`` queries and the
    names given to ``_one`` and ``_claim``."""
    names: set[str] = set()
    for module in ("plans.py", "commit_plan.py", "pause.py", "sqlstore.py"):
        for node in ast.walk(ast.parse((STORE / module).read_text())):
            first: ast.expr | None = None
            if isinstance(node, ast.Tuple) and len(node.elts) == 2:
                first = node.elts[0]
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") in {
                "_one",
                "_claim",
            }:
                first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                names.add(first.value)
    return names


def parameters(backend: str, sql: str) -> set[str]:
    return set(PLACEHOLDER[backend].findall(sql)) - {"now"}


def test_both_backends_name_the_same_statements() -> None:
    sqlite, postgres = queries("sqlite"), queries("postgres")
    assert set(sqlite) - OWN["sqlite"] == set(postgres) - OWN["postgres"]


def test_every_statement_the_plans_name_exists() -> None:
    named = named_by_neutral_code()
    assert "fence_lease" in named  # the scan works
    for backend in ("sqlite", "postgres"):
        other = OWN["postgres" if backend == "sqlite" else "sqlite"]
        missing = named - set(queries(backend)) - other
        assert not missing, f"sql/{backend}/queries.sql lacks {sorted(missing)}"


@pytest.mark.parametrize("name", sorted(set(queries("postgres")) - OWN["postgres"]))
def test_a_statement_takes_the_same_parameters_in_both_dialects(name: str) -> None:
    sqlite, postgres = queries("sqlite")[name], queries("postgres")[name]
    assert "%(" not in sqlite
    assert not PLACEHOLDER["sqlite"].findall(postgres.replace("::", ""))
    expected = parameters("postgres", postgres)
    taken = parameters("sqlite", sqlite)
    if name.startswith("claim_"):  # SQLite's claim is two statements; its lease takes the rest
        taken |= parameters("sqlite", queries("sqlite")["take_lease"]) - {"run_id"}
        expected -= {"run_id"}
        taken -= {"run_id"}
    if name == "start_run":  # SQLite's inserts the run alone; its event and receipt follow
        taken |= {"event_json", "receipt", "schema_version", "checkpoint_json", "checksum"}
    assert taken == expected


def test_claimable_statuses_are_the_stores() -> None:
    claimable = {status.value for status in CLAIMABLE}
    checked = 0
    for backend in ("sqlite", "postgres"):
        for sql in queries(backend).values():
            for listed in re.findall(r"status IN \(([^)]*'waiting_approval'[^)]*)\)", sql):
                if "'queued'" in listed:
                    assert set(re.findall(r"'(\w+)'", listed)) == claimable, sql
                    checked += 1
    # claim_run, claim_batch, next_wakeup, both dialects; SQLite's live_owners (its index)
    assert checked == 7


def test_the_scrape_reads_events_through_their_partial_indexes(tmp_path: Path) -> None:
    """Every scrape of every worker reads the ledger's figures: on an event log of millions
    a scan would cost each scrape most of a second (1.5 ms through the indexes)."""
    import asyncio
    import sqlite3

    from durably.store.sqlite import SQLiteStore

    path = tmp_path / "plan.db"
    asyncio.run(SQLiteStore(f"sqlite:///{path}").migrate())
    with sqlite3.connect(path) as conn:
        plan = [
            row[3]
            for row in conn.execute(
                "EXPLAIN QUERY PLAN " + queries("sqlite")["ledger_figures"], {"now": 0.0}
            )
        ]
    events = [step for step in plan if "durably_events" in step]
    assert events == [
        "SCAN durably_events USING INDEX durably_events_reconciled",
        "SCAN durably_events USING INDEX durably_events_paused",
    ]


def test_a_claim_walks_the_runnable_runs_in_claim_order(tmp_path: Path) -> None:
    """A claim takes the oldest due runs and stops at its batch: it reads the runnable
    index in claim order, with no sort of every runnable run (a cost as large as the
    backlog), and the sweep's read of live owners stays on that index."""
    import asyncio
    import json
    import sqlite3

    from durably.store.sqlite import SQLiteStore

    path = tmp_path / "plan.db"
    asyncio.run(SQLiteStore(f"sqlite:///{path}").migrate())
    params = {"now": 0.0, "workflows": json.dumps(["wf|1"]), "limit": 4}
    with sqlite3.connect(path) as conn:
        for name in ("claim_batch", "live_owners"):
            plan = [
                r[3] for r in conn.execute("EXPLAIN QUERY PLAN " + queries("sqlite")[name], params)
            ]
            runs = [step for step in plan if "durably_runs" in step]
            assert runs, plan
            assert all("USING INDEX durably_runs_runnable" in step for step in runs), plan
            if name == "claim_batch":
                assert not any("ORDER BY" in step for step in plan), plan


def test_a_postgres_claim_walks_the_runnable_runs_in_claim_order(postgres_schema: str) -> None:
    """Likewise on PostgreSQL, where the choice is the planner's: a backlog the table's
    statistics do not know yet (never analyzed, as after a burst) still gets the index
    in claim order, under the setting the store sends before a batch's claim; the rest of
    the claim's transaction (its journal reads need sorts) is planned as usual again."""
    import asyncio

    import psycopg

    from durably.store.postgres import PostgresStore
    from tests.conftest import postgres_schema_url

    url = postgres_schema_url(postgres_schema)
    asyncio.run(PostgresStore(url).migrate())
    sql = queries("postgres")
    with psycopg.connect(url) as conn:
        conn.execute(
            "INSERT INTO durably_runs (run_id, tenant_id, workflow, workflow_version, status,"
            " input_json, input_hash, available_at, created_at, updated_at)"
            " SELECT 'r' || i, 'default', 'wf', '1', 'queued', '{}', 'h', i, i, i"
            " FROM generate_series(1, 3000) AS i"
        )
        params = {"workflows": ["wf|1"], "limit": 4, "owner": "w", "ttl": 30.0}
        # The claim's round as the store sends it, the claim itself explained.
        pick = PostgresStore(url)._pick("claim_batch", params)
        before, claim, after = next(pick).queries
        assert claim[0] == "claim_batch"
        conn.execute(sql[before[0]])
        plan = "\n".join(r[0] for r in conn.execute("EXPLAIN " + sql["claim_batch"], params))
        conn.execute(sql[after[0]])
        setting = conn.execute("SELECT current_setting('enable_sort')").fetchone()
        conn.rollback()
    assert "Index Scan using durably_runs_runnable" in plan, plan
    assert "Sort" not in plan, plan
    assert setting == ("on",)


def runnable_index_scans(explained: Any) -> list[dict[str, Any]]:
    """The nodes of an ``EXPLAIN (ANALYZE, FORMAT JSON)`` that scan durably_runs_runnable."""
    import json

    scans = []

    def walk(node: dict[str, Any]) -> None:
        if node.get("Index Name") == "durably_runs_runnable":
            scans.append(node)
        for child in node.get("Plans", []):
            walk(child)

    walk((explained if isinstance(explained, list) else json.loads(explained))[0]["Plan"])
    return scans


HELD = 300
"""Runs other workers hold, which a claim must not walk."""


def test_a_claim_walks_none_of_the_runs_other_workers_hold(tmp_path: Path) -> None:
    """A held run is due when its lease runs out (see the take_lease and heartbeat
    statements): a claim with hundreds held does the work of a claim with a few."""
    import asyncio
    import json
    import sqlite3

    from durably.store.sqlite import SQLiteStore

    def claim_work(path: Path) -> int:
        """Steps of SQLite's VM to find the runs a claim would take now (none)."""
        steps = 0

        def count() -> int:
            nonlocal steps
            steps += 1
            return 0

        params = {"now": time.time(), "workflows": json.dumps(["wf|1"]), "limit": 16}
        with sqlite3.connect(path) as conn:
            conn.set_progress_handler(count, 1)
            assert conn.execute(queries("sqlite")["claim_batch"], params).fetchall() == []
        return steps

    async def hold(store: SQLiteStore, runs: int) -> None:
        await store.migrate()
        for i in range(runs):
            await store.create_run(NewRun(f"r{i}", "default", "wf", "1", {}, "{}", "h", 2))
        assert len(await store.claim_batch("w1", 600, ["wf|1"], runs)) == runs
        await store.close()

    work = []
    for runs in (HELD // 10, HELD):
        path = tmp_path / f"held-{runs}.db"
        asyncio.run(hold(SQLiteStore(f"sqlite:///{path}"), runs))
        work.append(claim_work(path))
    assert work[1] == work[0], work


def test_a_postgres_claim_walks_none_of_the_runs_other_workers_hold(
    postgres_schema: str,
) -> None:
    """Likewise on PostgreSQL: the claim's walk of the runnable index meets no held run."""
    import asyncio

    import psycopg

    from durably.store.postgres import PostgresStore
    from tests.conftest import postgres_schema_url

    url = postgres_schema_url(postgres_schema)

    async def hold() -> None:
        store = PostgresStore(url)
        await store.migrate()
        for i in range(HELD):
            await store.create_run(NewRun(f"r{i}", "default", "wf", "1", {}, "{}", "h", 2))
        assert len(await store.claim_batch("w1", 600, ["wf|1"], HELD)) == HELD
        await store.close()

    asyncio.run(hold())
    sql = queries("postgres")
    params = {"workflows": ["wf|1"], "limit": 16, "owner": "w2", "ttl": 30.0}
    with psycopg.connect(url) as conn:
        conn.execute(sql["claim_in_index_order"])
        (plan,) = conn.execute(
            "EXPLAIN (ANALYZE, FORMAT JSON) " + sql["claim_batch"], params
        ).fetchone()
        conn.rollback()
    scans = runnable_index_scans(plan)
    assert scans, plan
    for scan in scans:
        assert (scan["Actual Rows"], scan.get("Rows Removed by Filter", 0)) == (0, 0), scan


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_a_commits_fence_leaves_the_runnable_index_alone(backend: str) -> None:
    """Every commit of a lease holder renews its lease and sets nothing the runnable index
    holds: SQLite rewrites the entries of an index whose column an UPDATE sets (one more
    page a commit), even to the value it had; PostgreSQL's update would no longer be HOT."""
    fence = queries(backend)["fence_lease"]
    assert "lease_until" in fence
    assert not re.search(r"\b(available_at|created_at|status)\s*=", fence), fence


WAITING_RUNS = (
    "INSERT INTO durably_runs (run_id, tenant_id, workflow, workflow_version, status,"
    " input_json, input_hash, available_at, created_at, updated_at)"
    " VALUES (?, 'default', 'wf', '1', 'waiting_approval', '{}', 'h', 1e15, ?, ?)"
)


def test_an_idle_workers_wakeup_stops_at_the_first_run_due(tmp_path: Path) -> None:
    """An idle worker's slots each ask when the next run is due, twice a second: the read
    walks the runnable index to the first run and stops, however many runs wait (here for
    an approval, with no timer)."""
    import asyncio
    import json
    import sqlite3

    from durably.store.sqlite import SQLiteStore

    work = []
    for runs in (30, 300):
        path = tmp_path / f"waiting-{runs}.db"
        asyncio.run(SQLiteStore(f"sqlite:///{path}").migrate())
        steps = 0

        def count() -> int:
            nonlocal steps
            steps += 1
            return 0

        with sqlite3.connect(path) as conn:
            conn.executemany(WAITING_RUNS, [(f"r{i}", i, i) for i in range(runs)])
            conn.commit()
            conn.set_progress_handler(count, 1)
            params = {"now": time.time(), "workflows": json.dumps(["wf|1"])}
            ((due, _),) = conn.execute(queries("sqlite")["next_wakeup"], params).fetchall()
        assert due == 1e15
        work.append(steps)
    assert work[1] == work[0], work


def test_a_postgres_idle_workers_wakeup_stops_at_the_first_run_due(postgres_schema: str) -> None:
    """Likewise on PostgreSQL, as the store sends the read (held to the index's order, like
    a claim), on a backlog the table's statistics do not know yet."""
    import asyncio
    import json

    import psycopg

    from durably.store.postgres import PostgresStore
    from tests.conftest import postgres_schema_url

    url = postgres_schema_url(postgres_schema)
    store = PostgresStore(url)
    asyncio.run(store.migrate())
    sql = queries("postgres")
    with psycopg.connect(url) as conn:
        conn.execute(
            "INSERT INTO durably_runs (run_id, tenant_id, workflow, workflow_version, status,"
            " input_json, input_hash, available_at, created_at, updated_at)"
            " SELECT 'r' || i, 'default', 'wf', '1', 'waiting_approval', '{}', 'h', 1e15, i, i"
            " FROM generate_series(1, 3000) AS i"
        )
        before, read, after = next(store._in_claim_order(("next_wakeup", {}))).queries
        assert read[0] == "next_wakeup"
        conn.execute(sql[before[0]])
        (plan,) = conn.execute(
            "EXPLAIN (ANALYZE, FORMAT JSON) " + sql["next_wakeup"], {"workflows": ["wf|1"]}
        ).fetchone()
        conn.execute(sql[after[0]])
        conn.rollback()
    text = json.dumps(plan)
    assert "Sort" not in text, text
    scans = runnable_index_scans(plan)
    assert [(s["Actual Rows"], s.get("Rows Removed by Filter", 0)) for s in scans] == [(1, 0)]
