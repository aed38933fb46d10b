"""The OpenAI Agents SDK's own ``Runner.run`` loop inside durably workflows, offline.

:mod:`tests.integrations.agentapp` has the scripted model (it decides from the conversation
alone and stamps fresh random tool call ids, as a real model does) and the shop tools. The
shop's own records decide what happened:

* tool calls made by the SDK, one per turn or three at once, are durably calls whose step
  ids are the model's tool call ids, and the model's turns are recorded steps;
* a crash at every crash point, for idempotent, reconciled, neither and approval tools,
  sequential and parallel (:mod:`tests.integrations.harness`): recovered in fresh processes
  (a person approving, or settling an unknown outcome from the shop's records), each effect
  happened once, the run completed, and no process asked the model a recorded turn;
* with the SDK's default tool error handling (which hands any ``Exception`` to the model),
  a divergence on replay stops the run: no tool or model call after it, no new effect;
* two executions of the same conversation hash every step's input identically, although
  the SDK stamps new item ids and prompt cache keys each time;
* what cannot be made durable (streaming, sessions, unwrapped model objects, the SDK's own
  approvals and timeouts) is refused with a ``ConfigurationError``.
"""

from __future__ import annotations

import json
import random
import runpy
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from agents import Agent, RunConfig, Runner, SQLiteSession
from agents.testing import assistant_message, function_call

import durably
from durably import RunStatus
from durably.demo.shop import ShopService, post_json
from durably.integrations import openai_agents
from durably.integrations.openai_agents import DurableModel, durable_tool
from tests.integrations import agentapp, harness, shopapp
from tests.integrations.agentapp import ScriptedModel
from tests.integrations.harness import ROOT, model_steps, rows, steps
from tests.integrations.shopapp import CALLS, CAMPAIGN, CAMPAIGNS, MODEL_CALLS, TURNS, plan

# -- helpers ------------------------------------------------------------------------------------


def recorded_call_ids(db: str, run_id: str) -> list[str]:
    """The tool call ids in the model responses the run recorded."""
    return [
        item["call_id"]
        for s in model_steps(db, run_id)
        if s["status"] == "succeeded"
        for item in json.loads(s["output_json"])["output"]
        if item["type"] == "function_call"
    ]


def latency(seed: str, campaign: str) -> None:
    """A latency drawn from ``seed`` and the call's campaign, whichever thread runs it."""
    time.sleep(random.Random(f"{seed}:{campaign}").random() * 0.05)


def agent_of(app: durably.App, *tools: durably.Durable[..., Any], **options: Any) -> Agent[Any]:
    return Agent(
        name="shop-agent",
        instructions="Carry out the plan in the user's message with the tools, then report.",
        model=DurableModel(app, options.pop("model", None) or ScriptedModel()),
        tools=[durable_tool(t) for t in tools],
        **options,
    )


async def ask(app: durably.App, agent: Agent[Any], plan: dict[str, str]) -> Any:
    """The agent's final answer to the plan, inside a workflow."""
    config = RunConfig(tracing_disabled=True)
    result = await openai_agents.run(app, agent, json.dumps(plan), run_config=config)
    return result.final_output


def agent_workflow(app: durably.App, current: Callable[[], Agent[Any]]) -> Callable[..., Any]:
    """A workflow that runs ``current()`` (the agent of the code now deployed) on a plan."""

    @app.workflow(name="shop_agent")
    async def shop_agent(customer: str, campaign: str, tool: str, mode: str) -> dict[str, Any]:
        plan = {"customer": customer, "campaign": campaign, "tool": tool, "mode": mode}
        return {"answer": await ask(app, current(), plan)}

    return shop_agent


# -- the SDK's loop with durable tools and a recorded model --------------------------------------


@pytest.mark.parametrize("mode", ["sequential", "parallel"])
def test_the_sdk_loop_records_turns_and_calls_tools_by_call_id(
    app: durably.App, db: str, shop: ShopService, customer: str, mode: str
) -> None:
    """Sequential: one tool call per turn; parallel: three in one turn. Every turn is one
    recorded model step, every tool call a durably effect at the model's call id."""
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


