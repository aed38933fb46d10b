"""LangGraph runs a super-step's nodes concurrently: two model nodes fanned out from START
reach their model calls in whatever order their own latency gives. Each generation is
matched on replay by the node that made it, not by the order, so a recovery that reaches
them the other way round replays both and asks the model nothing."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from typing import Any

import pytest
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.types import Send

import durably
from durably import RunStatus
from durably.integrations import langgraph
from durably.integrations.langgraph import DurableChatModel
from tests.integrations.langgraph_agentapp import ScriptedChatModel

SEEDS = range(20)


def echo(messages: list[BaseMessage]) -> AIMessage:
    return AIMessage(f"reviewed: {messages[-1].content}")


@pytest.mark.parametrize("seed", SEEDS)
def test_parallel_model_nodes_replay_in_another_order(tmp_path: Any, seed: int) -> None:
    app = durably.App(f"sqlite:///{tmp_path}/durably.db")
    rng = random.Random(seed)
    asked = Counter[str]()

    def decide(messages: list[BaseMessage]) -> AIMessage:
        asked[str(messages[-1].content)] += 1
        return echo(messages)

    model = DurableChatModel(app, ScriptedChatModel(decide=decide))

    def node(aspect: str) -> Any:
        async def review(state: MessagesState) -> dict[str, Any]:
            await asyncio.sleep(rng.random() * 0.004)
            prompt = f"{aspect} of {state['messages'][0].content}"
            return {"messages": [await model.ainvoke([HumanMessage(prompt)])]}

        return review

    async def section(state: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(rng.random() * 0.004)
        answer = await model.ainvoke([HumanMessage(f"section {state['n']}")])
        return {"messages": [answer]}

    graph = StateGraph(MessagesState)
    for aspect in ("tone", "facts", "length"):
        graph.add_node(aspect, node(aspect))
        graph.add_edge(START, aspect)
    graph.add_node("section", section)
    graph.add_conditional_edges(
        START, lambda _: [Send("section", {"n": n}) for n in range(3)], ["section"]
    )
    compiled = graph.compile()

    @app.workflow()
    async def review() -> list[str]:
        state = await compiled.ainvoke({"messages": [HumanMessage("the draft")]})
        await durably.wait_for_event("go")  # the replay below starts from the top
        return sorted(str(m.content) for m in state["messages"][1:])

    try:
        run = app.run(review)
        assert run.status is RunStatus.WAITING_EXTERNAL, run.error
        app.send_event(run.run_id, "go", None)
        app.worker().run(until_idle=True)
        done = app.get_run(run.run_id)
        assert done.status is RunStatus.COMPLETED, (done.status_reason, done.error)
        assert len(done.result) == 6
        assert set(asked.values()) == {1}  # every generation asked once, replayed after
        assert len(asked) == 6
        assert len(app.describe(run.run_id)["model_calls"]) == 6
    finally:
        app.close()


def test_a_run_recorded_by_position_replays_by_position(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run whose generations the previous version recorded as ``model:<name>#<n>`` (it
    gave no step id) keeps them: its replay asks the model nothing, where ids of the new
    kind would have asked again."""
    app = durably.App(f"sqlite:///{tmp_path}/durably.db")
    asked = Counter[str]()

    def decide(messages: list[BaseMessage]) -> AIMessage:
        asked[str(messages[-1].content)] += 1
        return echo(messages)

    model = DurableChatModel(app, ScriptedChatModel(decide=decide))

    async def write(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await model.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("write", write)
    graph.add_edge(START, "write")
    compiled = graph.compile()

    @app.workflow()
    async def draft() -> str:
        state = await compiled.ainvoke({"messages": [HumanMessage("the brief")]})
        await durably.wait_for_event("go")
        return str(state["messages"][-1].content)

    try:
        with monkeypatch.context() as previous_version:
            previous_version.setattr(langgraph, "_task_step_id", lambda step: None)
            run = app.run(draft)
        assert run.status is RunStatus.WAITING_EXTERNAL
        [call] = app.describe(run.run_id)["model_calls"]
        assert call["step_id"] == "model:scripted-1#1"
        app.send_event(run.run_id, "go", None)
        app.worker().run(until_idle=True)
        done = app.get_run(run.run_id)
        assert done.status is RunStatus.COMPLETED, done.error
        assert done.result == "reviewed: the brief"
        assert asked == Counter({"the brief": 1})
    finally:
        app.close()
