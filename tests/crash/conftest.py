"""Harness of the crash tests: a real shop process, and runs executed in real subprocesses.

The shop (one per test module, reset before each test) is the ground truth: what it holds
is what happened. Each test has its own durably database and its own customer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest

import durably
from durably.demo.shop import ShopService
from durably.store.base import Event

ROOT = Path(__file__).resolve().parents[2]
LEASE_TTL_S = 0.5
"""Short, so recovery after a crash waits little; safe with one worker per run."""
SUBPROCESS_TIMEOUT_S = 60.0

WORKFLOW = {
    "idempotent": "idempotent_once",
    "reconciled": "reconciled_once",
    "neither": "neither_once",
    "classified": "classified_once",
}
TOOL = {
    "idempotent": "idem_tool",
    "reconciled": "reconciled_tool",
    "neither": "plain_tool",
    "classified": "classified_tool",
}
PATH = {"idempotent": "/orders", "reconciled": "/coupons", "neither": "/coupons"}
PATH["classified"] = "/coupons"


def coupon_result(row: dict[str, Any]) -> dict[str, Any]:
    """A coupon row of the shop's /effects as the coupon tools return it (to resolve with)."""
    request = row["request"]
    return {
        "coupon_id": row["id"],
        "customer": request["customer"],
        "campaign": request["campaign"],
        "code": row["code"],
    }


@dataclass(frozen=True)
class Proc:
    """One finished subprocess: exit code, the run it printed (if it got that far), stderr."""

    code: int
    run: dict[str, Any] | None
    stderr: str

    def explain(self) -> str:
        return f"exit {self.code}, run {self.run}\n--- stderr ---\n{self.stderr[-4000:]}"


class Shop:
    """The shop service as the tests read it: effects of one customer, request counts."""

    def __init__(self, service: ShopService) -> None:
        self.service = service
        self.url = service.url

    def effects(self) -> dict[str, Any]:
        return self.service.effects()

    def records(self, kind: str, customer: str) -> list[dict[str, Any]]:
        """The effect rows this customer has at the shop for a tool kind, oldest first."""
        table = "orders" if PATH[kind] == "/orders" else "coupons"
        return [r for r in self.effects()[table] if r["request"]["customer"] == customer]

    def emails(self, customer: str) -> list[dict[str, Any]]:
        """The emails sent to this customer, oldest first."""
        return [r for r in self.effects()["emails"] if r["request"]["to"] == customer]

    def record_ids(self, kind: str, customer: str) -> list[str]:
        return [r["id"] for r in self.records(kind, customer)]

    def requests(self, method: str, path: str) -> int:
        return int(self.effects()["requests_by_method"].get(f"{method} {path}", 0))

    def add_fault(self, path: str, mode: str, seconds: float = 0.0) -> None:
        self.service.add_fault(path, mode, times=1, seconds=seconds)


class Harness:
    """Executes crashapp runs in fresh subprocesses against one database, and inspects it."""

    def __init__(self, shop: Shop, database_url: str) -> None:
        self.shop = shop
        self.database_url = database_url
        self.shop_timeout_s = 5.0
        self.lease_ttl_s = LEASE_TTL_S
        self._app: durably.App | None = None

    # -- subprocesses -----------------------------------------------------------------

    def _spawn(self, args: list[str], crash_at: str | None) -> Proc:
        env = dict(os.environ)
        env.pop("DURABLY_CRASH_AT", None)
        env |= {
            "DURABLY_DATABASE_URL": self.database_url,
            "SHOP_URL": self.shop.url,
            "SHOP_TIMEOUT": str(self.shop_timeout_s),
            "CRASH_LEASE_TTL": str(self.lease_ttl_s),
            "CRASH_ROLE": args[0],
        }
        if crash_at is not None:
            env["DURABLY_CRASH_AT"] = crash_at
        done = subprocess.run(
            [sys.executable, "-m", "tests.crash.runner", *args],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=SUBPROCESS_TIMEOUT_S,
            check=False,
        )
        lines = done.stdout.strip().splitlines()
        run = json.loads(lines[-1]) if done.returncode == 0 and lines else None
        return Proc(done.returncode, run, done.stderr)

    def start(
        self, workflow: str, run_id: str, *, crash_at: str | None = None, **run_input: Any
    ) -> Proc:
        """A new process creates the run and executes it (``app.run``)."""
        return self._spawn(["start", run_id, workflow, json.dumps(run_input)], crash_at)

    def recover(
        self, workflow: str, run_id: str, *, crash_at: str | None = None, **run_input: Any
    ) -> Proc:
        """A fresh process, once the dead one's lease expired, runs the same run id again."""
        return self._spawn(["recover", run_id, workflow, json.dumps(run_input)], crash_at)

    def execute_now(self, run_id: str) -> Proc:
        """A fresh process tries to execute the run at once, without waiting for any lease."""
        return self._spawn(["execute", run_id], None)

    def resume(self, run_id: str) -> Proc:
        """A fresh process resumes the run (``app.resume``)."""
        return self._spawn(["resume", run_id], None)

    def cancel(self, run_id: str) -> Proc:
        """A fresh process cancels the run with compensations (``app.cancel``)."""
        return self._spawn(["cancel", run_id], None)

    def fork(
        self, run_id: str, source: str, at: str, replay: str, *, crash_at: str | None = None
    ) -> Proc:
        """A new process forks ``source`` at ``at`` as ``run_id`` and executes the fork."""
        return self._spawn(["fork", run_id, source, at, replay], crash_at)

    def again(self, run_id: str) -> Proc:
        """A fresh process, once the dead one's lease expired, executes the run again."""
        return self._spawn(["again", run_id], None)

    # -- the store, read (and resolved) from the test process -------------------------

    @property
    def app(self) -> durably.App:
        if self._app is None:
            self._app = durably.App(self.database_url)
        return self._app

    def describe(self, run_id: str) -> dict[str, Any]:
        return self.app.describe(run_id)

    def effect(self, run_id: str, step_id: str) -> dict[str, Any] | None:
        found = [e for e in self.describe(run_id)["effects"] if e["step_id"] == step_id]
        assert len(found) <= 1, found
        return found[0] if found else None

    def effect_status(self, run_id: str, step_id: str) -> str | None:
        """The ledger status of the tool operation at ``step_id`` (None: no operation)."""
        effect = self.effect(run_id, step_id)
        return None if effect is None else str(effect["status"])

    def events(self, run_id: str) -> list[Event]:
        return self.app.events(run_id)

    def resolve(
        self,
        run_id: str,
        step_id: str,
        outcome: Literal["succeeded", "not_executed", "failed"],
        result: Any = None,
    ) -> None:
        """What an operator does after checking the shop: ``app.resolve_effect``."""
        self.app.resolve_effect(run_id, step_id, outcome, result=result)

    def close(self) -> None:
        if self._app is not None:
            self._app.close()
            self._app = None


@pytest.fixture(scope="module")
def shop_service() -> Iterator[ShopService]:
    with ShopService() as service:
        yield service


@pytest.fixture
def shop(shop_service: ShopService) -> Iterator[Shop]:
    shop_service.reset()
    yield Shop(shop_service)
    shop_service.clear_faults()


@pytest.fixture
def harness(shop: Shop, tmp_path: Path) -> Iterator[Harness]:
    h = Harness(shop, f"sqlite:///{tmp_path}/durably.db")
    yield h
    h.close()


@pytest.fixture
def customer() -> str:
    return f"cust-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def run_id() -> str:
    return f"run-{uuid.uuid4().hex[:12]}"
