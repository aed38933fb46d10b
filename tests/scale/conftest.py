"""Harness of the scale tests: many real worker processes over one PostgreSQL schema.

Each test gets a fresh schema (``postgres_schema``) on the suite's server (or, if it stops or
restarts PostgreSQL, a throwaway server of its own: ``pg_cluster``), the example shop in its
own process (one per module, reset before each test) as the ground truth of what happened, and a
:class:`Scale` that starts runs, spawns worker processes (the real ``durably worker`` CLI,
or ``tests.scale.runner`` for a synchronised start), and reads the database directly.
Every process it spawns is bounded by timeouts and killed and reaped at teardown, whatever
the test did to it (SIGSTOP included).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import psycopg
import pytest
from psycopg.rows import dict_row

from durably.demo.shop import ShopService
from tests.conftest import POSTGRES_URL, postgres_schema_url
from tests.pg import Cluster, throwaway_cluster
from tests.scale import scaleapp

ROOT = Path(__file__).resolve().parents[2]
APP_SPEC = "tests.scale.scaleapp:app"
FINAL = ("completed", "failed", "cancelled")
STUCK = ("queued", "running", "reconciling")
_EXIT_LINE = re.compile(r"durably worker (\S+): executed (\d+) run\(s\)")


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, every: float = 0.05) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(every)


def pid_of(worker_id: str) -> int:
    """The pid inside a worker id (``worker:host:pid:random``)."""
    return int(worker_id.split(":")[2])


@dataclass
class WorkerProc:
    """One worker subprocess; stdout and stderr go to files (no pipe can fill up)."""

    name: str
    proc: subprocess.Popen[bytes]
    out_path: Path
    err_path: Path
    files: list[IO[bytes]]
    stopped: bool = False
    """SIGSTOPped and not continued since (teardown continues it before killing)."""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def handles_sigterm(self) -> bool:
        """The process has installed its SIGTERM handler (the worker loop is running).

        Before that, during its imports, SIGTERM would simply kill it (exit -15).
        """
        try:
            status = Path(f"/proc/{self.pid}/status").read_text()
        except OSError:
            return False
        caught = next(line for line in status.splitlines() if line.startswith("SigCgt:"))
        return bool(int(caught.split()[1], 16) & (1 << (signal.SIGTERM - 1)))

    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def exit_line(self) -> tuple[str, int] | None:
        """(worker id, runs executed) from the CLI's last words, if it got to say them."""
        found = _EXIT_LINE.findall(self.stderr())
        return (found[-1][0], int(found[-1][1])) if found else None

    def result(self) -> dict[str, Any]:
        """The runner's JSON summary (its last stdout line)."""
        lines = self.stdout().strip().splitlines()
        assert lines, f"{self.name} printed nothing; stderr:\n{self.stderr()[-3000:]}"
        summary: dict[str, Any] = json.loads(lines[-1])
        return summary

    def explain(self) -> str:
        return (
            f"{self.name} (pid {self.pid}, exit {self.proc.returncode})\n--- stderr ---\n"
            f"{self.stderr()[-3000:]}"
        )

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{self.name} did not exit within {timeout} s\n{self.explain()}")

    def signal(self, sig: signal.Signals) -> None:
        if self.alive():
            os.kill(self.pid, sig)
        if sig is signal.SIGSTOP:
            self.stopped = True
        elif sig is signal.SIGCONT:
            self.stopped = False

    def kill(self) -> None:
        """SIGKILL and reap (a stopped process dies of SIGKILL too)."""
        if self.alive():
            self.proc.kill()
        self.proc.wait(timeout=30)

    def terminate(self, timeout: float = 10.0) -> int:
        """SIGTERM (the worker releases its runs at the next boundary), then SIGKILL.

        Waits first (up to ``timeout``) for the worker to handle SIGTERM at all.
        """
        deadline = time.monotonic() + timeout
        while self.alive() and not self.handles_sigterm() and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.alive():
            if self.stopped:
                self.signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        return self.proc.returncode

    def close(self) -> None:
        try:
            if self.alive():
                if self.stopped:
                    os.kill(self.pid, signal.SIGCONT)
                self.proc.kill()
            self.proc.wait(timeout=30)
        finally:
            for f in self.files:
                f.close()


