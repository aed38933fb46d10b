"""The test side of the framework crash matrices: the shop's records by campaign
(:func:`rows`), the journal as stored (:func:`steps`), the fork server of an app module
(:class:`ForkServer`, serving :func:`tests.integrations.shopapp.main`), and
:func:`run_matrix` / :func:`assert_recovered`, which crash each :class:`Scenario` in a
fresh process, carry it on as a person would (approve, settle an unknown outcome from the
shop's records) and judge it from the shop's records, the journal and the run's events.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pytest

import durably
from durably.demo.shop import ShopService
from durably.faults import CRASH_POINTS
from tests.crash.conftest import Proc, coupon_result
from tests.integrations.shopapp import CAMPAIGNS, KINDS, TURNS, plan

ROOT = Path(__file__).resolve().parents[2]


# -- the test side: the shop's and the journal's records -------------------------------------


def rows(shop: ShopService, customer: str) -> dict[str, list[dict[str, Any]]]:
    """The shop's orders and coupons for ``customer``, by campaign."""
    found: dict[str, list[dict[str, Any]]] = {c: [] for c in CAMPAIGNS}
    effects = shop.effects()
    for row in effects["orders"] + effects["coupons"]:
        request = row["request"]
        if request["customer"] == customer:
            campaign = request.get("campaign") or request["items"][0]["sku"]
            found.setdefault(campaign, []).append(row)
    return found


def steps(db: str, run_id: str) -> list[sqlite3.Row]:
    """The run's journal rows, read from the database as stored, oldest first."""
    path = db.removeprefix("sqlite:///")
    if not os.path.exists(path):
        return []
    with sqlite3.connect(path) as conn:
        conn.row_factory = sqlite3.Row
        return conn.execute(
            "SELECT * FROM durably_steps WHERE run_id = ? ORDER BY created_at", (run_id,)
        ).fetchall()


def model_steps(db: str, run_id: str) -> list[sqlite3.Row]:
    return [s for s in steps(db, run_id) if s["name"].startswith("model:")]


def assert_model_calls(app: durably.App, run_id: str, turns: int) -> None:
    """Every turn is one model call record of the scripted model, with its usage, and each
    effect names the model call whose answer asked for it."""
    doc = app.describe(run_id)
    calls = doc["model_calls"]
    assert [c["model"] for c in calls] == ["scripted-1"] * turns
    assert all(c["usage"]["total_tokens"] > 0 and c["input"] is not None for c in calls)
    asked = {i: c["model_call_id"] for c in calls for i in c["tool_call_ids"]}
    assert doc["effects"]
    assert all(e["model_call_id"] == asked[e["step_id"]] for e in doc["effects"])


def turns_recorded(db: str, run_id: str) -> int:
    return sum(s["status"] == "succeeded" for s in model_steps(db, run_id))


# -- the test side: the crash matrix ---------------------------------------------------------


class ForkServer:
    """``python -m <module> serve``: imports a framework once, forks a child per command."""

    def __init__(self, module: str, workdir: Path) -> None:
        self.workdir = workdir
        self.log = (workdir / "server.err").open("w")
        env = {k: v for k, v in os.environ.items() if k != "DURABLY_CRASH_AT"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, "serve"],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            start_new_session=True,  # its own process group: the server and its children
        )
        self.buffer = b""
        self.count = 0
        assert "ready" in self._message(120.0)

    def _message(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.proc.stdout], [], [], max(left, 0))
            if not ready:
                raise TimeoutError(f"the fork server said nothing for {timeout} s")
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
            if not chunk:
                log = (self.workdir / "server.err").read_text()[-4000:]
                raise RuntimeError(f"the fork server exited: {log}")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        message: dict[str, Any] = json.loads(line)
        return message

    def spawn(self, argv: list[str], env: dict[str, str]) -> int:
        assert self.proc.stdin is not None
        self.count += 1
        child = self.count
        command = {
            "id": child,
            "argv": argv,
            "env": env,
            "stdout": str(self.workdir / f"{child}.out"),
            "stderr": str(self.workdir / f"{child}.err"),
        }
        self.proc.stdin.write(json.dumps(command).encode() + b"\n")
        self.proc.stdin.flush()
        return child

    def wait_any(self, timeout: float = 60.0) -> tuple[int, Proc]:
        """The next child to exit, as it ended."""
        message = self._message(timeout)
        child, code = message["id"], message["code"]
        lines = (self.workdir / f"{child}.out").read_text().strip().splitlines()
        run = json.loads(lines[-1]) if code == 0 and lines else None
        return child, Proc(code, run, (self.workdir / f"{child}.err").read_text())

    def close(self) -> None:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.close()  # the server exits once its children have
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:  # a child hangs: end the group this test started
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc.stdout.close()
        self.log.close()


