"""A Pydantic AI agent in a durably workflow, executed in real processes by the tests.

Pydantic AI's own ``agent.run`` loop drives :func:`answer` through its ``FunctionModel``:
an offline model that decides from the conversation alone
(:func:`tests.integrations.shopapp.next_calls`, like a model at temperature 0) and, like a
real one, stamps fresh random tool call ids on every answer, so a turn asked twice would
call its tools under new ids. Its tools are
:func:`~tests.integrations.shopapp.shop_tools`, one per kind of effect.

``python -m tests.integrations.pydantic_agentapp serve`` is
:func:`tests.integrations.shopapp.main`'s fork server on this app.
"""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Callable
from typing import Any

from pydantic_ai import Agent
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.usage import RequestUsage

import durably
from durably.integrations.pydantic_ai import DurablyDurability, durable_tool
from tests.integrations import shopapp

app = shopapp.crash_app()
TOOLS = shopapp.shop_tools(app)


# -- the model ----------------------------------------------------------------------------


def plan_of(messages: list[ModelMessage]) -> dict[str, Any]:
    """The JSON plan in the conversation's first user prompt."""
    for message in messages:
        if isinstance(message, ModelRequest):
            for part in message.parts:
                if isinstance(part, UserPromptPart) and isinstance(part.content, str):
                    return dict(json.loads(part.content))
    raise AssertionError("no plan in the conversation")


def tool_returns(messages: list[ModelMessage]) -> list[ToolReturnPart]:
    return [
        part
        for message in messages
        if isinstance(message, ModelRequest)
        for part in message.parts
        if isinstance(part, ToolReturnPart)
    ]


def tool_outputs(messages: list[ModelMessage]) -> list[str]:
    """What the tools returned; a retry the tool asked for is not an output."""
    return [p.model_response_str() for p in tool_returns(messages) if p.outcome == "success"]


def tool_call(name: str, arguments: dict[str, Any]) -> ToolCallPart:
    # A fresh id, as a real model's: a repeated turn would be seen as new tool calls.
    return ToolCallPart(name, arguments, tool_call_id=f"call_{uuid.uuid4().hex}")


def answer(messages: list[ModelMessage]) -> list[Any]:
    """What a model at temperature 0 answers to this conversation."""
    plan, outputs = plan_of(messages), tool_outputs(messages)
    calls = shopapp.next_calls(plan, outputs)
    if calls is not None:
        return [tool_call(plan["tool"], a) for a in calls]
    return [TextPart(shopapp.final_answer(outputs))]


def scripted_model(
    decide: Callable[[list[ModelMessage]], list[Any]] = answer, name: str = "scripted-1"
) -> FunctionModel:
    """An offline model: ``decide``, with usage, counted in ``shopapp.MODEL_CALLS``."""

    def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        shopapp.MODEL_CALLS[durably.current_run().run_id] += 1
        usage = RequestUsage(input_tokens=10 * len(messages), output_tokens=7)
        return ModelResponse(parts=decide(messages), usage=usage, model_name=name)

    return FunctionModel(respond, model_name=name)


# -- the agent and its workflow -------------------------------------------------------------

AGENT: Agent[None, str] = Agent(
    scripted_model(),
    name="shop-agent",
    instructions="Carry out the plan in the user's message with the tools, then report.",
    tools=[durable_tool(t) for t in TOOLS.values()],
    capabilities=[DurablyDurability(app)],
)


@app.workflow()
async def shop_agent(customer: str, campaign: str, tool: str, mode: str) -> dict[str, Any]:
    plan = {"customer": customer, "campaign": campaign, "tool": tool, "mode": mode}
    result = await AGENT.run(json.dumps(plan))
    return {"answer": result.output}


if __name__ == "__main__":
    shopapp.main(app, sys.argv[1:])
