"""A real ``durably serve`` subprocess over ``tests.server.consoleapp``, spoken to in raw HTTP.

Raw ``http.client`` requests, so a test controls every byte a hostile client could: the
``Host`` header, undecodable paths, bodies that are not JSON, a Content-Length it never
honours. :func:`fingerprint` is the database as bytes (SQLite) or rows (PostgreSQL), to show
that a refused request changed nothing at all.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

APP = "tests.server.consoleapp:app"
TOKEN = "s3cret-token-for-the-console-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
# 32 random-looking bytes, base64, as Standard Webhooks secrets are written.
WEBHOOK_SECRET = "whsec_" + "dGhpcnR5LXR3by1ieXRlcy1vZi13ZWJob29rLWtleSE="


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")


class Served:
    """One ``durably serve`` process; stopped by :meth:`stop` (SIGTERM, then SIGKILL)."""

    def __init__(
        self,
        database_url: str,
        log: Path,
        *args: str,
        env: Mapping[str, str | None] = {},
        timeout: float = 20,
    ) -> None:
        full_env = {
            k: v
            for k, v in os.environ.items()
            if k not in {"DURABLY_API_TOKEN", "DURABLY_WEBHOOK_SECRETS", "DURABLY_ALLOWED_HOSTS"}
        }
        full_env.update({k: v for k, v in env.items() if v is not None})
        self.log = log
        self._log_file = log.open("wb")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "durably",
                "--app",
                APP,
                "--db",
                database_url,
                "serve",
                "--port",
                "0",
                *args,
            ],
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
        )
        self.port = self._wait_for_port(timeout)
        # Opening the store may create its WAL file: done here, before any test looks.
        health = self.request("GET", "/api/health")
        assert health.status == 200, health.text

    def _wait_for_port(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(rb"Uvicorn running on http://\S+:(\d+)", self.log.read_bytes())
            if found:
                return int(found.group(1))
            if self.process.poll() is not None:
                raise AssertionError(f"durably serve exited early:\n{self.output()}")
            time.sleep(0.05)
        self.stop()
        raise AssertionError(f"durably serve did not start in {timeout}s:\n{self.output()}")

    def output(self) -> str:
        return self.log.read_bytes().decode("utf-8", "replace")

    def request(
        self,
        method: str,
        path: str,
        body: bytes | Any = None,
        headers: Mapping[str, str] = {},
        *,
        host: str | None = None,
        timeout: float = 10,
    ) -> Reply:
        """One request on a fresh connection; ``body`` bytes are sent as they are, anything
        else as JSON. ``host`` replaces the Host header (default ``127.0.0.1:<port>``)."""
        if body is not None and not isinstance(body, bytes):
            body = json.dumps(body).encode()
        sent = {"Host": f"127.0.0.1:{self.port}" if host is None else host, **headers}
        if body is not None:
            sent.setdefault("Content-Type", "application/json")
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
            for name, value in sent.items():
                conn.putheader(name, value)
            if body is not None and "Content-Length" not in sent:
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body)
            response = conn.getresponse()
            return Reply(
                response.status,
                {k.lower(): v for k, v in response.getheaders()},
                response.read(),
            )
        finally:
            conn.close()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self._log_file.close()


def serve_cli(database_url: str, log: Path, *args: str, **env: str | None) -> Served:
    """``durably serve`` with the test token and webhook secret unless ``env`` says otherwise."""
    defaults: dict[str, str | None] = {
        "DURABLY_API_TOKEN": TOKEN,
        "DURABLY_WEBHOOK_SECRETS": WEBHOOK_SECRET,
    }
    return Served(database_url, log, *args, env={**defaults, **env})


def fingerprint(database_url: str) -> str:
    """A digest of everything stored: the SQLite file and its WAL byte for byte, or every
    row of every table of the PostgreSQL test schema."""
    digest = hashlib.sha256()
    if database_url.startswith("sqlite:"):
        path = Path(database_url.removeprefix("sqlite:///"))
        for part in (path, Path(f"{path}-wal")):
            digest.update(part.name.encode() + b"\0")
            digest.update(part.read_bytes() if part.exists() else b"<absent>")
        return digest.hexdigest()
    import psycopg

    with psycopg.connect(database_url, autocommit=True) as conn:
        tables = [
            r[0]
            for r in conn.execute(
                "SELECT table_name FROM information_schema.tables "
                "WHERE table_schema = current_schema() ORDER BY table_name"
            )
        ]
        for table in tables:
            rows = conn.execute(
                f'SELECT row_to_json(t)::text FROM "{table}" t ORDER BY 1'
            ).fetchall()
            digest.update(table.encode() + b"\0")
            for (row,) in rows:
                digest.update(row.encode() + b"\n")
    return digest.hexdigest()


def prepare(database_url: str) -> None:
    """Runs a request could change: ``o-1`` waits for an approval, ``w-1`` for an event
    ``go``, ``b-1`` is paused on the UNKNOWN effect ``charge#1``. The driver is closed
    before the server starts, so that nothing but the server touches the database. Runs in
    a thread of its own: Playwright's sync API keeps an event loop on the test's."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        pool.submit(_prepare, database_url).result()


def _prepare(database_url: str) -> None:
    from tests.server.consoleapp import build_app

    app = build_app(database_url)
    try:
        app.start("ordering", "ann", run_id="o-1")
        app.start("waiter", run_id="w-1")
        app.start("billing", 5, run_id="b-1")
        app.worker().run(until_idle=True)
        assert [app.get_run(r).status.value for r in ("o-1", "w-1", "b-1")] == [
            "waiting_approval",
            "waiting_external",
            "paused",
        ]
    finally:
        app.close()


def write_sql(database_url: str, sql: str, params: Sequence[object] = ()) -> None:
    """Write behind durably's back: rows as an older version could have left them."""
    from tests.conftest import execute_sql

    execute_sql(database_url, sql, tuple(params))


def clone_run(database_url: str, source: str, run_id: str) -> None:
    """A copy of run ``source``'s row under ``run_id``, which today's validation would refuse
    (an old row): ids are checked where runs start, not where they are read."""
    if database_url.startswith("sqlite:"):
        import sqlite3

        with sqlite3.connect(database_url.removeprefix("sqlite:///")) as conn:
            conn.row_factory = sqlite3.Row
            row = dict(
                conn.execute("SELECT * FROM durably_runs WHERE run_id = ?", (source,)).fetchone()
            )
            row["run_id"] = run_id
            marks = ", ".join("?" for _ in row)
            conn.execute(
                f"INSERT INTO durably_runs ({', '.join(row)}) VALUES ({marks})", list(row.values())
            )
        conn.close()
        return
    import psycopg
    from psycopg.rows import dict_row

    with psycopg.connect(database_url, autocommit=True, row_factory=dict_row) as pg:
        found = pg.execute("SELECT * FROM durably_runs WHERE run_id = %s", (source,)).fetchone()
        assert found is not None
        found["run_id"] = run_id
        marks = ", ".join("%s" for _ in found)
        pg.execute(
            f"INSERT INTO durably_runs ({', '.join(found)}) VALUES ({marks})".encode(),
            list(found.values()),
        )