@dataclass(frozen=True)
class Scenario:
    point: str
    kind: str
    mode: str
    seed: int

    @property
    def name(self) -> str:
        return f"{self.point}-{self.kind}-{self.mode}-seed{self.seed}"

    @property
    def tool(self) -> str:
        return KINDS[self.kind]


def scenarios(
    modes: tuple[tuple[str, int], ...] = (("sequential", 1), ("parallel", 1)),
) -> list[Scenario]:
    """Every crash point a kind reaches, every kind, in ``modes`` (mode, latency seed).

    Only ``approval`` reaches ``approval.after_request`` (elsewhere it would be a run
    without a crash, which the framework's own tests cover), in every mode. At the other
    points ``approval`` takes the modes in turn, one a point: each of its scenarios costs a
    process per approval (one per call, sequential or parallel), and CI time is short."""
    found = []
    for n, point in enumerate(CRASH_POINTS):
        for kind in KINDS:
            if point == "approval.after_request" and kind != "approval":
                continue
            chosen = modes
            if kind == "approval" and point != "approval.after_request":
                chosen = (modes[(n + 1) % len(modes)],)
            found += [Scenario(point, kind, mode, seed) for mode, seed in chosen]
    return found


def scenario_params(selected: list[Scenario]) -> pytest.MarkDecorator:
    return pytest.mark.parametrize("scenario", selected, ids=[s.name for s in selected])


@dataclass
class Child:
    """One process of a scenario: what it was asked, how it ended, the turns recorded."""

    role: str
    armed: bool
    turns_before: int
    proc: Proc | None = None
    turns_after: int = 0
    shop_after: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


@dataclass
class Outcome:
    """What one scenario left: its processes in order, and what the person did between."""

    db: str
    run_id: str
    customer: str
    children: list[Child] = field(default_factory=list)
    approved: list[str] = field(default_factory=list)
    """The approval ids approved, in order."""
    resolved: list[tuple[str, str]] = field(default_factory=list)
    """(step id, outcome) of each unknown effect settled, in order."""

    @property
    def crashed(self) -> list[Child]:
        return [c for c in self.children if c.proc is not None and c.proc.code == 77]

    @property
    def final(self) -> Child:
        return self.children[-1]


AT_ONCE = 6
"""Scenarios in flight together: each mostly waits (for a dead lease, for the shop)."""
ROUNDS = 8
"""Processes one scenario may take: start, a recovery, one per approval or settlement."""


def _person(shop: ShopService, outcome: Outcome, run: dict[str, Any]) -> bool:
    """What a person does for a run that stopped to wait: approve every pending approval,
    settle an unknown outcome from the shop's records. True if there is more to run."""
    reader = durably.App(outcome.db)
    try:
        if run["status"] == "waiting_approval":
            pending = [
                a["approval_id"]
                for a in reader.describe(outcome.run_id)["approvals"]
                if a["status"] == "requested"
            ]
            for approval_id in pending:
                reader.approve(outcome.run_id, approval_id, by="alice")
            outcome.approved += pending
            return bool(pending)
        if run["status"] == "paused" and run["status_reason"] == "effect_state_unknown":
            step_id = run["waiting_for"]["step_id"]
            op = next(
                e for e in reader.describe(outcome.run_id)["effects"] if e["step_id"] == step_id
            )
            found = rows(shop, outcome.customer).get(op["arguments"]["campaign"], [])
            if found:
                reader.resolve_effect(
                    outcome.run_id, step_id, "succeeded", result=coupon_result(found[0])
                )
            else:
                reader.resolve_effect(outcome.run_id, step_id, "not_executed")
            outcome.resolved.append((step_id, "succeeded" if found else "not_executed"))
            return True
        return False
    finally:
        reader.close()


