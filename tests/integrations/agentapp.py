"""An OpenAI Agents SDK agent in a durably workflow, executed in real processes by the tests.

The SDK's own ``Runner.run`` loop drives :class:`ScriptedModel`, an offline model that
decides from the conversation alone (:func:`tests.integrations.shopapp.next_calls`, like a
model at temperature 0) and, like a real one, stamps fresh random tool call ids and item ids
on every answer: a turn asked twice would call its tools under new ids. Its tools are the
:func:`~tests.integrations.shopapp.shop_tools`, one per kind of effect; the
parallel calls of a turn sleep seeded latencies, so the SDK finishes them in an order that
differs between seeds and between the dead process and the recovering one.

``python -m tests.integrations.agentapp serve`` is
:func:`tests.integrations.shopapp.main`'s fork server on this app.
"""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from agents import (
    Agent,
    AgentOutputSchemaBase,
    Handoff,
    Model,
    ModelProvider,
    ModelResponse,
    ModelSettings,
    ModelTracing,
    RunConfig,
    Tool,
    Usage,
    set_tracing_disabled,
)
from agents.items import TResponseInputItem, TResponseOutputItem, TResponseStreamEvent
from agents.testing import assistant_message, function_call
from openai.types.responses.response_prompt_param import ResponsePromptParam

import durably
from durably.integrations import openai_agents
from durably.integrations.openai_agents import durable_tool
from tests.integrations import shopapp

set_tracing_disabled(True)  # offline: no trace export

app = shopapp.crash_app()
TOOLS = shopapp.shop_tools(app)


# -- the model ----------------------------------------------------------------------------


def plan_of(items: str | list[TResponseInputItem]) -> dict[str, Any]:
    """The JSON plan in the conversation's first user message."""
    if isinstance(items, str):
        return dict(json.loads(items))
    first = next(i for i in items if isinstance(i, dict) and i.get("role") == "user")
    content = first["content"]  # type: ignore[typeddict-item]
    return dict(json.loads(content if isinstance(content, str) else content[0]["text"]))


def tool_outputs(items: str | list[TResponseInputItem]) -> list[str]:
    if isinstance(items, str):
        return []
    return [
        str(i["output"])  # type: ignore[typeddict-item]
        for i in items
        if isinstance(i, dict) and i.get("type") == "function_call_output"
    ]


def tool_call(name: str, arguments: dict[str, Any]) -> TResponseOutputItem:
    # Fresh ids, as a real model's: a repeated turn would be seen as new tool calls.
    return function_call(
        name, arguments, call_id=f"call_{uuid.uuid4().hex}", item_id=f"fc_{uuid.uuid4().hex}"
    )


def answer(items: str | list[TResponseInputItem]) -> list[TResponseOutputItem]:
    """What a model at temperature 0 answers to this conversation."""
    plan, outputs = plan_of(items), tool_outputs(items)
    calls = shopapp.next_calls(plan, outputs)
    if calls is not None:
        return [tool_call(plan["tool"], a) for a in calls]
    return [assistant_message(shopapp.final_answer(outputs), item_id=f"msg_{uuid.uuid4().hex}")]


class ScriptedModel(Model):
    """An offline model: :func:`answer`, with usage, counted in ``shopapp.MODEL_CALLS``."""

    model = "scripted-1"

    def __init__(self, decide: Callable[[Any], list[TResponseOutputItem]] = answer) -> None:
        self.decide = decide

    async def get_response(
        self,
        system_instructions: str | None,
        input: str | list[TResponseInputItem],
        model_settings: ModelSettings,
        tools: list[Tool],
        output_schema: AgentOutputSchemaBase | None,
        handoffs: list[Handoff],
        tracing: ModelTracing,
        *,
        previous_response_id: str | None,
        conversation_id: str | None,
        prompt: ResponsePromptParam | None,
    ) -> ModelResponse:
        shopapp.MODEL_CALLS[durably.current_run().run_id] += 1
        items = 1 if isinstance(input, str) else len(input)
        usage = Usage(requests=1, input_tokens=10 * items, output_tokens=7)
        usage.total_tokens = usage.input_tokens + usage.output_tokens
        return ModelResponse(
            output=self.decide(input), usage=usage, response_id=f"resp_{uuid.uuid4().hex}"
        )

    def stream_response(
        self,
        system_instructions: str | None,
        input: str | list[TResponseInputItem],
        model_settings: ModelSettings,
        tools: list[Tool],
        output_schema: AgentOutputSchemaBase | None,
        handoffs: list[Handoff],
        tracing: ModelTracing,
        *,
        previous_response_id: str | None,
        conversation_id: str | None,
        prompt: ResponsePromptParam | None,
    ) -> AsyncIterator[TResponseStreamEvent]:
        raise NotImplementedError("scripted: no streaming")

    def _supports_default_prompt_cache_key(self) -> bool:
        # As OpenAI's models do: the SDK then stamps a new prompt cache key on every run.
        return True


class ScriptedProvider(ModelProvider):
    def get_model(self, model_name: str | None) -> Model:
        return ScriptedModel()


# -- the agent and its workflow -------------------------------------------------------------

AGENT: Agent[Any] = Agent(
    name="shop-agent",
    instructions="Carry out the plan in the user's message with the tools, then report.",
    model="scripted-1",  # resolved by the run's provider, which openai_agents.run wraps
    tools=[durable_tool(t) for t in TOOLS.values()],
)


@app.workflow()
async def shop_agent(customer: str, campaign: str, tool: str, mode: str) -> dict[str, Any]:
    plan = {"customer": customer, "campaign": campaign, "tool": tool, "mode": mode}
    config = RunConfig(model_provider=ScriptedProvider(), tracing_disabled=True)
    result = await openai_agents.run(app, AGENT, json.dumps(plan), run_config=config)
    return {"answer": result.final_output}


if __name__ == "__main__":
    shopapp.main(app, sys.argv[1:])
