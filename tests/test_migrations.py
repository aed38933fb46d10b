"""Schema migrations: the shipped snapshot is what the migrations produce."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

import pytest

from durably.errors import StoreError
from durably.store.migrations import migrations, schema_snapshot, split_statements
from durably.store.sqlite import SQLiteStore


def sqlite_schema(path: Path) -> list[tuple[str, str]]:
    with sqlite3.connect(path) as conn:
        rows = conn.execute(
            "SELECT name, sql FROM sqlite_master WHERE sql IS NOT NULL "
            "AND name NOT LIKE 'sqlite_%' ORDER BY name"
        ).fetchall()
    return [(name, " ".join(sql.split())) for name, sql in rows]


def test_sqlite_migrations_produce_the_snapshot(tmp_path: Path) -> None:
    """Every migration in turn builds the schema a new database gets from the snapshot."""
    migrated = tmp_path / "migrated.db"
    store = SQLiteStore(f"sqlite:///{migrated}")
    for m in migrations("sqlite"):
        assert store.apply_migration(m.version, m.name, m.sql)
    created = tmp_path / "created.db"
    assert asyncio.run(SQLiteStore(f"sqlite:///{created}").migrate()) == [
        m.version for m in migrations("sqlite")
    ]
    assert sqlite_schema(migrated) == sqlite_schema(created)
    assert applied_migrations(migrated) == applied_migrations(created)


def applied_migrations(path: Path) -> list[tuple[int, str]]:
    with sqlite3.connect(path) as conn:
        return conn.execute("SELECT version, name FROM durably_schema_migrations").fetchall()


def test_a_new_database_that_fails_midway_is_left_empty(tmp_path: Path) -> None:
    """The snapshot is one transaction: a failure in it leaves no table behind, and the
    next migrate creates the schema whole."""
    url = f"sqlite:///{tmp_path}/new.db"
    store = SQLiteStore(url)
    first = split_statements(schema_snapshot("sqlite"))[:3]
    failing = ["CREATE TABLE positive (a CHECK (a > 0));", "INSERT INTO positive VALUES (0);"]
    broken = "\n".join([*first, *failing])
    with pytest.raises(StoreError, match="creating its schema failed: CHECK constraint"):
        store.create_schema(broken, migrations("sqlite"))
    assert store.schema_version() == 0
    assert sqlite_schema(tmp_path / "new.db") == []
    assert asyncio.run(store.migrate()) == [m.version for m in migrations("sqlite")]


def test_concurrent_stores_migrate_once(tmp_path: Path) -> None:
    """Two processes' stores opening one new file: each migration is applied once."""
    url = f"sqlite:///{tmp_path}/shared.db"
    first, second = SQLiteStore(url), SQLiteStore(url)
    applied = asyncio.run(first.migrate()) + asyncio.run(second.migrate())
    assert applied == [m.version for m in migrations("sqlite")]


def postgres_catalog(url: str, schema: str) -> list[tuple[object, ...]]:
    import psycopg

    with psycopg.connect(url) as conn:
        columns = conn.execute(
            "SELECT table_name, column_name, data_type, domain_name, is_nullable, column_default "
            "FROM information_schema.columns WHERE table_schema = %s ORDER BY 1, 2",
            (schema,),
        ).fetchall()
        indexes = conn.execute(
            "SELECT tablename, indexname, replace(indexdef, %s, '') FROM pg_indexes "
            "WHERE schemaname = %s ORDER BY 1, 2",
            (f"{schema}.", schema),
        ).fetchall()
        # A domain's constraints have no table (conrelid 0 shows as "-").
        checks = conn.execute(
            "SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid) "
            "FROM pg_constraint WHERE connamespace = %s::regnamespace ORDER BY 1, 2",
            (schema,),
        ).fetchall()
        triggers = conn.execute(
            "SELECT event_object_table, trigger_name, action_timing, event_manipulation, "
            "action_statement FROM information_schema.triggers WHERE trigger_schema = %s "
            "ORDER BY 1, 2",
            (schema,),
        ).fetchall()
        functions = conn.execute(
            "SELECT proname, prosrc FROM pg_proc WHERE pronamespace = %s::regnamespace ORDER BY 1",
            (schema,),
        ).fetchall()
    return [
        *columns,
        *indexes,
        *[(t.split(".")[-1], n, d) for t, n, d in checks],
        *triggers,
        *functions,
    ]