def run_matrix(
    module: str, selected: list[Scenario], shop: ShopService, workdir: Path
) -> dict[Scenario, Outcome]:
    """Each scenario run in ``module``'s fork server, :data:`AT_ONCE` at a time: started with
    the crash armed, recovered after it in a fresh process, carried on after each wait by
    :func:`_person`, taken over when a process lost its lease. The crash stays armed until
    it fires, so a point reached only after an approval or a settlement is crashed there."""
    server = ForkServer(module, workdir)
    outcomes = {
        s: Outcome(f"sqlite:///{workdir}/{s.name}.db", f"run-{uuid.uuid4().hex[:12]}", s.name)
        for s in selected
    }
    todo = list(outcomes)
    running: dict[int, Scenario] = {}

    def spawn(scenario: Scenario, role: str) -> None:
        outcome = outcomes[scenario]
        armed = not outcome.crashed
        env = {
            "DURABLY_DATABASE_URL": outcome.db,
            "SHOP_URL": shop.url,
            "AGENT_SEED": str(scenario.seed),
            "CRASH_ROLE": f"{role}{len(outcome.children)}",
        }
        if armed:
            env["DURABLY_CRASH_AT"] = scenario.point
        before = turns_recorded(outcome.db, outcome.run_id)
        outcome.children.append(Child(role, armed, before))
        run_input = plan(outcome.customer, scenario.mode, scenario.tool)
        argv = [role, outcome.run_id, "shop_agent", json.dumps(run_input)]
        running[server.spawn(argv, env)] = scenario

    try:
        while todo or running:
            while todo and len(running) < AT_ONCE:
                spawn(todo.pop(), "start")
            child, proc = server.wait_any()
            scenario = running.pop(child)
            outcome = outcomes[scenario]
            last = outcome.final
            last.proc = proc
            last.turns_after = turns_recorded(outcome.db, outcome.run_id)
            last.shop_after = rows(shop, outcome.customer)
            if len(outcome.children) >= ROUNDS:
                continue
            # A process starved past its lease (a busy machine) stops with the run
            # ``running``: another takes it over, as a worker would.
            stopped = proc.run is not None and proc.run["status"] == "running"
            if proc.code == 77 or stopped or (proc.run and _person(shop, outcome, proc.run)):
                spawn(scenario, "recover")
        return outcomes
    finally:
        server.close()


def matrix_fixture(module: str) -> Any:
    """A module-scoped fixture ``crash_matrix``: the scenarios of this session's tests in the
    requesting module, run by :func:`run_matrix` in ``module``'s fork server."""

    @pytest.fixture(scope="module")
    def crash_matrix(
        request: pytest.FixtureRequest, shop: ShopService, tmp_path_factory: pytest.TempPathFactory
    ) -> dict[Scenario, Outcome]:
        selected: list[Scenario] = [
            cast(Scenario, item.callspec.params["scenario"])
            for item in request.session.items
            if isinstance(item, pytest.Function)
            and item.module is request.module
            and "crash_matrix" in item.fixturenames
        ]
        return run_matrix(
            module, selected, shop, tmp_path_factory.mktemp(module.rsplit(".", maxsplit=1)[-1])
        )

    return crash_matrix


def must_pause(scenario: Scenario) -> bool | None:
    """Whether the recovery must ask a person (None: it may). Only ``neither`` cannot settle
    a call made and not recorded: the crash right after the call leaves one for certain; in
    parallel, a crash anywhere may catch another call of the turn in flight."""
    if scenario.kind != "neither":
        return False
    if scenario.point == "effect.after_call":
        return True
    return None if scenario.mode == "parallel" else False


