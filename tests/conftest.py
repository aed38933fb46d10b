"""Fixtures shared by the suite: one parametrised database URL per store backend."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest

import durably

# Every backend the contract suite runs against. PostgreSQL must be reachable: a test that
# cannot connect fails, it is never skipped (.ci/run starts the server).
BACKENDS = ["sqlite", "postgres"]
POSTGRES_URL = os.environ.get(
    "DURABLY_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
)


def postgres_schema_url(schema: str) -> str:
    """A URL whose connections see only ``schema`` (a fresh one per test)."""
    return f"{POSTGRES_URL}?options=-csearch_path%3D{schema}"


@pytest.fixture
def postgres_schema() -> Iterator[str]:
    import psycopg

    schema = f"durably_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    yield schema
    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA "{schema}" CASCADE')


@pytest.fixture(params=BACKENDS)
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/durably.db"
    schema: str = request.getfixturevalue("postgres_schema")
    return postgres_schema_url(schema)


@pytest.fixture
def make_app(database_url: str) -> Iterator[Callable[..., durably.App]]:
    apps: list[durably.App] = []

    def make(**options: object) -> durably.App:
        options.setdefault("lease_ttl", timedelta(seconds=5))
        app = durably.App(database_url, **options)  # type: ignore[arg-type]
        apps.append(app)
        return app

    yield make
    for app in apps:
        app.close()


def execute_sql(database_url: str, sql: str, params: tuple[object, ...] = ()) -> None:
    """Write to the database behind durably's back (to corrupt or age it on purpose)."""
    if database_url.startswith("sqlite:"):
        import sqlite3

        with sqlite3.connect(database_url.removeprefix("sqlite:///")) as conn:
            conn.execute(sql, params)
        return
    import psycopg

    with psycopg.connect(database_url, autocommit=True) as pg:
        pg.execute(sql.replace("?", "%s").encode(), params)


@pytest.fixture
def bump_schema() -> Callable[[str], None]:
    def bump(database_url: str) -> None:
        execute_sql(
            database_url,
            "INSERT INTO durably_schema_migrations (version, name, applied_at) "
            "VALUES (9999, 'from_the_future', 0)",
        )

    return bump
