"""Pydantic AI inside a durably workflow (``pip install 'durably[pydantic-ai]'``).

Pydantic AI runs its own loop; durably records what must not happen twice:

* :class:`DurablyDurability` is a durability capability on Pydantic AI's public
  durable-execution API (``pydantic_ai.durable_exec``, as its Temporal, DBOS and Prefect
  ones): inside a durably workflow each model request is one recorded step,
  ``model:<name>``. A recovery replays the recorded ``ModelResponse`` instead of asking the
  model again, and charges its recorded tokens to the run's budget.
* :func:`durable_tool` makes an ``@app.tool()`` (or ``@app.step()``) a Pydantic AI ``Tool``
  whose call is the durably call at step id = the model's tool call id, so a recovery
  matches a turn's tool calls by id, in whatever order Pydantic AI starts them;
  :func:`durable_toolset` makes a ``FunctionToolset`` of them.

Example::

    agent = Agent(model, name="support", tools=[durable_tool(refund)],
                  capabilities=[DurablyDurability(app)])

    @app.workflow()
    async def support(question: str) -> str:
        return (await agent.run(question)).output

See ``docs/integrations.md`` for what is guaranteed.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

from pydantic import TypeAdapter
from pydantic_ai import FunctionToolset, RunContext, Tool
from pydantic_ai.durable_exec import (
    JSON_CODEC,
    BaseDurabilityCapability,
    CallableOperationBackend,
    DurabilityEngineSpec,
    DurableOperationBackend,
    DurableOperationId,
    JournalOperationNamer,
    ModelRequestId,
    RoleBasedOperationConfig,
)
from pydantic_ai.messages import ModelMessage
from pydantic_ai.models import ModelRequestParameters

import durably
from durably import ConfigurationError, Durable, OutsideRunError, RetryPolicy
from durably.integrations._common import (
    jsonable,
    tool_function,
    without_none,
)

__all__ = ["DurablyDurability", "canonical_request", "durable_tool", "durable_toolset"]

_MESSAGES: TypeAdapter[list[ModelMessage]] = TypeAdapter(list[ModelMessage])
_PARAMETERS: TypeAdapter[ModelRequestParameters] = TypeAdapter(ModelRequestParameters)

_VOLATILE = frozenset({"timestamp", "run_id", "conversation_id", "provider_response_id"})
"""Message fields that change on every execution of the same conversation: when a part
or message was made, the ids Pydantic AI draws per ``agent.run``, the provider's response
id. Not what the model reads."""

_CONTEXT_PARAMETER = "durably_run_context"


# -- tools --------------------------------------------------------------------------------


def durable_tool(tool: Durable[..., Any], **options: Any) -> Tool[Any]:
    """A Pydantic AI ``Tool`` for a durably tool or step.

    Its name, schema and description come from the durably function; ``options`` go to
    ``Tool`` (``name``, ``max_retries``, ``sequential``, ...). A call awaits
    ``tool.with_step_id(ctx.tool_call_id)(**arguments)``: the model's tool call id is the
    step id, and the idempotency key derives from it. Pydantic AI's ``ModelRetry``,
    ``CallDeferred`` and ``ApprovalRequired`` raised by the tool reach Pydantic AI unchanged
    (durably records the call as not sent). A ``durably.RunStopped`` is a ``BaseException``
    and ends ``agent.run``. A call from an agent without :class:`DurablyDurability` is
    refused: its model requests are not recorded, so a recovery would get the call again
    under a new id.
    """
    for option in ("requires_approval", "timeout"):
        if options.get(option) not in (None, False):
            raise ConfigurationError(
                f"durable_tool({tool.definition.name}, {option}=...): "
                + (
                    "Pydantic AI's approval ends agent.run with deferred tool requests the "
                    "run's journal does not hold; declare the tool "
                    "@app.tool(requires_approval=True) instead"
                    if option == "requires_approval"
                    else "Pydantic AI's timeout cancels the call wherever it is, also between "
                    "the request and its record; declare the tool @app.tool(timeout=...) so a "
                    "timeout is an unknown outcome that durably settles"
                )
            )

    async def invoke(ctx: RunContext[Any], /, *args: Any, **kwargs: Any) -> Any:
        if ctx.tool_call_id is None:
            raise ConfigurationError(
                f"{tool.definition.name}: called without a tool call id; a durable tool is "
                "called by the model, through agent.run"
            )
        if ctx.agent is None or DurablyDurability.from_agent(ctx.agent) is None:
            raise ConfigurationError(
                f"{tool.definition.name}: the agent's model requests are not recorded, so a "
                "recovery would ask the model again and get this call under a new id: a new "
                "effect. Give the agent capabilities=[DurablyDurability(app)]"
            )
        return await tool.with_step_id(ctx.tool_call_id)(*args, **kwargs)

    returns = typing.get_type_hints(tool.fn).get("return", inspect.Signature.empty)
    wrapper = tool_function(
        invoke, tool.fn, context=(_CONTEXT_PARAMETER, RunContext[Any]), returns=returns
    )
    options.setdefault("name", tool.definition.name)
    return Tool(wrapper, takes_ctx=True, **options)


def durable_toolset(*tools: Durable[..., Any], id: str | None = None) -> FunctionToolset[Any]:
    """A ``FunctionToolset`` of :func:`durable_tool` tools, for ``Agent(toolsets=[...])``."""
    return FunctionToolset([durable_tool(t) for t in tools], id=id)


# -- models -------------------------------------------------------------------------------


class _Backend(CallableOperationBackend[None]):
    """Runs Pydantic AI's durable units as durably steps: a model request is one step."""

    def __init__(self, capability: DurablyDurability) -> None:
        super().__init__(
            namer=JournalOperationNamer(capability.name),
            config=RoleBasedOperationConfig(model=None, event=None, capability=None, tool=None),
        )
        self.capability = capability

    async def execute(
        self,
        *,
        operation_id: DurableOperationId,
        name: str,
        body: Callable[[], Awaitable[object]],
        cache_key: tuple[object, ...],
        config: None,
    ) -> object:
        if not isinstance(operation_id, ModelRequestId):
            raise ConfigurationError(
                f"{name}: durably records Pydantic AI's model requests and durable tools; this "
                f"operation ({type(operation_id).__name__}) is not supported inside a durably "
                "workflow yet"
            )
        if operation_id.streaming:
            raise ConfigurationError(
                f"model:{operation_id.model_name}: streaming is not recorded, so a recovery "
                "could not replay what was streamed; use agent.run (no event_stream_handler), "
                "not agent.run_stream or agent.iter's streaming"
            )
        request = _request(cache_key)

        async def respond(request: dict[str, Any]) -> object:
            del request  # hashed and stored; the unit's body holds the live objects
            return await body()

        return await self.capability.app.call_model(
            operation_id.model_name,
            respond,
            request,
            canonical=canonical_request,
            retry=self.capability.retry,
        )


