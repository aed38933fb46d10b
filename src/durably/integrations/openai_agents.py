"""The OpenAI Agents SDK inside a durably workflow (``pip install 'durably[openai-agents]'``).

The SDK runs its own loop; durably records what must not happen twice:

* :func:`durable_tool` makes an ``@app.tool()`` (or ``@app.step()``) an SDK ``FunctionTool``
  whose invocation is the durably call at step id = the model's tool call id, so a recovery
  matches a turn's tool calls by id, in whatever order the SDK starts them.
* :class:`DurableModel` and :class:`DurableModelProvider` make each ``Model.get_response``
  one recorded step, ``model:<name>``: a recovery replays the recorded ``ModelResponse``
  instead of asking the model again, and charges its recorded tokens to the run's budget.
* :func:`run` is ``Runner.run`` with both in place. ``session=`` and streaming are refused.

Example::

    agent = Agent(name="support", instructions="...", tools=[durable_tool(refund)])

    @app.workflow()
    async def support(question: str) -> str:
        result = await openai_agents.run(app, agent, question)
        return str(result.final_output)

See ``docs/integrations.md`` for what is guaranteed.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from typing import Any

from agents import (
    Agent,
    AgentOutputSchemaBase,
    FunctionTool,
    Handoff,
    Model,
    ModelProvider,
    ModelResponse,
    ModelSettings,
    ModelTracing,
    MultiProvider,
    RunConfig,
    Runner,
    RunResult,
    Tool,
    function_tool,
)
from agents.items import TResponseInputItem, TResponseStreamEvent
from agents.retry import ModelRetryAdvice, ModelRetryAdviceRequest
from agents.tool_context import ToolContext
from openai.types.responses.response_prompt_param import ResponsePromptParam
from pydantic import TypeAdapter

import durably
from durably import ConfigurationError, Durable, RetryPolicy
from durably.integrations._common import (
    jsonable,
    opaque,
    tool_function,
    without_none,
)
from durably.model_calls import model_step_name

__all__ = [
    "DurableModel",
    "DurableModelProvider",
    "canonical_request",
    "durable_run_config",
    "durable_tool",
    "run",
]

_RESPONSE: TypeAdapter[ModelResponse] = TypeAdapter(ModelResponse)

_CONTEXT_PARAMETER = "durably_tool_context"

_REFUSED_TOOL_OPTIONS = {
    "needs_approval": (
        "the SDK's approval interrupts Runner.run and hands back a RunState that the run's "
        "journal does not hold; declare the tool @app.tool(requires_approval=True) instead"
    ),
    "timeout": (
        "the SDK's timeout cancels the call wherever it is, also between the request and its "
        "record; declare the tool @app.tool(timeout=...) so a timeout is an unknown outcome "
        "that durably settles"
    ),
}

_VOLATILE_SETTINGS = ("prompt_cache_key",)
"""Model settings that change on every execution: the SDK generates a prompt cache key per
``Runner.run``. A cache hint, not what the model reads."""


# -- tools --------------------------------------------------------------------------------


def durable_tool(tool: Durable[..., Any], **options: Any) -> FunctionTool:
    """The SDK's ``FunctionTool`` for a durably tool or step, built by ``function_tool``.

    Its schema and description come from the durably function; ``options`` go to
    ``function_tool`` (``name_override``, ``failure_error_function``, ...). An invocation
    awaits ``tool.with_step_id(tool_call_id)(**arguments)``: the model's tool call id is the
    step id, and the idempotency key derives from it. The result reaches the model as JSON
    text. A ``durably.StepFailed`` goes to the model like any tool error; a
    ``durably.RunStopped`` is a ``BaseException`` and ends ``Runner.run``.
    """
    for option, instead in _REFUSED_TOOL_OPTIONS.items():
        if options.get(option) not in (None, False):
            raise ConfigurationError(
                f"durable_tool({tool.definition.name}, {option}=...): {instead}"
            )

    async def invoke(tool_context: ToolContext[Any], /, *args: Any, **kwargs: Any) -> str:
        result = await tool.with_step_id(tool_context.tool_call_id)(*args, **kwargs)
        return result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)

    wrapper = tool_function(invoke, tool.fn, context=(_CONTEXT_PARAMETER, ToolContext), returns=str)
    options.setdefault("name_override", tool.definition.name)
    built: FunctionTool = function_tool(wrapper, **options)
    return built


# -- models -------------------------------------------------------------------------------


class DurableModel(Model):
    """A ``Model`` whose every ``get_response`` is one recorded model call of the durably
    run (:meth:`durably.App.call_model`).

    The step is named ``model:<name>`` (``name``, else the model's ``model`` attribute,
    else its class) and hashed by :func:`canonical_request`. Its result is the
    ``ModelResponse`` as JSON; the first execution and every replay rebuild the same
    object from it. The response's ``usage.total_tokens`` is charged to the run's budget.
    ``retry`` is the step's retry policy (durably's default when None).
    """

    def __init__(
        self,
        app: durably.App,
        model: Model,
        *,
        name: str | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        self.app = app
        self.model: Model = model.model if isinstance(model, DurableModel) else model
        self.model_name = name or _model_name(self.model)
        self.step_name = model_step_name(self.model_name)
        self.retry = retry

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
        recorded = await self.app.call_model(
            self.model_name,
            self._respond,
            system_instructions,
            input,
            model_settings,
            tools,
            output_schema,
            handoffs,
            tracing,
            previous_response_id=previous_response_id,
            conversation_id=conversation_id,
            prompt=prompt,
            canonical=canonical_request,
            retry=self.retry,
        )
        return _RESPONSE.validate_python(recorded)

    async def _respond(
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
    ) -> dict[str, Any]:
        response = await self.model.get_response(
            system_instructions,
            input,
            model_settings,
            tools,
            output_schema,
            handoffs,
            tracing,
            previous_response_id=previous_response_id,
            conversation_id=conversation_id,
            prompt=prompt,
        )
        # exclude_unset: the SDK turns output items back into input with
        # model_dump(exclude_unset=True), so the rebuilt items must have the same fields set.
        dumped: dict[str, Any] = _RESPONSE.dump_python(response, mode="json", exclude_unset=True)
        return dumped

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
        raise ConfigurationError(
            f"{self.step_name}: streaming is not recorded, so a recovery could not replay "
            "what was streamed; use Runner.run (or openai_agents.run), not Runner.run_streamed"
        )

    def get_retry_advice(self, request: ModelRetryAdviceRequest) -> ModelRetryAdvice | None:
        return self.model.get_retry_advice(request)

    async def close(self) -> None:
        await self.model.close()

    async def _cleanup_on_run_end(self, owner: object) -> None:
        await self.model._cleanup_on_run_end(owner)

    def _supports_default_prompt_cache_key(self) -> bool:
        # Keeps the SDK's prompt cache key for the wrapped model; canonical_request drops it.
        supports = getattr(self.model, "_supports_default_prompt_cache_key", None)
        return bool(supports()) if callable(supports) else False


class DurableModelProvider(ModelProvider):
    """A ``ModelProvider`` whose models are :class:`DurableModel` (``provider`` defaults
    to the SDK's ``MultiProvider``): agents that name their model get recorded calls."""

    def __init__(
        self,
        app: durably.App,
        provider: ModelProvider | None = None,
        *,
        retry: RetryPolicy | None = None,
    ) -> None:
        self.app = app
        self.provider = provider if provider is not None else MultiProvider()
        self.retry = retry

    def get_model(self, model_name: str | None) -> Model:
        model = self.provider.get_model(model_name)
        if isinstance(model, DurableModel):
            return model
        return DurableModel(self.app, model, name=model_name, retry=self.retry)

    async def aclose(self) -> None:
        await self.provider.aclose()


def canonical_request(
    system_instructions: str | None,
    input: str | list[TResponseInputItem],
    model_settings: ModelSettings,
    tools: list[Tool],
    output_schema: AgentOutputSchemaBase | None,
    handoffs: list[Handoff],
    tracing: ModelTracing,
    *,
    previous_response_id: str | None = None,
    conversation_id: str | None = None,
    prompt: ResponsePromptParam | None = None,
) -> dict[str, Any]:
    """What a model call's input hash covers: what the model is given to read.

    Left out, because they change from one execution to the next while the request means
    the same: item ids, the SDK's per-run prompt cache key, the ids of server-side state
    (``previous_response_id``, ``conversation_id``), tracing, and fields that are None.
    Objects that are not JSON (a hosted tool's callbacks) count by their type.
    """
    del tracing, previous_response_id, conversation_id
    return {
        "instructions": system_instructions,
        "input": input if isinstance(input, str) else [_input_item(i) for i in input],
        "settings": _settings(model_settings),
        "tools": [_tool(t) for t in tools],
        "output_schema": _output_schema(output_schema),
        "handoffs": [_handoff(h) for h in handoffs],
        "prompt": _json_of(prompt),
    }


def _input_item(item: Any) -> Any:
    plain = _json_of(item)
    if isinstance(plain, dict):
        plain.pop("id", None)
    return plain


def _settings(settings: ModelSettings) -> Any:
    plain = _json_of(settings)
    for extra in ("extra_args", "extra_body"):
        values = plain.get(extra)
        if isinstance(values, dict):
            for volatile in _VOLATILE_SETTINGS:
                values.pop(volatile, None)
            if not values:
                del plain[extra]
    return plain


def _tool(tool: Tool) -> Any:
    if isinstance(tool, FunctionTool):
        return {
            "function": tool.qualified_name,
            "description": tool.description,
            "parameters": _json_of(tool.params_json_schema),
            "strict": tool.strict_json_schema,
        }
    return {"tool": opaque(tool), "config": _json_of(tool)}


def _handoff(handoff: Handoff) -> Any:
    return {
        "handoff": handoff.tool_name,
        "description": handoff.tool_description,
        "parameters": _json_of(handoff.input_json_schema),
        "agent": handoff.agent_name,
        "strict": handoff.strict_json_schema,
    }


def _output_schema(schema: AgentOutputSchemaBase | None) -> Any:
    if schema is None:
        return None
    plain_text = schema.is_plain_text()
    return {
        "name": schema.name(),
        "plain_text": plain_text,
        "strict": schema.is_strict_json_schema(),
        "schema": None if plain_text else _json_of(schema.json_schema()),
    }


def _model_name(model: Model) -> str:
    name = getattr(model, "model", None)
    return name if isinstance(name, str) and name else type(model).__name__


# -- the runner ---------------------------------------------------------------------------


def durable_run_config(
    app: durably.App, run_config: RunConfig | None = None, *, retry: RetryPolicy | None = None
) -> RunConfig:
    """A copy of ``run_config`` (or a new one) whose model calls are recorded steps: its
    provider wrapped in :class:`DurableModelProvider`, its ``model`` in :class:`DurableModel`."""
    config = run_config if run_config is not None else RunConfig()
    provider = config.model_provider
    if not isinstance(provider, DurableModelProvider):
        provider = DurableModelProvider(app, provider, retry=retry)
    model = config.model
    if isinstance(model, Model) and not isinstance(model, DurableModel):
        model = DurableModel(app, model, retry=retry)
    return replace(config, model_provider=provider, model=model)


async def run(
    app: durably.App,
    agent: Agent[Any],
    input: str | list[TResponseInputItem],
    *,
    run_config: RunConfig | None = None,
    session: None = None,
    **kwargs: Any,
) -> RunResult:
    """``Runner.run(agent, input, ...)`` inside a durably workflow, its model calls recorded.

    ``kwargs`` go to ``Runner.run`` (``context``, ``max_turns``, ``hooks``, ...). Refused:
    ``session=`` (the SDK writes a session outside the run's journal, so a replay would add
    every turn to it again: the journal already holds the history), and an agent of the
    run whose ``model`` is a ``Model`` object not wrapped in :class:`DurableModel`.
    """
    if session is not None:
        raise ConfigurationError(
            "openai_agents.run(session=...): the SDK writes its session outside the run's "
            "journal, so a replay would add every turn to it again; the journal already keeps "
            "the history. Pass the earlier conversation as input instead"
        )
    config = durable_run_config(app, run_config)
    _refuse_unrecorded_models(agent, config)
    try:
        return await Runner.run(agent, input, run_config=config, **kwargs)
    finally:
        if run_config is None:  # the provider is this call's own, as Runner's would be
            await config.model_provider.aclose()


def _refuse_unrecorded_models(agent: Agent[Any], config: RunConfig) -> None:
    if isinstance(config.model, Model):
        return  # every agent of the run uses it
    for each in _reachable(agent):
        if isinstance(each.model, Model) and not isinstance(each.model, DurableModel):
            raise ConfigurationError(
                f"agent {each.name!r} has a model object ({type(each.model).__name__}) whose "
                "calls durably would not record, so a recovery would ask it again; give it "
                "DurableModel(app, model), or name the model (model='...') so the run's "
                "provider records it"
            )


def _reachable(agent: Agent[Any]) -> Iterator[Agent[Any]]:
    """``agent`` and the agents its handoffs lead to, transitively."""
    seen: set[int] = set()
    pending = [agent]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        for handoff in current.handoffs:
            if isinstance(handoff, Agent):
                pending.append(handoff)
                continue
            # A Handoff keeps a weak reference to its agent (private); without one, the
            # target is known only when the handoff runs.
            ref = getattr(handoff, "_agent_ref", None)
            target = ref() if callable(ref) else None
            if isinstance(target, Agent):
                pending.append(target)


def _json_of(value: Any) -> Any:
    return without_none(jsonable(value))