def test_parallel_calls_replay_in_another_order(app: durably.App, shop: ShopService) -> None:
    """Three coupons at once from one turn, their tool with neither key nor reconcile; one
    times out the first time and pauses the run. The seeded latencies make the SDK finish
    the calls in another order for each seed, and the resumption reach them in another
    order again: it replays the two settled calls, sends only the lost one, and does not
    ask the model that turn again."""
    seeds = range(6)
    lost_of = {seed: random.Random(seed).choice(CAMPAIGNS) for seed in seeds}
    state: dict[str, Any] = {"seed": 0, "first": True}
    finished: list[str] = []

    @app.tool(external_id=lambda r: r["coupon_id"])
    def issue_coupon(customer: str, campaign: str) -> dict[str, Any]:
        """Issue the customer a coupon for the campaign."""
        latency(f"{state['seed']}:{state['first']}", campaign)
        if state["first"] and campaign == lost_of[state["seed"]]:
            raise TimeoutError("no answer")  # nothing sent: resolved not_executed below
        coupon = post_json(f"{shop.url}/coupons", {"customer": customer, "campaign": campaign})
        finished.append(campaign)
        return coupon

    agent = agent_of(app, issue_coupon)
    workflow = agent_workflow(app, lambda: agent)
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
    assert len(orders) > 1, f"the latency never changed the order the SDK finished in: {orders}"


# -- a crash at every point, recovered in a fresh process ----------------------------------------

crash_matrix = harness.matrix_fixture("tests.integrations.agentapp")
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


# -- a divergence with the SDK's default tool error handling -------------------------------------


def gated_script(customer: str, before: int) -> Callable[[Any], list[Any]]:
    """Turn 1 orders ``before`` campaigns at once, turn 2 checks the gate, turn 3 orders
    once more (``<campaign>-late``), turn 4 answers."""

    def decide(items: Any) -> list[Any]:
        done = len(agentapp.tool_outputs(items))
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
        return [assistant_message("all done")]

    return decide


def deployed_agent(
    app: durably.App,
    shop: ShopService,
    decide: Callable[[Any], list[Any]],
    gate_checks: list[int],
    *,
    version: int,
    divergence: str,
) -> Agent[Any]:
    """The agent as deployed at ``version``. Its gate times out at version 1. Version 2
    put another durably tool behind the model's ``place_order`` (``non_determinism``).

    (A new ``version=`` of the same tool is no divergence: its recorded calls stay the
    same calls. And other arguments under the same call id cannot reach a tool through
    the SDK's loop, whose model turns are replayed from the journal; the contract tests
    cover ``idempotency_conflict``.)"""

    @app.tool()
    def gate() -> str:
        """Check the gate."""
        gate_checks.append(version)
        if version == 1:
            raise TimeoutError("no answer")
        return "open"

    name = "place_order_v2" if version == 2 and divergence == "non_determinism" else "place_order"

    @app.tool(name=name, idempotent=True)
    def place_order(customer: str, campaign: str) -> dict[str, Any]:
        """Place the campaign's one-item order for the customer."""
        body = {"customer": customer, "items": [{"sku": campaign, "qty": 1}], "amount": 12.5}
        return post_json(f"{shop.url}/orders", body, idempotency_key=durably.idempotency_key())

    return Agent(
        name="shop-agent",
        instructions="Carry out the plan, then check the gate.",
        model=DurableModel(app, ScriptedModel(decide)),
        tools=[durable_tool(place_order, name_override="place_order"), durable_tool(gate)],
    )


