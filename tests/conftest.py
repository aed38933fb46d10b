"""Fixtures shared by the suite: one parametrised database URL per store backend.

PostgreSQL is ``$DURABLY_TEST_POSTGRES_URL`` when set; otherwise a throwaway cluster of the
session's own (:mod:`tests.pg`), started when the first test needs it and destroyed when the
session ends. Its URL is known from the start (its port is reserved at import), so
``POSTGRES_URL`` is a plain constant. Its tests fail when it cannot be reached, never skip.
"""

from __future__ import annotations

import contextlib
import os
import sys
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import durably
from tests import pg

# Every backend the contract suite runs against.
BACKENDS = ["sqlite", "postgres"]
_OWN_SERVER = None if os.environ.get("DURABLY_TEST_POSTGRES_URL") else pg.Reserved()
POSTGRES_URL = _OWN_SERVER.url if _OWN_SERVER else os.environ["DURABLY_TEST_POSTGRES_URL"]


def say(config: pytest.Config, line: str) -> None:
    """Show ``line`` on the terminal now, even from inside a captured test."""
    capture = config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        if config.pluginmanager.getplugin("terminalreporter") is None:
            print(line, file=sys.stderr)
            return
        terminal = config.get_terminal_writer()
        if terminal.width_of_current_line:  # after a file's progress dots
            terminal.line()
        terminal.line(line)


def start_postgres(config: pytest.Config) -> str:
    """``POSTGRES_URL``, running: the session's own server is started on the first call.

    If it cannot start (PostgreSQL is not installed, say) the session ends with one message
    saying why, rather than every PostgreSQL test failing with it.
    """
    if _OWN_SERVER is None or _OWN_SERVER.cluster is not None:
        return POSTGRES_URL
    say(
        config,
        f"durably tests: starting a throwaway PostgreSQL for this session at {POSTGRES_URL} "
        "(set DURABLY_TEST_POSTGRES_URL to use another server)",
    )
    try:
        _OWN_SERVER.start()
    except (pg.PostgresMissing, RuntimeError) as exc:
        pytest.exit(f"durably tests: {exc}", returncode=pytest.ExitCode.USAGE_ERROR)
    return POSTGRES_URL


def pytest_unconfigure() -> None:
    """The session's own server goes with the session, whatever ended it."""
    if _OWN_SERVER is not None:
        _OWN_SERVER.close()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before any fixture of the test: what it needs from the machine."""
    # A module that imports POSTGRES_URL connects to it itself, possibly from a fixture
    # wider than the test's: its server must run before that fixture does.
    module = getattr(item, "module", None)
    if module is not None and "POSTGRES_URL" in vars(module):
        start_postgres(item.config)
    # The console tests' browser fixture launches Chromium by its path (browser.CHROMIUM).
    if "browser" in getattr(item, "fixturenames", ()):
        from tests.server.browser import ChromiumMissing, chromium

        try:
            chromium(lambda line: say(item.config, f"durably tests: {line}"))
        except ChromiumMissing as exc:
            pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def postgres_server(pytestconfig: pytest.Config) -> str:
    """The URL of the PostgreSQL server the tests use, running (see :func:`start_postgres`)."""
    return start_postgres(pytestconfig)


def postgres_schema_url(schema: str) -> str:
    """A URL whose connections see only ``schema`` (a fresh one per test)."""
    return f"{POSTGRES_URL}?options=-csearch_path%3D{schema}"


@pytest.fixture
def postgres_schema(postgres_server: str) -> Iterator[str]:
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


def fetch_sql(
    database_url: str, sql: str, params: tuple[object, ...] = ()
) -> list[tuple[Any, ...]]:
    """Read the database behind durably's back (what it holds, not what it reports)."""
    if database_url.startswith("sqlite:"):
        import sqlite3

        with contextlib.closing(sqlite3.connect(database_url.removeprefix("sqlite:///"))) as conn:
            return list(conn.execute(sql, params).fetchall())
    import psycopg

    with psycopg.connect(database_url, autocommit=True) as pg:
        return list(pg.execute(sql.replace("?", "%s").encode(), params).fetchall())


@pytest.fixture
def bump_schema() -> Callable[[str], None]:
    def bump(database_url: str) -> None:
        execute_sql(
            database_url,
            "INSERT INTO durably_schema_migrations (version, name, applied_at) "
            "VALUES (9999, 'from_the_future', 0)",
        )

    return bump
