"""Fixtures shared by the suite: one parametrised database URL per store backend."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest

import durably

# Every backend the contract suite runs against; PostgreSQL joins with its backend.
BACKENDS = ["sqlite"]


@pytest.fixture(params=BACKENDS)
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/durably.db"
    raise AssertionError(f"unknown backend {request.param}")


@pytest.fixture
def make_app(database_url: str) -> Iterator[Callable[..., durably.App]]:
    apps: list[durably.App] = []

    def make(**options: object) -> durably.App:
        options.setdefault("lease_ttl", timedelta(seconds=5))
        app = durably.App(database_url, **options)  # type: ignore[arg-type]
        apps.append(app)
        return app

    yield make
    import asyncio

    for app in apps:
        asyncio.run(app.close())


def execute_sql(database_url: str, sql: str, params: tuple[object, ...] = ()) -> None:
    """Write to the database behind durably's back (to corrupt or age it on purpose)."""
    if database_url.startswith("sqlite:"):
        import sqlite3

        with sqlite3.connect(database_url.removeprefix("sqlite:///")) as conn:
            conn.execute(sql, params)
        return
    raise AssertionError(f"no raw SQL access for {database_url}")


@pytest.fixture
def bump_schema() -> Callable[[str], None]:
    def bump(database_url: str) -> None:
        execute_sql(
            database_url,
            "INSERT INTO durably_schema_migrations (version, name, applied_at) "
            "VALUES (9999, 'from_the_future', 0)",
        )

    return bump
