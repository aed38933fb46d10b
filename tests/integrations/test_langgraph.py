"""LangGraph's own graph loop (a model node and ``ToolNode``) inside durably workflows, offline.

:mod:`tests.integrations.langgraph_agentapp` has the scripted chat model (a LangChain
``BaseChatModel``: it decides from the conversation alone and stamps fresh random tool call
ids, as a real model does), the graph and the shop tools. The shop's own records decide
what happened:

* tool calls made by ``ToolNode``, one per turn or three at once (run concurrently), are
  durably calls whose step ids are the model's tool call ids (``InjectedToolCallId``), and
  the model's generations are recorded steps;
* a crash at every crash point, for idempotent, reconciled, neither and approval tools,
  sequential and parallel (:mod:`tests.integrations.harness`): recovered in fresh processes
  (a person approving, or settling an unknown outcome from the shop's records), each effect
  happened once, the run completed, and no process asked the model a recorded turn;
* with ``ToolNode``'s error handling (its default, and ``handle_tool_errors=True``, which
  hands every ``Exception`` to the model), a divergence on replay stops the run: no tool
  or model call after it, no new effect;
* LangGraph's ``interrupt()`` raised by a durable tool reaches LangGraph unchanged and is
  not an unknown outcome; a ``durably.StepFailed`` follows ``ToolNode``'s error handling;
* two executions of the same conversation hash every step's input identically, although
  LangChain and LangGraph stamp new message ids each time;
* what cannot be made durable (a LangGraph checkpointer, a synchronous model call) is
  refused with a ``ConfigurationError``.
"""

from __future__ import annotations

import json
import runpy
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import pytest
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import interrupt

import durably
from durably import RunStatus
from durably.demo.shop import ShopService, post_json
from durably.integrations.langgraph import DurableChatModel, canonical_request, durable_tool
from tests.integrations import harness, shopapp
from tests.integrations import langgraph_agentapp as agentapp
from tests.integrations.harness import ROOT, model_steps, rows, steps
from tests.integrations.langgraph_agentapp import ScriptedChatModel, agent_graph
from tests.integrations.shopapp import CALLS, CAMPAIGN, CAMPAIGNS, MODEL_CALLS, TURNS, plan

Decide = Callable[[Sequence[BaseMessage]], AIMessage]


# -- helpers ------------------------------------------------------------------------------------


def recorded_call_ids(db: str, run_id: str) -> list[str]:
    """The tool call ids in the AIMessages the run recorded."""
    return [
        call["id"]
        for s in model_steps(db, run_id)
        if s["status"] == "succeeded"
        for call in json.loads(s["output_json"])["message"]["data"]["tool_calls"]
    ]


def graph_of(
    app: durably.App,
    *tools: durably.Durable[..., Any],
    decide: Decide = agentapp.answer,
    **tool_node: Any,
) -> Any:
    model = DurableChatModel(app, ScriptedChatModel(decide=decide))
    return agent_graph(model, [durable_tool(t) for t in tools], **tool_node)


async def ask(graph: Any, request: dict[str, str]) -> Any:
    """The graph's last message for the plan, inside a workflow."""
    state = await graph.ainvoke({"messages": [HumanMessage(json.dumps(request))]})
    return state["messages"][-1].content


def agent_workflow(app: durably.App, current: Callable[[], Any]) -> Any:
    """A workflow that runs ``current()`` (the graph of the code now deployed) on a plan."""

    @app.workflow(name="shop_agent")
    async def shop_agent(customer: str, campaign: str, tool: str, mode: str) -> dict[str, Any]:
        plan = {"customer": customer, "campaign": campaign, "tool": tool, "mode": mode}
        return {"answer": await ask(current(), plan)}

    return shop_agent


# -- the graph with durable tools and a recorded model -------------------------------------------