@pytest.mark.parametrize("mode", ["sequential", "parallel"])
@pytest.mark.parametrize("divergence", ["non_determinism"])
def test_a_divergence_stops_the_sdk_loop(
    db: str, shop: ShopService, customer: str, mode: str, divergence: str
) -> None:
    """Turn 1 orders (one, or three at once), turn 2 checks a gate, which times out: the
    run pauses. The next deploy changed the order tool, so the replay of turn 1 diverges.
    The SDK's default ``failure_error_function`` hands every ``Exception`` to the model and
    goes on; the stop is a ``BaseException``, so the loop ends there: the gate is not
    checked, the model is not asked turn 3, and the late order it would ask for is never
    placed."""
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
    assert again.status_reason == divergence
    assert again.error is not None
    assert again.error["step_id"] in recorded_call_ids(db, run.run_id), "stopped at a tool call"
    assert gate_checks == [1], "the gate was checked after the run had to stop"
    assert MODEL_CALLS[run.run_id] == 2, "the model was asked after the stop"
    assert rows(shop, customer) == orders_before, "an effect after the stop"


def test_a_failed_tool_goes_to_the_model(app: durably.App, customer: str) -> None:
    """A ``durably.StepFailed`` is an ordinary tool error: the SDK's default handler tells
    the model (in its own words, without the error's text), which answers; the run
    completes."""

    @app.tool()
    def place_order(customer: str, campaign: str) -> dict[str, Any]:
        """Place the campaign's one-item order for the customer."""
        raise durably.ToolError("out of stock", category=durably.FailureCategory.BUSINESS_REJECTED)

    agent = agent_of(app, place_order)
    run = app.run(agent_workflow(app, lambda: agent), **plan(customer, "parallel"))
    assert run.status is RunStatus.COMPLETED, run.error
    told = "An error occurred while running the tool"
    assert run.result["answer"].count(told) == CALLS
    effects = app.describe(run.run_id)["effects"]
    assert [e["failure_category"] for e in effects] == ["BUSINESS_REJECTED"] * CALLS


def test_a_step_as_a_tool_and_a_call_id_used_twice(
    app: durably.App, db: str, customer: str
) -> None:
    """A step given to the SDK is recorded at the model's call id. A call id used twice
    never reaches another call's record: within one ``Runner.run`` the SDK refuses it
    (``ModelBehaviorError``); across two, durably stops the run (``non_determinism``). The
    second call runs in neither case."""
    looked_up: list[str] = []

    @app.step()
    def stock(campaign: str) -> dict[str, str]:
        """How much of the campaign's item is in stock."""
        looked_up.append(campaign)
        return {"in_stock": campaign}

    def decide(items: Any) -> list[Any]:
        mode, done = agentapp.plan_of(items)["mode"], len(agentapp.tool_outputs(items))
        if done == 0 or (done == 1 and mode == "within"):
            return [function_call("stock", {"campaign": f"{mode}-{done}"}, call_id="call_same")]
        return [assistant_message("checked")]

    agent = agent_of(app, stock, model=ScriptedModel(decide))

    @app.workflow()
    async def twice(customer: str) -> Any:
        return [await ask(app, agent, plan(customer, mode)) for mode in ("first", "second")]

    within = app.run(agent_workflow(app, lambda: agent), **plan(customer, "within"))
    assert within.status is RunStatus.FAILED
    assert within.error is not None
    assert within.error["type"] == "ModelBehaviorError"
    across = app.run(twice, customer)
    assert across.status is RunStatus.PAUSED, across.error
    assert across.status_reason == "non_determinism"
    assert looked_up == ["within-0", "first-0"]
    recorded = {s["step_id"]: (s["kind"], s["name"]) for s in steps(db, across.run_id)}
    assert recorded["call_same"] == ("step", "stock")


# -- determinism -----------------------------------------------------------------------------------


