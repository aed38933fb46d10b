"""Concurrent calls replay in any order; a stop cannot be swallowed.

Agent frameworks start a turn's tool calls concurrently, after latency of their own, so a
recovery reaches them in another order than the first execution did. Calls carrying a
stable id (the model's tool call id, through ``with_step_id``) are matched by that id, and
the calls of each :func:`durably.gather` branch are numbered within the branch. Each test
draws its latencies from a seeded generator and replays with fresh draws.

Frameworks also catch every exception a tool raises and hand it to the model. Once a run
must stop, the stop is a ``BaseException`` and every later call of the run refuses, so no
new effect can follow it.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

import durably
from durably import RunStatus

MakeApp = Callable[..., durably.App]
SEEDS = range(25)
CALLS = ["call_a", "call_b", "call_c", "call_d"]


async def jitter(rng: random.Random, most: float = 0.004) -> None:
    await asyncio.sleep(rng.random() * most)


@pytest.mark.parametrize("seed", SEEDS)
def test_calls_with_ids_replay_in_any_order(make_app: MakeApp, seed: int) -> None:
    """Four concurrent calls keyed by tool call id; one has an unknown outcome the first
    time. The recovery reaches them in another order and replays the three settled ones."""
    app = make_app()
    rng = random.Random(seed)
    lost = rng.choice(CALLS)
    sent: Counter[str] = Counter()
    keys: dict[str, set[str]] = {}
    first = {"execution": True}

    @app.tool()
    async def refund(call_id: str) -> dict[str, Any]:
        await jitter(rng)
        keys.setdefault(call_id, set()).add(durably.idempotency_key())
        if call_id == lost and first["execution"]:
            raise TimeoutError("no answer")  # nothing sent: resolved "not_executed" below
        sent[call_id] += 1
        return {"refunded": call_id}

    @app.workflow()
    async def turn(calls: list[str]) -> list[Any]:
        async def one(call_id: str) -> Any:
            # The framework's own latency before it starts the call: some calls start only
            # after the lost one paused the run, and are first recorded by the recovery.
            await jitter(rng, 0.02)
            return await refund.with_step_id(call_id)(call_id)

        return await asyncio.gather(*(one(c) for c in calls))

    run = app.run(turn, CALLS)
    assert run.status is RunStatus.PAUSED, run.error
    assert run.status_reason == "effect_state_unknown"
    first["execution"] = False
    app.resolve_effect(run.run_id, lost, "not_executed")
    done = app.resume(run.run_id)
    assert done.status is RunStatus.COMPLETED, done.error
    assert done.result == [{"refunded": c} for c in CALLS]
    assert sent == Counter(CALLS)
    assert all(len(k) == 1 for k in keys.values()), "a call's key derives from its id alone"
    steps = {s["step_id"]: s["status"] for s in app.describe(run.run_id)["steps"]}
    assert steps == dict.fromkeys(CALLS, "succeeded")


@pytest.mark.parametrize("seed", SEEDS)
def test_gather_branches_number_their_own_calls(make_app: MakeApp, seed: int) -> None:
    """Three branches, each a step then a tool, interleaving by latency; one publish has
    an unknown outcome the first time. Replayed in another interleaving, nothing repeats."""
    app = make_app()
    rng = random.Random(seed)
    docs = ["d0", "d1", "d2"]
    lost = rng.choice(docs)
    ran: Counter[str] = Counter()
    first = {"execution": True}

    @app.step()
    async def draft(doc: str) -> str:
        await jitter(rng)
        ran[f"draft {doc}"] += 1
        return f"draft of {doc}"

    @app.tool()
    async def publish(doc: str, text: str) -> str:
        await jitter(rng)
        if doc == lost and first["execution"]:
            raise TimeoutError("no answer")
        ran[f"publish {doc}"] += 1
        return f"published {text}"

    async def review(doc: str) -> str:
        await jitter(rng)
        text = await draft(doc)
        return await publish(doc, text)

    @app.workflow()
    async def reviews(names: list[str]) -> list[Any]:
        return await durably.gather(*(review(d) for d in names))

    run = app.run(reviews, docs)
    assert run.status is RunStatus.PAUSED, run.error
    assert run.status_reason == "effect_state_unknown"
    branch = f"gather#1.{docs.index(lost)}/publish#1"
    assert run.waiting_for is not None
    assert run.waiting_for["step_id"] == branch
    first["execution"] = False
    app.resolve_effect(run.run_id, branch, "not_executed")
    done = app.resume(run.run_id)
    assert done.status is RunStatus.COMPLETED, done.error
    assert done.result == [f"published draft of {d}" for d in docs]
    assert ran == Counter([f"draft {d}" for d in docs] + [f"publish {d}" for d in docs])
    steps = {s["step_id"] for s in app.describe(run.run_id)["steps"]}
    assert steps == {f"gather#1.{i}/{n}#1" for i in range(3) for n in ("draft", "publish")}


@pytest.mark.parametrize(
    "handler", [Exception, BaseException], ids=["except_exception", "except_base"]
)
@pytest.mark.parametrize("divergence", ["non_determinism", "idempotency_conflict"])
def test_a_swallowed_stop_makes_no_later_effect(
    make_app: MakeApp, divergence: str, handler: type[BaseException]
) -> None:
    """Workflow code that catches everything (as agent frameworks do with tool errors) and
    goes on after replay found a divergence: the next tool call must not execute."""
    app = make_app()
    changed = {"v": False}
    sent: list[str] = []
    caught: list[BaseException] = []

    @app.step()
    def plan() -> str:
        return "plan"

    @app.step()
    def other_plan() -> str:
        return "other"

    @app.tool(idempotent=True)
    def charge(amount: int) -> int:
        sent.append(f"charge {amount}")
        return amount

    @app.tool()
    def gate() -> None:
        if not changed["v"]:
            raise TimeoutError("no answer")

    @app.tool(idempotent=True)
    def email(to: str) -> str:
        sent.append(f"email {to}")
        return to

    @app.workflow()
    async def agent() -> str:
        try:
            if divergence == "non_determinism":
                await (other_plan() if changed["v"] else plan())
            else:
                await charge(20 if changed["v"] else 10)
        except handler as exc:  # the framework feeds the error to the model and goes on
            caught.append(exc)
        for attempt in (gate, lambda: email("ann@example.com")):
            try:
                await attempt()
            except handler as exc:
                caught.append(exc)
        return "told the customer it is done"

    run = app.run(agent)
    assert run.status_reason == "effect_state_unknown"
    changed["v"] = True
    app.resolve_effect(run.run_id, "gate#1", "not_executed")
    sent.clear()
    again = app.resume(run.run_id)
    assert again.status is RunStatus.PAUSED
    assert again.status_reason == divergence
    assert sent == [], "nothing may be sent after the run had to stop"
    assert all(isinstance(c, durably.RunStopped) for c in caught), caught
    if handler is Exception:
        assert caught == []
    effects = {e["step_id"]: e["status"] for e in app.describe(run.run_id)["effects"]}
    assert "email#1" not in effects


def test_a_call_never_awaited_pauses_the_run(make_app: MakeApp) -> None:
    """A missing ``await``: the run must not complete as if the email went out."""
    app = make_app()
    fixed = {"v": False}
    sent: list[str] = []

    @app.tool(idempotent=True)
    def email(to: str) -> str:
        sent.append(to)
        return to

    @app.workflow()
    async def notify() -> str:
        call = email("ann@example.com")
        if fixed["v"]:
            await call
        return "notified"

    run = app.run(notify)
    assert run.status is RunStatus.PAUSED
    assert run.status_reason == "call_not_awaited"
    assert run.error is not None
    assert "email at email#1" in run.error["message"]
    assert sent == []
    fixed["v"] = True
    done = app.resume(run.run_id)
    assert done.status is RunStatus.COMPLETED
    assert done.result == "notified"
    assert sent == ["ann@example.com"]


class Message:
    """A framework's message: not JSON, and stamped anew on every execution."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.id = uuid.uuid4().hex