def test_postgres_migrations_produce_the_snapshot(postgres_schema: str) -> None:
    import psycopg

    from durably.store.postgres import PostgresStore, _MigrationTarget
    from tests.conftest import POSTGRES_URL, postgres_schema_url

    migrated = postgres_schema_url(postgres_schema)
    with _MigrationTarget(migrated, 10) as target:
        for m in migrations("postgres"):
            assert target.apply_migration(m.version, m.name, m.sql)
    snapshot_schema = f"{postgres_schema}_snap"
    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{snapshot_schema}"')
    try:
        snapshot = postgres_schema_url(snapshot_schema)
        assert asyncio.run(PostgresStore(snapshot).migrate()) == [
            m.version for m in migrations("postgres")
        ]
        assert postgres_catalog(migrated, postgres_schema) == postgres_catalog(
            snapshot, snapshot_schema
        )
        with psycopg.connect(migrated) as one, psycopg.connect(snapshot) as other:
            applied = "SELECT version, name FROM durably_schema_migrations ORDER BY version"
            assert one.execute(applied).fetchall() == other.execute(applied).fetchall()
    finally:
        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA "{snapshot_schema}" CASCADE')


def test_concurrent_postgres_migrations_apply_once(postgres_schema: str) -> None:
    """Eight migrators racing on one empty schema: the advisory lock lets one create it, and
    the others, once it is theirs, see that it did (a migrator holding one connection for
    all its work found the table missing from its catalog cache, and created it again)."""
    from concurrent.futures import ThreadPoolExecutor

    from durably.store.migrations import Migrator
    from durably.store.postgres import _MigrationTarget
    from tests.conftest import postgres_schema_url

    url = postgres_schema_url(postgres_schema)

    def migrate(_: int) -> list[int]:
        with _MigrationTarget(url, 10) as target:
            return Migrator("postgres", target).apply()

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(migrate, range(8)))
    assert sorted(v for r in results for v in r) == [m.version for m in migrations("postgres")]


def test_migrators_queued_on_a_schema_named_in_quotes_create_it_once(
    postgres_server: str,
) -> None:
    """Four migrators wait for the migration lock on a new schema whose name needs quotes,
    beside an empty schema named like it in lower case; let go at once, one creates it and
    the others see that it did, in their own schema, not in its lower-case twin."""
    import urllib.parse
    import uuid
    from concurrent.futures import ThreadPoolExecutor

    import psycopg

    from durably.store.migrations import Migrator
    from durably.store.postgres import _MigrationTarget
    from tests.conftest import POSTGRES_URL

    quoted = f"Durably_Test_{uuid.uuid4().hex[:8]}.x"
    twin = quoted.lower()
    options = urllib.parse.quote(f'-csearch_path="{quoted}"', safe="")
    url = f"{POSTGRES_URL}?options={options}"

    def migrate(_: int) -> list[int]:
        with _MigrationTarget(url, 10) as target:
            return Migrator("postgres", target).apply()

    with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
        admin.execute(f'CREATE SCHEMA "{quoted}"')
        admin.execute(f'CREATE SCHEMA "{twin}"')
        try:
            with ThreadPoolExecutor(4) as pool:
                with admin.transaction():
                    admin.execute("SELECT pg_advisory_xact_lock(%s)", (_MigrationTarget.LOCK,))
                    racing = [pool.submit(migrate, i) for i in range(4)]
                    while admin.execute(
                        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                    ).fetchone() != (4,):
                        time.sleep(0.01)
                applied = [f.result() for f in racing]
            assert sorted(v for a in applied for v in a) == [
                m.version for m in migrations("postgres")
            ]
            recorded = admin.execute(
                f'SELECT version FROM "{quoted}".durably_schema_migrations ORDER BY version'
            ).fetchall()
            assert [v for (v,) in recorded] == [m.version for m in migrations("postgres")]
            in_twin = admin.execute(
                "SELECT count(*) FROM pg_class WHERE relnamespace = "
                "(SELECT oid FROM pg_namespace WHERE nspname = %s)",
                (twin,),
            ).fetchone()
            assert in_twin == (0,)
        finally:
            admin.execute(f'DROP SCHEMA "{quoted}" CASCADE')
            admin.execute(f'DROP SCHEMA "{twin}" CASCADE')


