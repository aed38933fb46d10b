"""Pydantic AI's own ``agent.run`` loop inside durably workflows, offline.

:mod:`tests.integrations.pydantic_agentapp` has the scripted model (Pydantic AI's
``FunctionModel``: it decides from the conversation alone and stamps fresh random tool call
ids, as a real model does) and the shop tools. The shop's own records decide what happened:

* tool calls made by Pydantic AI, one per turn or three at once, are durably calls whose
  step ids are the model's tool call ids, and the model's requests are recorded steps;
* a crash at every crash point, for idempotent, reconciled, neither and approval tools,
  sequential and parallel (:mod:`tests.integrations.harness`): recovered in fresh processes
  (a person approving, or settling an unknown outcome from the shop's records), each effect
  happened once, the run completed, and no process asked the model a recorded request;
* with Pydantic AI's default tool error handling, a divergence on replay stops the run: no
  tool or model call after it, no new effect;
* a tool's ``ModelRetry`` and ``CallDeferred`` reach Pydantic AI unchanged and are not
  unknown outcomes; a ``durably.StepFailed`` ends ``agent.run``;
* two executions of the same conversation hash every step's input identically, although
  Pydantic AI stamps new timestamps and run ids each time;
* what cannot be made durable (streaming, an agent whose model requests are not recorded,
  Pydantic AI's own approvals and timeouts on a durable tool) is refused with a
  ``ConfigurationError``.
"""

from __future__ import annotations

import json
import runpy
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from pydantic_ai import Agent, DeferredToolRequests, DeferredToolResults
from pydantic_ai.exceptions import CallDeferred, ModelRetry
from pydantic_ai.messages import ModelMessage, TextPart, ToolCallPart

import durably
from durably import RunStatus
from durably.demo.shop import ShopService, post_json
from durably.integrations.pydantic_ai import (
    DurablyDurability,
    canonical_request,
    durable_tool,
    durable_toolset,
)
from tests.integrations import harness, shopapp
from tests.integrations import pydantic_agentapp as agentapp
from tests.integrations.harness import ROOT, model_steps, rows, steps
from tests.integrations.pydantic_agentapp import scripted_model
from tests.integrations.shopapp import CALLS, CAMPAIGN, CAMPAIGNS, MODEL_CALLS, TURNS, plan

# -- helpers ------------------------------------------------------------------------------------


def recorded_call_ids(db: str, run_id: str) -> list[str]:
    """The tool call ids in the model responses the run recorded."""
    return [
        part["tool_call_id"]
        for s in model_steps(db, run_id)
        if s["status"] == "succeeded"
        for part in json.loads(s["output_json"])["parts"]
        if part["part_kind"] == "tool-call"
    ]


def agent_of(
    app: durably.App, *tools: durably.Durable[..., Any], model: Any = None
) -> Agent[None, str]:
    return Agent(
        model or scripted_model(),
        name="shop-agent",
        instructions="Carry out the plan in the user's message with the tools, then report.",
        tools=[durable_tool(t) for t in tools],
        capabilities=[DurablyDurability(app)],
    )


def agent_workflow(app: durably.App, current: Callable[[], Agent[None, str]]) -> Any:
    """A workflow that runs ``current()`` (the agent of the code now deployed) on a plan."""

    @app.workflow(name="shop_agent")
    async def shop_agent(customer: str, campaign: str, tool: str, mode: str) -> dict[str, Any]:
        plan = {"customer": customer, "campaign": campaign, "tool": tool, "mode": mode}
        return {"answer": (await current().run(json.dumps(plan))).output}

    return shop_agent


# -- the agent loop with durable tools and recorded model requests ------------------------------


@pytest.mark.parametrize("mode", ["sequential", "parallel"])
def test_the_agent_loop_records_requests_and_calls_tools_by_call_id(
    app: durably.App, db: str, shop: ShopService, customer: str, mode: str
) -> None:
    """Sequential: one tool call per turn; parallel: three in one turn, run concurrently by
    Pydantic AI. Every model request is one recorded step, every tool call a durably effect
    at the model's call id; starting the run again replays it and sends nothing."""
    agent = agent_of(app, shopapp.order_tool(app, shop))
    workflow = agent_workflow(app, lambda: agent)
    run = app.run(workflow, **plan(customer, mode))
    assert run.status is RunStatus.COMPLETED, run.error
    assert MODEL_CALLS[run.run_id] == TURNS[mode]

    at_shop = rows(shop, customer)
    assert all(len(r) == 1 for r in at_shop.values()), at_shop
    for found in at_shop.values():
        assert found[0]["id"] in run.result["answer"]
    turns = model_steps(db, run.run_id)
    assert [s["step_id"] for s in turns] == [f"model:scripted-1#{n + 1}" for n in range(len(turns))]
    assert len(turns) == TURNS[mode]
    call_ids = recorded_call_ids(db, run.run_id)
    effects = app.describe(run.run_id)["effects"]
    assert sorted(e["step_id"] for e in effects) == sorted(call_ids)
    assert len({e["idempotency_key"] for e in effects}) == CALLS
    assert all(e["status"] == "succeeded" for e in effects)
    harness.assert_model_calls(app, run.run_id, TURNS[mode])