def test_call_step_records_a_callable_it_does_not_own(make_app: MakeApp) -> None:
    """A framework's model call, recorded by ``app.call_step`` under the model's turn id,
    hashed by a canonical form without the volatile message ids: replayed, not repeated."""
    app = make_app()
    answered: list[str] = []
    resumed = {"v": False}

    def complete(history: list[Message]) -> dict[str, Any]:
        answered.append(history[-1].text)
        return {"say": f"re: {history[-1].text}"}

    @app.tool()
    def gate() -> None:
        if not resumed["v"]:
            raise TimeoutError("no answer")

    def texts(history: list[Message]) -> list[str]:
        return [m.text for m in history]

    @app.workflow()
    async def chat() -> Any:
        history = [Message("hello")]
        reply = await app.call_step("llm", complete, history, step_id="turn-1", canonical=texts)
        await gate()
        return reply

    run = app.run(chat)
    assert run.status_reason == "effect_state_unknown"
    resumed["v"] = True
    app.resolve_effect(run.run_id, "gate#1", "not_executed")
    done = app.resume(run.run_id)
    assert done.status is RunStatus.COMPLETED, done.error
    assert done.result == {"say": "re: hello"}
    assert answered == ["hello"], "the model call was replayed from the journal"
    steps = {s["step_id"]: s["name"] for s in app.describe(run.run_id)["steps"]}
    assert steps["turn-1"] == "llm"


