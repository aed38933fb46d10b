"""A LangGraph agent in a durably workflow, executed in real processes by the tests.

A LangGraph ``StateGraph`` (a model node, then ``ToolNode``, until the model answers) drives
:class:`ScriptedChatModel`: an offline LangChain chat model that decides from the
conversation alone (:func:`tests.integrations.shopapp.next_calls`, like a model at
temperature 0) and, like a real one, stamps fresh random tool call ids on every answer, so
a turn asked twice would call its tools under new ids. It is wrapped in
``DurableChatModel``. Its tools are
:func:`~tests.integrations.shopapp.shop_tools`, one per kind of effect, and
:func:`confirmed_tool` (LangGraph's ``interrupt()`` in a durable tool); ``ToolNode`` runs a
turn's calls concurrently.

``python -m tests.integrations.langgraph_agentapp serve`` is
:func:`tests.integrations.shopapp.main`'s fork server on this app.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.graph.state import CompiledStateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from langgraph.types import interrupt

import durably
from durably.demo.shop import post_json
from durably.integrations.langgraph import DurableChatModel, durable_tool
from tests.integrations import shopapp

app = shopapp.crash_app()
TOOLS = shopapp.shop_tools(app)


def confirmed_tool(app: durably.App, url: str | None = None) -> durably.Durable[..., Any]:
    """``confirmed_order``: ``place_order`` once a person confirms it, asked with LangGraph's
    ``interrupt()`` inside the tool (a durably approval); a rejection is told to the model."""

    @app.tool(
        idempotent=True,
        external_id=lambda r: r["order_id"],
        on_rejected=lambda r: f"not placed: {r.by} said {r.comment}",
    )
    def confirmed_order(customer: str, campaign: str) -> dict[str, Any]:
        """Place the campaign's one-item order for the customer, once a person confirms."""
        decision = interrupt({"confirm_order": campaign, "customer": customer})
        if not decision["approved"]:
            raise AssertionError("a rejection never returns from interrupt()")
        shopapp.latency(campaign)
        body = {"customer": customer, "items": [{"sku": campaign, "qty": 1}], "amount": 12.5}
        shop = (url or os.environ["SHOP_URL"]).rstrip("/")
        return post_json(f"{shop}/orders", body, idempotency_key=durably.idempotency_key())

    return confirmed_order


TOOLS["confirmed_order"] = confirmed_tool(app)


# -- the model ----------------------------------------------------------------------------


def plan_of(messages: Sequence[BaseMessage]) -> dict[str, Any]:
    """The JSON plan in the conversation's first user message."""
    first = next(m for m in messages if isinstance(m, HumanMessage))
    return dict(json.loads(str(first.content)))


def tool_results(messages: Sequence[BaseMessage]) -> list[ToolMessage]:
    return [m for m in messages if isinstance(m, ToolMessage)]


def tool_outputs(messages: Sequence[BaseMessage]) -> list[str]:
    """What the tools returned; an error ``ToolNode`` handed the model is not an output."""
    return [str(m.content) for m in tool_results(messages) if m.status == "success"]


def tool_call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    # A fresh id, as a real model's: a repeated turn would be seen as new tool calls.
    return {"name": name, "args": arguments, "id": f"call_{uuid.uuid4().hex}", "type": "tool_call"}


def answer(messages: Sequence[BaseMessage]) -> AIMessage:
    """What a model at temperature 0 answers to this conversation."""
    plan, outputs = plan_of(messages), tool_outputs(messages)
    calls = shopapp.next_calls(plan, outputs)
    if calls is not None:
        return AIMessage("", tool_calls=[tool_call(plan["tool"], a) for a in calls])
    return AIMessage(shopapp.final_answer(outputs))


class ScriptedChatModel(BaseChatModel):
    """An offline chat model: ``decide``, with usage, counted in ``shopapp.MODEL_CALLS``."""

    decide: Callable[[Sequence[BaseMessage]], AIMessage] = answer
    model_name: str = "scripted-1"

    @property
    def _llm_type(self) -> str:
        return "scripted"

    def bind_tools(
        self, tools: Sequence[Any], *, tool_choice: str | None = None, **kwargs: Any
    ) -> Runnable[LanguageModelInput, AIMessage]:
        return self.bind(tools=[convert_to_openai_tool(t) for t in tools], **kwargs)

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        raise NotImplementedError("scripted: async only")

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        shopapp.MODEL_CALLS[durably.current_run().run_id] += 1
        message = self.decide(messages)
        message.usage_metadata = {
            "input_tokens": 10 * len(messages),
            "output_tokens": 7,
            "total_tokens": 10 * len(messages) + 7,
        }
        return ChatResult(generations=[ChatGeneration(message=message)])


def agent_graph(
    model: BaseChatModel,
    tools: Sequence[BaseTool],
    *,
    checkpointer: Any = None,
    **tool_node: Any,
) -> CompiledStateGraph[Any, Any, Any, Any]:
    """The usual LangGraph agent: the model, then ``ToolNode`` for its calls, until it answers.
    ``tool_node`` goes to ``ToolNode`` (``handle_tool_errors``, ...)."""
    bound = model.bind_tools(tools)

    async def call_model(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await bound.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", call_model)
    graph.add_node("tools", ToolNode(tools, **tool_node))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    return graph.compile(checkpointer=checkpointer)


# -- the agent and its workflow -------------------------------------------------------------

GRAPH = agent_graph(
    DurableChatModel(app, ScriptedChatModel()),
    [durable_tool(t) for t in TOOLS.values()],
)


@app.workflow()
async def shop_agent(customer: str, campaign: str, tool: str, mode: str) -> dict[str, Any]:
    plan = {"customer": customer, "campaign": campaign, "tool": tool, "mode": mode}
    state = await GRAPH.ainvoke({"messages": [HumanMessage(json.dumps(plan))]})
    return {"answer": state["messages"][-1].content}


if __name__ == "__main__":
    shopapp.main(app, sys.argv[1:])