# -- a crash at every point, recovered in a fresh process ----------------------------------------

crash_matrix = harness.matrix_fixture("tests.integrations.pydantic_agentapp")
SCENARIOS = harness.scenarios()


@pytest.mark.crash
@harness.scenario_params(SCENARIOS)
def test_a_crash_anywhere_recovers_each_effect_once(
    scenario: harness.Scenario,
    crash_matrix: dict[harness.Scenario, harness.Outcome],
    shop: ShopService,
) -> None:
    """See :func:`tests.integrations.harness.assert_recovered`."""
    harness.assert_recovered(scenario, crash_matrix[scenario], shop, recorded_call_ids)


# -- a divergence with Pydantic AI's default tool error handling ---------------------------------


def gated_script(customer: str, before: int) -> Callable[[list[ModelMessage]], list[Any]]:
    """Turn 1 orders ``before`` campaigns at once, turn 2 checks the gate, turn 3 orders
    once more (``<campaign>-late``), turn 4 answers."""

    def decide(messages: list[ModelMessage]) -> list[Any]:
        done = len(agentapp.tool_outputs(messages))
        if done == 0:
            return [
                agentapp.tool_call("place_order", {"customer": customer, "campaign": c})
                for c in CAMPAIGNS[:before]
            ]
        if done == before:
            return [agentapp.tool_call("gate", {})]
        if done == before + 1:
            late = {"customer": customer, "campaign": f"{CAMPAIGN}-late"}
            return [agentapp.tool_call("place_order", late)]
        return [TextPart("all done")]

    return decide


def deployed_agent(
    app: durably.App,
    shop: ShopService,
    decide: Callable[[list[ModelMessage]], list[Any]],
    gate_checks: list[int],
    *,
    version: int,
    divergence: str,
) -> Agent[None, str]:
    """The agent as deployed at ``version``. Its gate times out at version 1. Version 2
    changed the durably tool behind the model's ``place_order``: another tool under the same
    name (the model sees nothing new), or another default price, which the model reads in
    the tool's schema."""

    @app.tool()
    def gate() -> str:
        """Check the gate."""
        gate_checks.append(version)
        if version == 1:
            raise TimeoutError("no answer")
        return "open"

    changed = version == 2
    name = "place_order_v2" if changed and divergence == "another_tool" else "place_order"
    price = 15.0 if changed and divergence == "changed_schema" else 12.5

    @app.tool(name=name, idempotent=True)
    def place_order(customer: str, campaign: str, amount: float = price) -> dict[str, Any]:
        """Place the campaign's one-item order for the customer."""
        body = {"customer": customer, "items": [{"sku": campaign, "qty": 1}], "amount": amount}
        return post_json(f"{shop.url}/orders", body, idempotency_key=durably.idempotency_key())

    return Agent(
        scripted_model(decide),
        name="shop-agent",
        instructions="Carry out the plan, then check the gate.",
        tools=[durable_tool(place_order, name="place_order"), durable_tool(gate)],
        capabilities=[DurablyDurability(app)],
    )