@pytest.mark.parametrize("mode", ["sequential", "parallel"])
def test_the_graph_records_turns_and_calls_tools_by_call_id(
    app: durably.App, db: str, shop: ShopService, customer: str, mode: str
) -> None:
    """Sequential: one tool call per turn; parallel: three in one turn, run concurrently by
    ``ToolNode``. Every generation is one recorded step, every tool call a durably effect
    at the model's call id; starting the run again replays it and sends nothing."""
    graph = graph_of(app, shopapp.order_tool(app, shop))
    workflow = agent_workflow(app, lambda: graph)
    run = app.run(workflow, **plan(customer, mode))
    assert run.status is RunStatus.COMPLETED, run.error
    assert MODEL_CALLS[run.run_id] == TURNS[mode]

    at_shop = rows(shop, customer)
    assert all(len(r) == 1 for r in at_shop.values()), at_shop
    for found in at_shop.values():
        assert found[0]["id"] in run.result["answer"]
    turns = model_steps(db, run.run_id)
    # The agent node runs at super-steps 1, 3, 5, ...: each generation is its task's first.
    assert [s["step_id"] for s in turns] == [
        f"model:scripted-1@{2 * n + 1}/agent/agent#1" for n in range(len(turns))
    ]
    assert len(turns) == TURNS[mode]
    call_ids = recorded_call_ids(db, run.run_id)
    effects = app.describe(run.run_id)["effects"]
    assert sorted(e["step_id"] for e in effects) == sorted(call_ids)
    assert len({e["idempotency_key"] for e in effects}) == CALLS
    assert all(e["status"] == "succeeded" for e in effects)
    harness.assert_model_calls(app, run.run_id, TURNS[mode])

    again = app.run(workflow, **plan(customer, mode), run_id=run.run_id)
    assert again.status is RunStatus.COMPLETED
    assert again.result == run.result
    assert MODEL_CALLS[run.run_id] == TURNS[mode]
    assert rows(shop, customer) == at_shop


def test_parallel_calls_replay_in_another_order(app: durably.App, shop: ShopService) -> None:
    """Three coupons at once from one turn, their tool with neither key nor reconcile; one
    times out the first time and pauses the run. Seeded latencies make ``ToolNode`` finish
    the calls in another order per seed, and the resumption reach them in another order
    again: it replays the two settled calls, sends only the lost one, and does not ask the
    model that turn again."""
    import random

    seeds = range(4)
    lost_of = {seed: random.Random(seed).choice(CAMPAIGNS) for seed in seeds}
    state: dict[str, Any] = {"seed": 0, "first": True}
    finished: list[str] = []

    @app.tool(external_id=lambda r: r["coupon_id"])
    def issue_coupon(customer: str, campaign: str) -> dict[str, Any]:
        """Issue the customer a coupon for the campaign."""
        pause = random.Random(f"{state['seed']}:{state['first']}:{campaign}").random() * 0.05
        time.sleep(pause)
        if state["first"] and campaign == lost_of[state["seed"]]:
            raise TimeoutError("no answer")  # nothing sent: resolved not_executed below
        coupon = post_json(f"{shop.url}/coupons", {"customer": customer, "campaign": campaign})
        finished.append(campaign)
        return coupon

    graph = graph_of(app, issue_coupon)
    workflow = agent_workflow(app, lambda: graph)
    orders: set[tuple[str, ...]] = set()
    for seed in seeds:
        customer = f"cust-{uuid.uuid4().hex[:10]}"
        state.update(seed=seed, first=True)
        finished.clear()
        run = app.run(workflow, **plan(customer, "parallel", "issue_coupon"))
        assert run.status_reason == "effect_state_unknown", run.error
        assert run.waiting_for is not None
        first_order = tuple(finished)
        state.update(first=False)
        app.resolve_effect(run.run_id, run.waiting_for["step_id"], "not_executed")
        finished.clear()
        done = app.resume(run.run_id)
        assert done.status is RunStatus.COMPLETED, done.error
        assert finished == [lost_of[seed]], "the settled calls were replayed, not sent again"
        assert MODEL_CALLS[run.run_id] == TURNS["parallel"], "no turn was asked twice"
        assert all(len(r) == 1 for r in rows(shop, customer).values())
        orders.add(first_order)
    assert len(orders) > 1, f"the latency never changed the order ToolNode finished in: {orders}"


# -- a crash at every point, recovered in a fresh process ----------------------------------------

crash_matrix = harness.matrix_fixture("tests.integrations.langgraph_agentapp")
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


# -- a divergence with ToolNode's error handling -------------------------------------------------