def test_canonical_still_catches_a_changed_history(make_app: MakeApp) -> None:
    app = make_app()
    said = {"text": "hello"}

    @app.step(canonical=lambda history: [m.text for m in history])
    def complete(history: list[Message]) -> str:
        return f"re: {history[-1].text}"

    @app.tool()
    def gate() -> None:
        if said["text"] == "hello":
            raise TimeoutError("no answer")

    @app.workflow()
    async def chat() -> str:
        reply = await complete([Message(said["text"])])
        await gate()
        return reply

    run = app.run(chat)
    said["text"] = "goodbye"
    app.resolve_effect(run.run_id, "gate#1", "not_executed")
    again = app.resume(run.run_id)
    assert again.status_reason == "non_determinism"


def test_call_step_refuses_a_tool_name(make_app: MakeApp) -> None:
    app = make_app()

    @app.tool()
    def refund() -> None: ...

    @app.workflow()
    async def wf() -> None:
        await app.call_step("refund", print)

    run = app.run(wf)
    assert run.status is RunStatus.FAILED
    assert run.error is not None
    assert run.error["type"] == "ConfigurationError"


class AskAgain(Exception):
    """A framework's "ask the model again" (like Pydantic AI's ModelRetry)."""


class GraphBubbleUp(Exception):
    """Named as LangGraph's base of ``interrupt()``: known without LangGraph installed."""


GraphBubbleUp.__module__ = "langgraph.errors"


@pytest.mark.parametrize("signal", [AskAgain, GraphBubbleUp], ids=["declared", "by_name"])
def test_a_frameworks_control_flow_is_not_an_unknown_outcome(
    make_app: MakeApp, signal: type[Exception]
) -> None:
    """The tool raises its framework's control flow before sending anything: the framework
    gets it unchanged, nothing pauses for a person, and a replay runs the tool again."""
    app = make_app()
    refunded: list[str] = []
    gate_open = {"v": False}

    @app.tool(control_flow=[AskAgain])
    def refund(order: str) -> str:
        if not order.startswith("o-"):
            raise signal(f"{order!r} is not an order id; ask again")
        refunded.append(order)
        return order

    @app.tool()
    def gate() -> None:
        if not gate_open["v"]:
            raise TimeoutError("no answer")

    @app.workflow()
    async def agent() -> str:
        try:
            done = await refund.with_step_id("call_1")("17")
        except signal:  # the framework asks the model, which corrects the id
            done = await refund.with_step_id("call_2")("o-17")
        await gate()
        return done

    run = app.run(agent)
    assert run.status_reason == "effect_state_unknown"  # the gate, after both calls
    effects = {e["step_id"]: e["status"] for e in app.describe(run.run_id)["effects"]}
    assert effects == {"call_1": "intent_recorded", "call_2": "succeeded", "gate#1": "unknown"}
    not_sent = [e for e in app.events(run.run_id) if e.type == "effect_not_sent"]
    assert [e.step_id for e in not_sent] == ["call_1"]
    gate_open["v"] = True
    app.resolve_effect(run.run_id, "gate#1", "not_executed")
    done = app.resume(run.run_id)
    assert done.status is RunStatus.COMPLETED, done.error
    assert done.result == "o-17"
    assert refunded == ["o-17"]