@pytest.mark.parametrize("mode", ["sequential", "parallel"])
@pytest.mark.parametrize("divergence", ["another_tool", "changed_schema"])
def test_a_divergence_stops_the_agent_loop(
    db: str, shop: ShopService, customer: str, mode: str, divergence: str
) -> None:
    """Turn 1 orders (one, or three at once), turn 2 checks a gate, which times out: the
    run pauses. The next deploy changed the order tool, so the replay diverges: at the
    recorded tool call (another tool) or already at the first model request (its tool
    schema changed). The stop is a ``BaseException``, which Pydantic AI's tool execution
    does not take for a tool error: the loop ends there, the gate is not checked, the model
    is not asked turn 3, and the late order it would ask for is never placed."""
    before = CALLS if mode == "parallel" else 1
    decide = gated_script(customer, before)
    gate_checks: list[int] = []

    first = durably.App(db, lease_ttl=timedelta(seconds=5))
    try:
        agent = deployed_agent(first, shop, decide, gate_checks, version=1, divergence=divergence)
        run = first.run(agent_workflow(first, lambda: agent), **plan(customer, mode))
    finally:
        first.close()
    assert run.status_reason == "effect_state_unknown", run.error
    assert run.waiting_for is not None
    assert run.waiting_for["tool"] == "gate"
    orders_before = rows(shop, customer)
    assert [len(orders_before[c]) for c in CAMPAIGNS[:before]] == [1] * before
    assert MODEL_CALLS[run.run_id] == 2

    then = durably.App(db, lease_ttl=timedelta(seconds=5))  # the next deploy
    try:
        agent = deployed_agent(then, shop, decide, gate_checks, version=2, divergence=divergence)
        agent_workflow(then, lambda: agent)
        then.resolve_effect(run.run_id, run.waiting_for["step_id"], "not_executed")
        again = then.resume(run.run_id)
    finally:
        then.close()
    assert again.status is RunStatus.PAUSED, again.error
    assert again.status_reason == "non_determinism"
    assert again.error is not None
    if divergence == "another_tool":
        assert again.error["step_id"] in recorded_call_ids(db, run.run_id), "at a tool call"
    else:
        assert again.error["step_id"] == "model:scripted-1#1", "at the first model request"
    assert gate_checks == [1], "the gate was checked after the run had to stop"
    assert MODEL_CALLS[run.run_id] == 2, "the model was asked after the stop"
    assert rows(shop, customer) == orders_before, "an effect after the stop"


# -- Pydantic AI's control flow in a durable tool -------------------------------------------------


def test_model_retry_reaches_pydantic_ai_and_is_not_an_unknown_outcome(
    app: durably.App, db: str, shop: ShopService, customer: str
) -> None:
    """The tool refuses its first call with ``ModelRetry``: Pydantic AI tells the model,
    which calls again under a new call id. The refused call is recorded as not sent
    (``intent_recorded``), not as an unknown outcome: nothing pauses, the order is placed
    once, and starting the run again sends nothing."""
    refusals: list[str] = []

    @app.tool(idempotent=True)
    def place_order(customer: str, campaign: str) -> dict[str, Any]:
        """Place the campaign's one-item order for the customer."""
        if not refusals:
            refusals.append(campaign)
            raise ModelRetry("say please")
        body = {"customer": customer, "items": [{"sku": campaign, "qty": 1}], "amount": 12.5}
        return post_json(f"{shop.url}/orders", body, idempotency_key=durably.idempotency_key())

    def decide(messages: list[ModelMessage]) -> list[Any]:
        retried = any(p.outcome == "retried" for p in agentapp.tool_returns(messages))
        if agentapp.tool_outputs(messages):
            return [TextPart("ordered: " + agentapp.tool_outputs(messages)[0])]
        campaign = CAMPAIGNS[0] if not retried else f"{CAMPAIGNS[0]}-please"
        return [agentapp.tool_call("place_order", {"customer": customer, "campaign": campaign})]

    agent = agent_of(app, place_order, model=scripted_model(decide))
    workflow = agent_workflow(app, lambda: agent)
    run = app.run(workflow, **plan(customer, "sequential"))
    assert run.status is RunStatus.COMPLETED, run.error
    assert refusals == [CAMPAIGNS[0]]
    effects = app.describe(run.run_id)["effects"]
    assert sorted(e["status"] for e in effects) == ["intent_recorded", "succeeded"]
    assert [e.type for e in app.events(run.run_id) if e.type == "run_paused"] == []
    assert len(rows(shop, customer)[f"{CAMPAIGNS[0]}-please"]) == 1
    assert MODEL_CALLS[run.run_id] == 3

    again = app.run(workflow, **plan(customer, "sequential"), run_id=run.run_id)
    assert again.status is RunStatus.COMPLETED
    assert len(rows(shop, customer)[f"{CAMPAIGNS[0]}-please"]) == 1
    assert MODEL_CALLS[run.run_id] == 3