def test_two_executions_of_one_history_hash_every_step_alike(
    app: durably.App, db: str, customer: str
) -> None:
    """Two runs of one conversation: the model's call ids are the same, its item ids and
    response ids fresh, and the SDK stamps a new prompt cache key per ``Runner.run``. Every
    step's stored input hash is the same in both runs. A replay (a pause, then a resume
    from the top) computes them again and finds no divergence."""
    cache_keys: list[str] = []
    gate_open = {"v": False}

    def decide(items: Any) -> list[Any]:
        made = agentapp.answer(items)
        for n, item in enumerate(made):
            if item.type == "function_call":
                item.call_id = f"call_{len(agentapp.tool_outputs(items))}_{n}"
        return made

    class Recording(ScriptedModel):
        async def get_response(self, *args: Any, **kwargs: Any) -> Any:
            cache_keys.append(args[2].extra_args["prompt_cache_key"])
            return await super().get_response(*args, **kwargs)

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

    agent = agent_of(app, place_order, model=Recording(decide))
    workflow = agent_workflow(app, lambda: agent)

    @app.workflow()
    async def gated(customer: str, campaign: str, tool: str, mode: str) -> Any:
        plan = {"customer": customer, "campaign": campaign, "tool": tool, "mode": mode}
        answer = await ask(app, agent, plan)
        await gate()
        return answer

    runs = [app.run(workflow, **plan(customer, "sequential")) for _ in range(2)]
    assert [r.status for r in runs] == [RunStatus.COMPLETED] * 2
    assert len(set(cache_keys)) == 2, "the SDK stamped a new prompt cache key per run"
    hashes = [[(s["step_id"], s["input_hash"]) for s in steps(db, r.run_id)] for r in runs]
    assert len(hashes[0]) == TURNS["sequential"] + CALLS
    assert hashes[0] == hashes[1]
    outputs = [[s["output_json"] for s in model_steps(db, r.run_id)] for r in runs]
    assert outputs[0] != outputs[1], "the responses differ in their item and response ids"

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


# -- budgets and refusals --------------------------------------------------------------------------


def test_recorded_usage_counts_against_the_budget(
    app: durably.App, shop: ShopService, customer: str
) -> None:
    agent = agent_of(app, shopapp.order_tool(app, shop))

    @app.workflow(budget=durably.Budget(max_tokens=40))
    async def frugal(request: dict[str, str]) -> Any:
        return await ask(app, agent, request)

    run = app.run(frugal, plan(customer, "sequential"))
    # The first turn uses 17 tokens, the second 37 (two more input items): 54 > 40.
    assert run.status is RunStatus.PAUSED, run.error
    assert run.status_reason == "budget_exceeded"
    assert MODEL_CALLS[run.run_id] == 2


def test_streaming_is_refused(app: durably.App) -> None:
    agent = agent_of(app)

    @app.workflow()
    async def streamed() -> Any:
        result = Runner.run_streamed(agent, "hello")
        async for _ in result.stream_events():
            pass
        return result.final_output

    run = app.run(streamed)
    assert run.status is RunStatus.FAILED
    assert run.error is not None
    assert run.error["type"] == "ConfigurationError", run.error
    assert "streaming" in run.error["message"]
    assert MODEL_CALLS[run.run_id] == 0


def test_a_session_an_unwrapped_model_and_the_sdks_own_approvals_are_refused(
    app: durably.App, tmp_path: Path
) -> None:
    recorded = agent_of(app)
    unwrapped = Agent(name="helper", model=ScriptedModel())
    leads_to_unwrapped = recorded.clone(handoffs=[unwrapped])
    session = SQLiteSession("s", str(tmp_path / "session.db"))

    @app.workflow()
    async def with_session() -> Any:
        return await openai_agents.run(app, recorded, "hello", session=session)

    @app.workflow()
    async def with_unwrapped() -> Any:
        return await openai_agents.run(app, leads_to_unwrapped, "hello")

    for workflow, words in ((with_session, "session"), (with_unwrapped, "'helper'")):
        run = app.run(workflow)
        assert run.status is RunStatus.FAILED
        assert run.error is not None
        assert run.error["type"] == "ConfigurationError"
        assert words in run.error["message"]
        assert MODEL_CALLS[run.run_id] == 0

    @app.tool()
    def refund(order: str) -> str:
        """Refund the order."""
        return order

    for option in ({"needs_approval": True}, {"timeout": 5.0}):
        with pytest.raises(durably.ConfigurationError, match=next(iter(option))):
            durable_tool(refund, **option)


def test_the_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    runpy.run_path(str(ROOT / "examples" / "openai_agents_refund.py"), run_name="__main__")
    printed = capsys.readouterr().out
    assert ": completed: Refunded A-1 and A-2 and told Ann." in printed
    assert "again: completed; at the shop: 2 refunds, 1 email" in printed