class Db:
    """Reads of the durably schema straight from PostgreSQL (fresh connection per call)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def rows(self, sql: str, params: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
        with psycopg.connect(self.url, autocommit=True, row_factory=dict_row) as conn:
            return conn.execute(sql.encode(), params).fetchall()

    def try_rows(self, sql: str, params: tuple[Any, ...] = ()) -> list[dict[str, Any]] | None:
        """``rows``, or None while the server cannot be reached (during a restart)."""
        try:
            return self.rows(sql, params)
        except psycopg.OperationalError:
            return None

    def statuses(self) -> Counter[str]:
        rows = self.rows("SELECT status, count(*) AS n FROM durably_runs GROUP BY status")
        return Counter({r["status"]: int(r["n"]) for r in rows})

    def runs(self) -> dict[str, dict[str, Any]]:
        return {r["run_id"]: r for r in self.rows("SELECT * FROM durably_runs")}

    def events(self) -> dict[str, list[dict[str, Any]]]:
        """Every run's events in sequence order, payloads decoded."""
        by_run: dict[str, list[dict[str, Any]]] = {}
        for r in self.rows(
            "SELECT run_id, sequence, type, step_id, payload_json FROM durably_events "
            "ORDER BY run_id, sequence"
        ):
            r["payload"] = json.loads(r.pop("payload_json") or "null")
            by_run.setdefault(r["run_id"], []).append(r)
        return by_run

    def lease_expired(self, run_id: str) -> bool:
        """Nobody holds a live lease on the run (judged by the server's clock)."""
        rows = self.rows(
            "SELECT lease_owner IS NULL OR lease_until < extract(epoch FROM now()) AS free "
            "FROM durably_runs WHERE run_id = %s",
            (run_id,),
        )
        return bool(rows and rows[0]["free"])


@dataclass(frozen=True)
class Started:
    run_id: str
    customer: str
    campaign: str