def test_a_deferred_call_ends_agent_run_as_pydantic_ai_designed(
    app: durably.App, customer: str
) -> None:
    """The tool defers its call (``CallDeferred``): ``agent.run`` ends with Pydantic AI's
    ``DeferredToolRequests``, the call is recorded as not sent, and the workflow hands the
    external result back in a second ``agent.run``; nothing pauses."""

    @app.tool()
    def ship(customer: str) -> str:
        """Ship the customer's parcel (a person does it)."""
        raise CallDeferred(metadata={"queue": "warehouse"})

    def decide(messages: list[ModelMessage]) -> list[Any]:
        outputs = agentapp.tool_outputs(messages)
        if outputs:
            return [TextPart(f"the warehouse says: {outputs[0]}")]
        return [agentapp.tool_call("ship", {"customer": customer})]

    agent: Agent[None, str | DeferredToolRequests] = Agent(
        scripted_model(decide),
        name="shop-agent",
        output_type=[str, DeferredToolRequests],
        toolsets=[durable_toolset(ship, id="shipping")],
        capabilities=[DurablyDurability(app)],
    )

    @app.workflow()
    async def shipping(customer: str) -> Any:
        first = await agent.run(customer)
        requests = first.output
        assert isinstance(requests, DeferredToolRequests)
        results = DeferredToolResults(calls={c.tool_call_id: "shipped" for c in requests.calls})
        second = await agent.run(
            message_history=first.all_messages(), deferred_tool_results=results
        )
        return {"deferred": [c.tool_name for c in requests.calls], "answer": second.output}

    run = app.run(shipping, customer)
    assert run.status is RunStatus.COMPLETED, run.error
    assert run.result == {"deferred": ["ship"], "answer": "the warehouse says: shipped"}
    effects = app.describe(run.run_id)["effects"]
    assert [e["status"] for e in effects] == ["intent_recorded"]
    assert MODEL_CALLS[run.run_id] == 2


def test_a_failed_tool_ends_agent_run(app: durably.App, customer: str) -> None:
    """Pydantic AI hands no tool error to the model: a ``durably.StepFailed`` ends
    ``agent.run``, and the workflow can catch it."""

    @app.tool()
    def place_order(customer: str, campaign: str) -> dict[str, Any]:
        """Place the campaign's one-item order for the customer."""
        raise durably.ToolError("out of stock", category=durably.FailureCategory.BUSINESS_REJECTED)

    agent = agent_of(app, place_order)

    @app.workflow()
    async def careful(request: dict[str, str]) -> Any:
        try:
            return (await agent.run(json.dumps(request))).output
        except durably.StepFailed as failed:
            return f"not ordered: {failed}"

    run = app.run(careful, plan(customer, "sequential"))
    assert run.status is RunStatus.COMPLETED, run.error
    assert "out of stock" in run.result
    effects = app.describe(run.run_id)["effects"]
    assert [e["failure_category"] for e in effects] == ["BUSINESS_REJECTED"]
    assert MODEL_CALLS[run.run_id] == 1


# -- determinism -----------------------------------------------------------------------------------


def test_two_executions_of_one_history_hash_every_step_alike(
    app: durably.App, db: str, customer: str
) -> None:
    """Two runs of one conversation: the model's call ids are the same, while Pydantic AI
    stamps new timestamps and run ids on every message. Every step's stored input hash is
    the same in both runs. A replay (a pause, then a resume from the top) computes them
    again and finds no divergence, and asks the model nothing."""
    gate_open = {"v": False}

    def decide(messages: list[ModelMessage]) -> list[Any]:
        made = agentapp.answer(messages)
        done = len(agentapp.tool_outputs(messages))
        for n, part in enumerate(made):
            if isinstance(part, ToolCallPart):
                part.tool_call_id = f"call_{done}_{n}"
        return made

    @app.tool(idempotent=True)
    def place_order(customer: str, campaign: str) -> dict[str, Any]:
        """Place the campaign's one-item order for the customer."""
        return {"placed": campaign, "for": customer}

    @app.tool()
    def gate() -> str:
        """Check the gate."""
        if not gate_open["v"]:
            raise TimeoutError("no answer")
        return "open"

    agent = agent_of(app, place_order, model=scripted_model(decide))
    workflow = agent_workflow(app, lambda: agent)

    @app.workflow()
    async def gated(customer: str, campaign: str, tool: str, mode: str) -> Any:
        request = {"customer": customer, "campaign": campaign, "tool": tool, "mode": mode}
        answer = (await agent.run(json.dumps(request))).output
        await gate()
        return answer

    runs = [app.run(workflow, **plan(customer, "sequential")) for _ in range(2)]
    assert [r.status for r in runs] == [RunStatus.COMPLETED] * 2
    hashes = [[(s["step_id"], s["input_hash"]) for s in steps(db, r.run_id)] for r in runs]
    assert len(hashes[0]) == TURNS["sequential"] + CALLS
    assert hashes[0] == hashes[1]
    outputs = [[s["output_json"] for s in model_steps(db, r.run_id)] for r in runs]
    assert outputs[0] != outputs[1], "the responses differ in their timestamps"

    paused = app.run(gated, **plan(customer, "sequential"))
    assert paused.status_reason == "effect_state_unknown"
    gate_open["v"] = True
    app.resolve_effect(paused.run_id, "gate#1", "not_executed")
    done = app.resume(paused.run_id)
    assert done.status is RunStatus.COMPLETED, done.error
    assert MODEL_CALLS[paused.run_id] == TURNS["sequential"], "replayed, not asked again"
    assert [h for _, h in hashes[0]] == [
        s["input_hash"] for s in steps(db, paused.run_id) if s["name"] != "gate"
    ]