class DurablyDurability(BaseDurabilityCapability[Any]):
    """The durability capability: ``Agent(..., capabilities=[DurablyDurability(app)])``.

    Inside a durably workflow, each model request of the agent is one recorded model call
    (:meth:`durably.App.call_model`), ``model:<model name>``, hashed by
    :func:`canonical_request`; its result is the ``ModelResponse`` as JSON (Pydantic AI's
    own serialization), rebuilt from the journal on every replay. Its
    ``input_tokens + output_tokens`` are charged to the run's budget.
    ``retry`` is the step's retry policy (durably's default when None). Tools are not
    wrapped: give the agent :func:`durable_tool` tools. Outside a workflow the agent runs
    as usual.
    """

    engine_spec: ClassVar[DurabilityEngineSpec] = DurabilityEngineSpec(
        engine_name="durably",
        durable_unit_noun="step",
        durable_container_noun="workflow",
        codec=JSON_CODEC,
        # Tools record themselves (durable_tool): a step around a durably tool call would
        # nest one durable call in another.
        wrapped_toolset_kinds=frozenset(),
        toolset_lifecycles={},
        journal_discovery=False,
    )

    def __init__(
        self,
        app: durably.App,
        *,
        name: str | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        super().__init__(name=name)
        self.app = app
        self.retry = retry

    @property
    def in_durable_context(self) -> bool:
        try:
            durably.current_run()
        except OutsideRunError:
            return False
        return True

    def get_durable_operation_backend(self) -> DurableOperationBackend[Any]:
        return _Backend(self)


def _request(cache_key: tuple[object, ...]) -> dict[str, Any]:
    """The model request in ``cache_key`` (the base's projection of its parameters) as JSON:
    the messages, the model settings and the request parameters (tools, output schema)."""
    messages = next(v for v in cache_key if isinstance(v, list))
    parameters = next(v for v in cache_key if isinstance(v, ModelRequestParameters))
    settings = next((v for v in cache_key if isinstance(v, dict)), None)
    return {
        "messages": _MESSAGES.dump_python(messages, mode="json"),
        "settings": jsonable(settings),
        "parameters": _PARAMETERS.dump_python(parameters, mode="json"),
    }


def canonical_request(request: dict[str, Any]) -> dict[str, Any]:
    """What a model request's input hash covers: what the model is given to read.

    Left out, because they change from one execution to the next while the request means
    the same: timestamps, Pydantic AI's per-run ``run_id`` and ``conversation_id``, the
    provider's response id, and fields that are None.
    """
    messages = [
        {
            **_stable(message),
            "parts": [_stable(part) for part in message.get("parts", [])],
        }
        for message in request["messages"]
    ]
    plain = without_none({**request, "messages": messages})
    return plain if isinstance(plain, dict) else {}


def _stable(item: dict[str, Any]) -> dict[str, Any]:
    # Only a message's and a part's own fields: a tool argument named "timestamp" counts.
    return {k: v for k, v in item.items() if k not in _VOLATILE}
