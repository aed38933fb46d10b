"""A worker frozen between its claim and its send never sends after another took over.

Worker A claims ``issue_coupon`` (``reconcile=``; the shop does not deduplicate coupons),
then stalls before its request leaves (the tool sleeps 0.5 s, and the test SIGSTOPs A in
that sleep, past its 1 s lease). Worker B takes the run over and asks the shop, which has no
coupon: "not executed". B trusts that only once A's lease deadline plus the reconcile grace
has passed, then sends. A is thawed (SIGCONT): its tool reaches the fenced request, the
lease check refuses it, and A stops. The shop's own records hold exactly one coupon.

Before the fix the shop held two coupons here, on both stores, every time.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from durably.demo.shop import ShopService, get_json
from tests.scale import scaleapp

ROOT = Path(__file__).resolve().parents[2]
APP = "tests.scale.scaleapp:app"
LEASE_TTL_S = 1.0


def rows(database_url: str, sql: str, params: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
    if database_url.startswith("sqlite:"):
        with sqlite3.connect(database_url.removeprefix("sqlite:///")) as db:
            db.row_factory = sqlite3.Row
            return [dict(r) for r in db.execute(sql, params)]
    import psycopg
    from psycopg.rows import dict_row

    with psycopg.connect(database_url, autocommit=True, row_factory=dict_row) as pg:
        return list(pg.execute(sql.replace("?", "%s").encode(), params))


def wait_until(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.01)
    pytest.fail(f"timed out waiting for {what}")


@pytest.fixture
def shop() -> Iterator[ShopService]:
    with ShopService() as service:
        yield service


class Worker:
    def __init__(self, name: str, database_url: str, shop_url: str, tmp: Path, delay: float):
        env = {k: v for k, v in os.environ.items() if not k.startswith("DURABLY_")}
        env |= {
            "DURABLY_DATABASE_URL": database_url,
            "SHOP_URL": shop_url,
            "SCALE_TOOL_DELAY": str(delay),
            "PYTHONUNBUFFERED": "1",
        }
        self.err = tmp / f"{name}.err"
        argv = [sys.executable, "-m", "durably", "--app", APP, "worker", "--until-idle"]
        argv += ["--lease-ttl", str(LEASE_TTL_S)]
        with self.err.open("wb") as err:
            self.proc = subprocess.Popen(
                argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=err, stderr=err
            )

    def log(self) -> str:
        return self.err.read_text(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(10)


def test_a_frozen_worker_does_not_send_after_the_takeover(
    database_url: str, shop: ShopService, tmp_path: Path
) -> None:
    tag = uuid.uuid4().hex[:8]
    customer, run_id = f"cust-{tag}", f"run-{tag}"
    starter = scaleapp.build(database_url)
    try:
        starter.start(scaleapp.WORKFLOW, run_id=run_id, customer=customer, campaign="spring")
    finally:
        starter.close()

    def coupons() -> list[dict[str, Any]]:
        found = get_json(f"{shop.url}/coupons?customer={customer}&campaign=spring")
        return list(found["coupons"])

    def claimed_by_a() -> bool:
        ops = rows(
            database_url,
            "SELECT status, lease_owner FROM durably_tool_operations WHERE step_id = ?",
            ("issue_coupon#1",),
        )
        return bool(ops) and ops[0]["status"] == "executing"

    a = Worker("a", database_url, shop.url, tmp_path, delay=0.5)
    b: Worker | None = None
    try:
        wait_until(claimed_by_a, 60, "A to claim issue_coupon")
        a.proc.send_signal(signal.SIGSTOP)
        assert coupons() == [], "A's request left before the freeze; the test lost its race"

        def lease_expired() -> bool:
            [run] = rows(database_url, "SELECT lease_until FROM durably_runs")
            return run["lease_until"] is not None and run["lease_until"] < time.time() - 0.05

        wait_until(lease_expired, 10, "A's lease to run out")
        b = Worker("b", database_url, shop.url, tmp_path, delay=0.0)
        assert b.proc.wait(60) == 0, b.log()
        [run] = rows(database_url, "SELECT status FROM durably_runs")
        assert run["status"] == "completed", b.log()

        a.proc.send_signal(signal.SIGCONT)
        assert a.proc.wait(30) == 0, a.log()
    finally:
        a.close()
        if b is not None:
            b.close()

    assert len(coupons()) == 1, f"two coupons: A sent after B took over\n{a.log()}"
    effects = shop.effects()
    assert effects["requests_by_method"].get("POST /coupons") == 1, effects["requests_by_method"]
    # A learns it first from its own clock (check_lease) or from its heartbeat, whichever
    # runs first after the thaw; either way it stopped without sending.
    assert f"run {run_id}: stopped" in a.log(), a.log()
    assert "Traceback" not in a.log() + b.log()