def gated_script(customer: str, before: int) -> Decide:
    """Turn 1 orders ``before`` campaigns at once, turn 2 checks the gate, turn 3 orders
    once more (``<campaign>-late``), turn 4 answers."""

    def decide(messages: Sequence[BaseMessage]) -> AIMessage:
        done = len(agentapp.tool_outputs(messages))
        if done == 0:
            return AIMessage(
                "",
                tool_calls=[
                    agentapp.tool_call("place_order", {"customer": customer, "campaign": c})
                    for c in CAMPAIGNS[:before]
                ],
            )
        if done == before:
            return AIMessage("", tool_calls=[agentapp.tool_call("gate", {})])
        if done == before + 1:
            late = {"customer": customer, "campaign": f"{CAMPAIGN}-late"}
            return AIMessage("", tool_calls=[agentapp.tool_call("place_order", late)])
        return AIMessage("all done")

    return decide


def deployed_graph(
    app: durably.App,
    shop: ShopService,
    decide: Decide,
    gate_checks: list[int],
    *,
    version: int,
    handling: str,
) -> Any:
    """The graph as deployed at ``version``. Its gate times out at version 1. Version 2
    put another durably tool behind the model's ``place_order`` (``non_determinism``)."""

    @app.tool()
    def gate() -> str:
        """Check the gate."""
        gate_checks.append(version)
        if version == 1:
            raise TimeoutError("no answer")
        return "open"

    name = "place_order_v2" if version == 2 else "place_order"

    @app.tool(name=name, idempotent=True)
    def place_order(customer: str, campaign: str) -> dict[str, Any]:
        """Place the campaign's one-item order for the customer."""
        body = {"customer": customer, "items": [{"sku": campaign, "qty": 1}], "amount": 12.5}
        return post_json(f"{shop.url}/orders", body, idempotency_key=durably.idempotency_key())

    options = {"handle_tool_errors": True} if handling == "catch_all" else {}
    model = DurableChatModel(app, ScriptedChatModel(decide=decide))
    tools = [durable_tool(place_order, name="place_order"), durable_tool(gate)]
    return agent_graph(model, tools, **options)


@pytest.mark.parametrize("mode", ["sequential", "parallel"])
@pytest.mark.parametrize("handling", ["default", "catch_all"])
def test_a_divergence_stops_the_graph(
    db: str, shop: ShopService, customer: str, mode: str, handling: str
) -> None:
    """Turn 1 orders (one, or three at once), turn 2 checks a gate, which times out: the
    run pauses. The next deploy put another tool behind the order tool, so the replay of
    turn 1 diverges. ``ToolNode``'s default handler raises what is not an invocation error;
    ``handle_tool_errors=True`` hands every ``Exception`` to the model and goes on. The
    stop is a ``BaseException``, so in both the graph ends there: the gate is not checked,
    the model is not asked turn 3, and the late order it would ask for is never placed."""
    before = CALLS if mode == "parallel" else 1
    decide = gated_script(customer, before)
    gate_checks: list[int] = []

    first = durably.App(db, lease_ttl=timedelta(seconds=5))
    try:
        graph = deployed_graph(first, shop, decide, gate_checks, version=1, handling=handling)
        run = first.run(agent_workflow(first, lambda: graph), **plan(customer, mode))
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
        graph = deployed_graph(then, shop, decide, gate_checks, version=2, handling=handling)
        agent_workflow(then, lambda: graph)
        then.resolve_effect(run.run_id, run.waiting_for["step_id"], "not_executed")
        again = then.resume(run.run_id)
    finally:
        then.close()
    assert again.status is RunStatus.PAUSED, again.error
    assert again.status_reason == "non_determinism"
    assert again.error is not None
    assert again.error["step_id"] in recorded_call_ids(db, run.run_id), "stopped at a tool call"
    assert gate_checks == [1], "the gate was checked after the run had to stop"
    assert MODEL_CALLS[run.run_id] == 2, "the model was asked after the stop"
    assert rows(shop, customer) == orders_before, "an effect after the stop"


# -- LangGraph's control flow and tool errors in a durable tool ----------------------------------