def test_postgres_statuses_become_domains_in_place_over_existing_rows(postgres_schema: str) -> None:
    """A database at migration 7 holding a run, its step and its operation: the migrations
    since keep every row and status, rewrite no table (each keeps its file), and afterwards
    a status outside its domain and a run's deletion are refused."""
    import psycopg

    from durably.store.migrations import Migrator
    from durably.store.postgres import _MigrationTarget
    from tests.conftest import postgres_schema_url

    url = postgres_schema_url(postgres_schema)
    tables = ("durably_runs", "durably_steps", "durably_tool_operations", "durably_approvals")
    statuses = (
        "SELECT r.status, s.kind, s.status, o.status FROM durably_runs r "
        "JOIN durably_steps s USING (run_id) JOIN durably_tool_operations o USING (run_id)"
    )
    with _MigrationTarget(url, 10) as target, psycopg.connect(url, autocommit=True) as conn:
        for m in migrations("postgres"):
            if m.version <= 7:
                assert target.apply_migration(m.version, m.name, m.sql)
        conn.execute(
            "INSERT INTO durably_runs (run_id, tenant_id, workflow, workflow_version, status, "
            "input_json, input_hash, available_at, created_at, updated_at) "
            "VALUES ('r1', 't', 'wf', '1', 'paused', '{}', 'h', 0, 0, 0)"
        )
        conn.execute(
            "INSERT INTO durably_steps (run_id, step_id, position, kind, name, status, "
            "input_hash, created_at, updated_at) "
            "VALUES ('r1', 'send#1', 1, 'tool', 'send', 'unknown', 'h', 0, 0)"
        )
        conn.execute(
            "INSERT INTO durably_tool_operations (tenant_id, idempotency_key, run_id, step_id, "
            "plan_version, tool_name, tool_version, input_hash, arguments_json, status, "
            "created_at, updated_at) "
            "VALUES ('t', 'k', 'r1', 'send#1', 1, 'send', '1', 'h', '{}', 'unknown', 0, 0)"
        )
        files = [conn.execute("SELECT pg_relation_filenode(%s)", (t,)).fetchone() for t in tables]
        assert Migrator("postgres", target).apply() == [8, 9, 10]
        assert conn.execute(statuses).fetchall() == [("paused", "tool", "unknown", "unknown")]
        assert [
            conn.execute("SELECT pg_relation_filenode(%s)", (t,)).fetchone() for t in tables
        ] == files
        with pytest.raises(psycopg.errors.CheckViolation, match="durably_run_status"):
            conn.execute("UPDATE durably_runs SET status = 'done' WHERE run_id = 'r1'")
        with pytest.raises(psycopg.errors.CheckViolation, match="durably_step_status"):
            conn.execute("UPDATE durably_steps SET status = 'done' WHERE run_id = 'r1'")
        with pytest.raises(psycopg.errors.RestrictViolation, match="cannot be deleted"):
            conn.execute("DELETE FROM durably_runs WHERE run_id = 'r1'")