def test_the_hash_leaves_out_timestamps_and_run_ids_but_not_tool_arguments() -> None:
    def request(stamp: str, run_id: str, argument: str) -> dict[str, Any]:
        call = {"part_kind": "tool-call", "args": {"timestamp": argument}, "tool_call_id": "c1"}
        prompt = {"part_kind": "user-prompt", "content": "hi", "timestamp": stamp}
        return {
            "messages": [
                {"kind": "request", "parts": [prompt], "timestamp": stamp, "run_id": run_id},
                {"kind": "response", "parts": [call], "provider_response_id": run_id},
            ],
            "settings": None,
            "parameters": {"function_tools": []},
        }

    first = canonical_request(request("2026-01-01T00:00:00Z", "run-a", "noon"))
    assert first == canonical_request(request("2027-02-02T00:00:00Z", "run-b", "noon"))
    assert first != canonical_request(request("2026-01-01T00:00:00Z", "run-a", "midnight"))


# -- budgets and refusals --------------------------------------------------------------------------


def test_recorded_usage_counts_against_the_budget(
    app: durably.App, shop: ShopService, customer: str
) -> None:
    agent = agent_of(app, shopapp.order_tool(app, shop))

    @app.workflow(budget=durably.Budget(max_tokens=40))
    async def frugal(request: dict[str, str]) -> Any:
        return (await agent.run(json.dumps(request))).output

    run = app.run(frugal, plan(customer, "sequential"))
    # The first request uses 17 tokens (one message), the second 37 (three): 54 > 40.
    assert run.status is RunStatus.PAUSED, run.error
    assert run.status_reason == "budget_exceeded"
    assert MODEL_CALLS[run.run_id] == 2


def test_streaming_is_refused(app: durably.App) -> None:
    agent = agent_of(app)

    @app.workflow()
    async def streamed() -> Any:
        async with agent.run_stream("hello") as result:
            return await result.get_output()

    async def handler(ctx: Any, events: Any) -> None:
        async for _ in events:
            pass

    @app.workflow()
    async def handled() -> Any:
        return (await agent.run("hello", event_stream_handler=handler)).output

    for workflow in (streamed, handled):
        run = app.run(workflow)
        assert run.status is RunStatus.FAILED
        assert run.error is not None
        assert run.error["type"] == "ConfigurationError", run.error
        assert "streaming" in run.error["message"]
        assert MODEL_CALLS[run.run_id] == 0


def test_the_tool_options_durably_owns_are_refused(app: durably.App) -> None:
    @app.tool()
    def refund(order: str) -> str:
        """Refund the order."""
        return order

    for option in ({"requires_approval": True}, {"timeout": 5.0}):
        with pytest.raises(durably.ConfigurationError, match=next(iter(option))):
            durable_tool(refund, **option)


def test_a_durable_tool_refuses_an_agent_whose_requests_are_not_recorded(
    app: durably.App, shop: ShopService, customer: str
) -> None:
    """Without the capability a recovery would ask the model again and get the same order
    under a new call id: the tool refuses before anything is recorded or sent."""
    unrecorded = Agent(
        scripted_model(), name="shop-agent", tools=[durable_tool(shopapp.order_tool(app, shop))]
    )
    run = app.run(agent_workflow(app, lambda: unrecorded), **plan(customer, "sequential"))
    assert run.status is RunStatus.FAILED
    assert run.error is not None
    assert run.error["type"] == "ConfigurationError", run.error
    assert "DurablyDurability" in run.error["message"]
    assert app.describe(run.run_id)["effects"] == []
    assert all(found == [] for found in rows(shop, customer).values())


def test_the_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    runpy.run_path(str(ROOT / "examples" / "pydantic_ai_refund.py"), run_name="__main__")
    printed = capsys.readouterr().out
    assert ": completed: Refunded A-1 and A-2 and told Ann." in printed
    assert "again: completed; at the shop: 2 refunds, 1 email" in printed