def assert_recovered(
    scenario: Scenario,
    outcome: Outcome,
    shop: ShopService,
    recorded_call_ids: Callable[[str, str], list[str]],
) -> None:
    """Judge one scenario from its processes, the shop's records, the journal and the run's
    events."""
    final = _assert_processes(scenario, outcome)
    _assert_records(scenario, outcome, final, shop, recorded_call_ids)


def _assert_processes(scenario: Scenario, outcome: Outcome) -> dict[str, Any]:
    """The crash fired once, where asked; every other process ended cleanly, asking the
    model only turns not recorded before it; the last one completed the run."""
    children = outcome.children
    explain = "\n".join(f"{c.role}: {c.proc and c.proc.explain()}" for c in children)
    assert len(outcome.crashed) == 1, explain
    for child in children:
        assert child.proc is not None, explain
        if child.proc.code == 77:
            assert f"crash injected at {scenario.point}" in child.proc.stderr
        else:
            assert child.proc.code == 0, explain
            assert child.proc.run is not None
            # Every model call this process made was a turn not recorded before it.
            assert child.proc.run["model_calls"] == child.turns_after - child.turns_before, (
                f"the model was asked a recorded turn again\n{explain}"
            )
        # At most once, whatever happened to the process.
        assert all(len(r) <= 1 for r in child.shop_after.values()), child.shop_after
    final = outcome.final.proc
    assert final is not None, explain
    assert final.run is not None, explain
    assert final.run["status"] == "completed", explain
    assert outcome.final.turns_after == TURNS[scenario.mode]
    return final.run


def _assert_records(
    scenario: Scenario,
    outcome: Outcome,
    final: dict[str, Any],
    shop: ShopService,
    recorded_call_ids: Callable[[str, str], list[str]],
) -> None:
    """Each effect once at the shop, recorded as it happened; a person asked exactly when
    the kind needs one; nothing journalled between a pause and its settlement."""
    explain = f"{outcome.children}"
    at_shop = rows(shop, outcome.customer)
    assert all(len(r) == 1 for r in at_shop.values()), at_shop
    for found in at_shop.values():
        assert found[0]["id"] in final["result"]["answer"]

    reader = durably.App(outcome.db)
    try:
        doc = reader.describe(outcome.run_id)
        events = reader.events(outcome.run_id)
    finally:
        reader.close()
    effects = doc["effects"]
    call_ids = recorded_call_ids(outcome.db, outcome.run_id)
    assert sorted(e["step_id"] for e in effects) == sorted(call_ids)
    shop_ids = {found[0]["id"] for found in at_shop.values()}
    for effect in effects:
        assert effect["status"] == "succeeded", effect
        result_id = effect["result"].get("order_id") or effect["result"]["coupon_id"]
        assert result_id in shop_ids, "the ledger's result exists at the shop"

    # A person was asked exactly when the kind needs one.
    pauses = [e for e in events if e.type == "run_paused"]
    assert [r[0] for r in outcome.resolved] == [p.step_id for p in pauses], explain
    if must_pause(scenario) is not None:
        assert bool(pauses) == must_pause(scenario), explain
    if scenario.kind == "approval":
        used = {a["step_id"]: a["status"] for a in doc["approvals"]}
        assert used == dict.fromkeys(call_ids, "consumed"), doc["approvals"]
        assert sorted(outcome.approved) == sorted(a["approval_id"] for a in doc["approvals"])
    else:
        assert doc["approvals"] == []
        assert outcome.approved == []

    # No durable call after a stop: nothing is journalled between a pause and its settlement.
    stopped = False
    for event in events:
        if event.type == "run_paused":
            stopped = True
        elif event.type in ("effect_resolved", "run_resumed"):
            stopped = False
        elif stopped:
            assert not event.type.startswith(("effect_", "step_", "model_")), (event, events)