def test_interrupt_reaches_langgraph_and_is_not_an_unknown_outcome(
    app: durably.App, customer: str
) -> None:
    """The tool calls ``interrupt()``: the ``GraphInterrupt`` passes ``ToolNode`` and ends
    ``graph.ainvoke`` with LangGraph's ``__interrupt__``. durably records the call as not
    sent (``intent_recorded``), not as an unknown outcome: nothing pauses for a person."""
    refunded: list[str] = []

    @app.tool()
    def refund(order: str) -> str:
        """Refund the order, once a person agrees."""
        interrupt({"approve_refund": order})
        refunded.append(order)
        return f"refunded {order}"

    def decide(messages: Sequence[BaseMessage]) -> AIMessage:
        return AIMessage("", tool_calls=[agentapp.tool_call("refund", {"order": "A-1"})])

    graph = graph_of(app, refund, decide=decide)

    @app.workflow()
    async def support(question: str) -> Any:
        state = await graph.ainvoke({"messages": [HumanMessage(question)]})
        return [i.value for i in state["__interrupt__"]]

    run = app.run(support, "refund A-1")
    assert run.status is RunStatus.COMPLETED, run.error
    assert run.result == [{"approve_refund": "A-1"}]
    assert refunded == []
    effects = app.describe(run.run_id)["effects"]
    assert [e["status"] for e in effects] == ["intent_recorded"]
    assert [e.type for e in app.events(run.run_id) if e.type == "run_paused"] == []
    assert MODEL_CALLS[run.run_id] == 1


@pytest.mark.parametrize("handling", ["default", "catch_all"])
def test_a_failed_tool_follows_tool_nodes_error_handling(
    app: durably.App, customer: str, handling: str
) -> None:
    """A ``durably.StepFailed`` is an ordinary tool error: ``handle_tool_errors=True`` tells
    the model, which answers; ``ToolNode``'s default raises it out of ``graph.ainvoke``,
    where the workflow can catch it."""

    @app.tool()
    def place_order(customer: str, campaign: str) -> dict[str, Any]:
        """Place the campaign's one-item order for the customer."""
        raise durably.ToolError("out of stock", category=durably.FailureCategory.BUSINESS_REJECTED)

    def decide(messages: Sequence[BaseMessage]) -> AIMessage:
        results = agentapp.tool_results(messages)
        if results:
            return AIMessage(f"told: {results[0].content}")
        args = {"customer": customer, "campaign": CAMPAIGNS[0]}
        return AIMessage("", tool_calls=[agentapp.tool_call("place_order", args)])

    options = {"handle_tool_errors": True} if handling == "catch_all" else {}
    graph = graph_of(app, place_order, decide=decide, **options)

    @app.workflow()
    async def careful(request: dict[str, str]) -> Any:
        try:
            return await ask(graph, request)
        except durably.StepFailed as failed:
            return f"not ordered: {failed}"

    run = app.run(careful, plan(customer, "sequential"))
    assert run.status is RunStatus.COMPLETED, run.error
    assert "out of stock" in run.result
    assert run.result.startswith("told: " if handling == "catch_all" else "not ordered: ")
    effects = app.describe(run.run_id)["effects"]
    assert [e["failure_category"] for e in effects] == ["BUSINESS_REJECTED"]
    assert MODEL_CALLS[run.run_id] == (2 if handling == "catch_all" else 1)


# -- determinism -----------------------------------------------------------------------------------


def test_two_executions_of_one_history_hash_every_step_alike(
    app: durably.App, db: str, customer: str
) -> None:
    """Two runs of one conversation: the model's call ids are the same, while LangChain
    stamps a new id on every generation and LangGraph's ``add_messages`` on every message.
    Every step's stored input hash is the same in both runs. A replay (a pause, then a
    resume from the top) computes them again, finds no divergence and asks the model
    nothing."""
    gate_open = {"v": False}

    def decide(messages: Sequence[BaseMessage]) -> AIMessage:
        made = agentapp.answer(messages)
        done = len(agentapp.tool_outputs(messages))
        for n, call in enumerate(made.tool_calls):
            call["id"] = f"call_{done}_{n}"
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

    graph = graph_of(app, place_order, decide=decide)
    workflow = agent_workflow(app, lambda: graph)

    @app.workflow()
    async def gated(customer: str, campaign: str, tool: str, mode: str) -> Any:
        request = {"customer": customer, "campaign": campaign, "tool": tool, "mode": mode}
        answer = await ask(graph, request)
        await gate()
        return answer

    runs = [app.run(workflow, **plan(customer, "sequential")) for _ in range(2)]
    assert [r.status for r in runs] == [RunStatus.COMPLETED] * 2
    hashes = [[(s["step_id"], s["input_hash"]) for s in steps(db, r.run_id)] for r in runs]
    assert len(hashes[0]) == TURNS["sequential"] + CALLS
    assert hashes[0] == hashes[1]
    outputs = [[s["output_json"] for s in model_steps(db, r.run_id)] for r in runs]
    assert outputs[0] != outputs[1], "the generations differ in their message ids"

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