@dataclass
class Scale:
    """One test's world: a schema, the shop, the runs started and the worker processes."""

    url: str
    shop: ShopService
    tmp_path: Path
    db: Db = field(init=False)
    runs: list[Started] = field(default_factory=list)
    workers: list[WorkerProc] = field(default_factory=list)
    _spawned: int = 0

    def __post_init__(self) -> None:
        self.db = Db(self.url)

    # -- runs -------------------------------------------------------------------------

    def start_runs(self, n: int, campaign: str = "spring") -> list[Started]:
        """Queue ``n`` purchase runs, each for its own new customer."""
        app = scaleapp.build(self.url)
        tag = uuid.uuid4().hex[:8]
        try:
            for i in range(n):
                customer = f"cust-{tag}-{i:03d}"
                run_id = f"run-{tag}-{i:03d}"
                app.start(scaleapp.WORKFLOW, run_id=run_id, customer=customer, campaign=campaign)
                self.runs.append(Started(run_id, customer, campaign))
        finally:
            app.close()
        return self.runs[-n:]

    # -- worker processes -------------------------------------------------------------

    def env(self, **extra: str) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("DURABLY_") and k not in ("SCALE_TOOL_DELAY", "SHOP_URL")
        }
        env |= {
            "DURABLY_DATABASE_URL": self.url,
            "SHOP_URL": self.shop.url,
            "SHOP_TIMEOUT": "10",
            "PYTHONUNBUFFERED": "1",
        }
        return env | extra

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> WorkerProc:
        self._spawned += 1
        stem = self.tmp_path / f"{self._spawned:03d}-{name}"
        out, err = Path(f"{stem}.out"), Path(f"{stem}.err")
        files = [out.open("wb"), err.open("wb")]
        try:
            proc = subprocess.Popen(
                [sys.executable, *argv],
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=files[0],
                stderr=files[1],
            )
        except BaseException:
            for f in files:
                f.close()
            raise
        worker = WorkerProc(name, proc, out, err, files)
        self.workers.append(worker)
        return worker

    def worker(
        self,
        name: str,
        *,
        concurrency: int = 1,
        lease_ttl: float = 1.0,
        until_idle: bool = False,
        tool_delay: float = 0.0,
    ) -> WorkerProc:
        """``python -m durably --app tests.scale.scaleapp:app worker ...``"""
        argv = ["-m", "durably", "--app", APP_SPEC, "worker"]
        argv += ["--concurrency", str(concurrency), "--lease-ttl", str(lease_ttl)]
        if until_idle:
            argv.append("--until-idle")
        return self._spawn(name, argv, self.env(SCALE_TOOL_DELAY=str(tool_delay)))

    def synchronised_worker(
        self, name: str, go_file: Path, *, concurrency: int, lease_ttl: float = 5.0
    ) -> WorkerProc:
        """``tests.scale.runner``: an until-idle worker that starts when ``go_file`` appears."""
        argv = ["-m", "tests.scale.runner", str(go_file), str(concurrency), str(lease_ttl)]
        return self._spawn(name, argv, self.env())

    def close(self) -> None:
        errors = []
        for worker in self.workers:
            try:
                worker.close()
            except Exception as exc:  # pragma: no cover - teardown must reach every process
                errors.append(exc)
        if errors:
            raise errors[0]

    # -- the shop, the ground truth ---------------------------------------------------

    def shop_counts(self) -> dict[str, tuple[int, int, int]]:
        """Per customer of this test: (orders, coupons, emails) the shop holds."""
        effects = self.shop.effects()
        orders = Counter(r["request"]["customer"] for r in effects["orders"])
        coupons = Counter(r["request"]["customer"] for r in effects["coupons"])
        emails = Counter(r["request"]["to"] for r in effects["emails"])
        return {
            s.customer: (
                orders[s.customer],
                coupons[s.customer],
                emails[scaleapp.email_of(s.customer)],
            )
            for s in self.runs
        }

    def assert_each_effect_once(self) -> dict[str, Any]:
        """Every customer has exactly one order, one coupon and one email; nobody else has any."""
        effects = self.shop.effects()
        counts = self.shop_counts()
        wrong = {c: n for c, n in counts.items() if n != (1, 1, 1)}
        assert not wrong, f"(orders, coupons, emails) per customer, expected (1, 1, 1): {wrong}"
        n = len(self.runs)
        assert (len(effects["orders"]), len(effects["coupons"]), len(effects["emails"])) == (
            n,
            n,
            n,
        ), "the shop holds effects of customers that no run of this test has"
        return effects


@pytest.fixture(scope="module")
def shop_service() -> Iterator[ShopService]:
    with ShopService() as service:
        yield service


def _shared_server_started_at() -> object:
    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        row = conn.execute("SELECT pg_postmaster_start_time()").fetchone()
    return row[0] if row else None


@pytest.fixture(autouse=True)
def _shared_server_untouched(postgres_server: str) -> Iterator[None]:
    """No scale test stops or restarts the suite's PostgreSQL: every other test runs on it."""
    started_at = _shared_server_started_at()
    yield
    assert _shared_server_started_at() == started_at, (
        f"the suite's PostgreSQL ({POSTGRES_URL}) was restarted by this test; stop or restart "
        "only a throwaway server (the pg_cluster fixture)"
    )


@pytest.fixture
def pg_cluster() -> Iterator[Cluster]:
    """A PostgreSQL server of the test's own, to stop and restart: never the shared one."""
    with throwaway_cluster() as cluster:
        yield cluster


@pytest.fixture
def scale(
    request: pytest.FixtureRequest, shop_service: ShopService, tmp_path: Path
) -> Iterator[Scale]:
    """The test's world: on a fresh schema of the suite's server or, for a test that also
    asks for ``pg_cluster`` (to stop or restart it), on that throwaway server."""
    if "pg_cluster" in request.fixturenames:
        url = request.getfixturevalue("pg_cluster").url
    else:
        url = postgres_schema_url(request.getfixturevalue("postgres_schema"))
    shop_service.reset()
    s = Scale(url, shop_service, tmp_path)
    try:
        yield s
    finally:
        s.close()
        shop_service.clear_faults()