def test_the_hash_leaves_out_message_ids_and_metadata_but_not_tool_arguments() -> None:
    def conversation(stamp: str, argument: str) -> list[BaseMessage]:
        call = {"name": "refund", "args": {"id": argument}, "id": "c1", "type": "tool_call"}
        return [
            HumanMessage("hi", id=f"human-{stamp}"),
            AIMessage(
                "",
                tool_calls=[call],
                id=f"lc_run--{stamp}",
                response_metadata={"created": stamp},
                usage_metadata={"input_tokens": 1, "output_tokens": 1, "total_tokens": 2},
            ),
            ToolMessage("ok", tool_call_id="c1", id=f"tool-{stamp}"),
        ]

    first = canonical_request(conversation("a", "A-1"), tools=[{"name": "refund"}])
    assert first == canonical_request(conversation("b", "A-1"), tools=[{"name": "refund"}])
    assert first != canonical_request(conversation("a", "A-2"), tools=[{"name": "refund"}])
    assert first != canonical_request(conversation("a", "A-1"), tools=[{"name": "other"}])


# -- budgets and refusals --------------------------------------------------------------------------


def test_recorded_usage_counts_against_the_budget(
    app: durably.App, shop: ShopService, customer: str
) -> None:
    graph = graph_of(app, shopapp.order_tool(app, shop))

    @app.workflow(budget=durably.Budget(max_tokens=40))
    async def frugal(request: dict[str, str]) -> Any:
        return await ask(graph, request)

    run = app.run(frugal, plan(customer, "sequential"))
    # The first turn uses 17 tokens (one message), the second 37 (three): 54 > 40.
    assert run.status is RunStatus.PAUSED, run.error
    assert run.status_reason == "budget_exceeded"
    assert MODEL_CALLS[run.run_id] == 2


def test_a_checkpointer_is_refused(app: durably.App, shop: ShopService, customer: str) -> None:
    """A graph compiled with a checkpointer is refused at its first recorded call: the model
    (``DurableChatModel``), or a durable tool when the model is not recorded. Nothing is
    asked or sent."""
    place_order = shopapp.order_tool(app, shop)
    tools = [durable_tool(place_order)]
    graphs = {
        where: agent_graph(model, tools, checkpointer=InMemorySaver())
        for where, model in (
            ("model", DurableChatModel(app, ScriptedChatModel())),
            ("tool", ScriptedChatModel()),
        )
    }

    for where, graph in graphs.items():

        @app.workflow(name=f"with_checkpointer_{where}")
        async def with_checkpointer(request: dict[str, str], graph: Any = graph) -> Any:
            config = {"configurable": {"thread_id": "t-1"}}
            state = await graph.ainvoke({"messages": [HumanMessage(json.dumps(request))]}, config)
            return state["messages"][-1].content

        run = app.run(with_checkpointer, plan(customer, "sequential"))
        assert run.status is RunStatus.FAILED, (where, run.status)
        assert run.error is not None
        assert run.error["type"] == "ConfigurationError", run.error
        assert "checkpointer" in run.error["message"]
        assert app.describe(run.run_id)["effects"] == []
        assert MODEL_CALLS[run.run_id] == (0 if where == "model" else 1)
    assert all(found == [] for found in rows(shop, customer).values())


def test_a_synchronous_model_call_is_refused(app: durably.App) -> None:
    model = DurableChatModel(app, ScriptedChatModel())

    @app.workflow()
    async def blocking() -> Any:
        return model.invoke("hello").content

    run = app.run(blocking)
    assert run.status is RunStatus.FAILED
    assert run.error is not None
    assert run.error["type"] == "ConfigurationError", run.error
    assert "ainvoke" in run.error["message"]
    assert MODEL_CALLS[run.run_id] == 0


def test_the_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    runpy.run_path(str(ROOT / "examples" / "langgraph_refund.py"), run_name="__main__")
    printed = capsys.readouterr().out
    assert ": completed: Refunded A-1 and A-2 and told Ann." in printed
    assert "again: completed; at the shop: 2 refunds, 1 email" in printed
