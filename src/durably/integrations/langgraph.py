"""LangGraph and LangChain inside a durably workflow (``pip install 'durably[langgraph]'``).

LangGraph runs its own graph; durably records what must not happen twice:

* :class:`DurableChatModel` wraps a LangChain chat model so that each generation is one
  recorded step, ``model:<name>``: a recovery replays the recorded ``AIMessage`` (its
  ``tool_calls`` and their ids included) instead of asking the model again, and charges its
  recorded ``usage_metadata`` to the run's budget.
* :func:`durable_tool` makes an ``@app.tool()`` (or ``@app.step()``) a LangChain
  ``StructuredTool`` whose call is the durably call at step id = the model's tool call id
  (``InjectedToolCallId``), so a recovery matches the calls ``ToolNode`` runs concurrently
  by id, in whatever order they start.

A graph run inside a durably workflow must have no LangGraph checkpointer: the journal is
the run's memory, and a second one would resume from state the journal does not hold.

Example::

    model = DurableChatModel(app, ChatOpenAI(model="gpt-4.1"))
    tools = [durable_tool(refund)]
    graph = build_graph(model.bind_tools(tools), ToolNode(tools))  # compile() without checkpointer

    @app.workflow()
    async def support(question: str) -> str:
        state = await graph.ainvoke({"messages": [("user", question)]})
        return str(state["messages"][-1].content)

See ``docs/integrations.md`` for what is guaranteed.
"""

from __future__ import annotations

import inspect
import json
import typing
from collections.abc import Callable, Sequence
from typing import Annotated, Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import AIMessage, BaseMessage, message_to_dict, messages_from_dict
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables import Runnable, RunnableBinding, ensure_config
from langchain_core.tools import BaseTool, InjectedToolCallId, StructuredTool
from pydantic import ConfigDict, PrivateAttr

import durably
from durably import ConfigurationError, Durable, RetryPolicy, context
from durably.integrations._common import jsonable, without_none
from durably.model_calls import model_step_name

__all__ = ["DurableChatModel", "canonical_request", "durable_tool"]

_CALL_ID_PARAMETER = "durably_tool_call_id"

_CHECKPOINTER_KEY = "__pregel_checkpointer"
"""Where LangGraph puts a graph's checkpointer in the run's config (``CONFIG_KEY_CHECKPOINTER``,
internal to LangGraph; the string is its documented wire value in every 1.x release)."""

_VOLATILE = ("id", "response_metadata", "usage_metadata")
"""Message fields that change on every execution of the same conversation: the ids LangChain
and LangGraph's ``add_messages`` draw, the provider's response metadata (ids, timings) and
token counts. Not what the model reads."""


# -- tools --------------------------------------------------------------------------------


def durable_tool(tool: Durable[..., Any], **options: Any) -> StructuredTool:
    """A LangChain ``StructuredTool`` for a durably tool or step.

    Its name, schema and description come from the durably function; ``options`` go to
    ``StructuredTool.from_function`` (``name``, ``description``, ``return_direct``, ...).
    A call awaits ``tool.with_step_id(tool_call_id)(**arguments)`` with the model's tool call
    id (``InjectedToolCallId``), so it must come from a tool call (``ToolNode``, or
    ``tool.ainvoke(tool_call)``); the idempotency key derives from the id. The result
    reaches the model as JSON text. LangGraph's ``interrupt()`` raised by the tool passes
    through unchanged and the call is recorded as not sent. A ``durably.RunStopped`` is a
    ``BaseException``: ``ToolNode``'s error handling does not catch it.
    """
    name = tool.definition.name

    async def invoke(*args: Any, **kwargs: Any) -> str:
        call_id = kwargs.pop(_CALL_ID_PARAMETER, None)
        if not call_id:
            raise ConfigurationError(
                f"{name}: called without a tool call id; a durable tool is called with the "
                "model's tool call (ToolNode, or tool.ainvoke(tool_call))"
            )
        _refuse_checkpointer(name)
        result = await tool.with_step_id(call_id)(*args, **kwargs)
        return result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)

    fn = tool.fn
    signature = inspect.signature(fn)
    hints = typing.get_type_hints(fn, include_extras=True)
    parameters = [
        p.replace(annotation=hints.get(p.name, p.annotation)) for p in signature.parameters.values()
    ]
    injected = inspect.Parameter(
        _CALL_ID_PARAMETER,
        inspect.Parameter.KEYWORD_ONLY,
        annotation=Annotated[str, InjectedToolCallId],
    )
    wrapper: Any = invoke
    wrapper.__signature__ = signature.replace(
        parameters=[*parameters, injected], return_annotation=str
    )
    wrapper.__annotations__ = {
        **{p.name: p.annotation for p in parameters if p.annotation is not p.empty},
        _CALL_ID_PARAMETER: injected.annotation,
        "return": str,
    }
    for attribute in ("__name__", "__qualname__", "__doc__", "__module__"):
        setattr(wrapper, attribute, getattr(fn, attribute, None))
    options.setdefault("name", name)
    options.setdefault("description", inspect.getdoc(fn) or name)
    return StructuredTool.from_function(coroutine=wrapper, **options)


def _task_step_id(step: str) -> str | None:
    """The step id of a generation made in a LangGraph node: ``<step>@<super-step>/<node>/
    <task>#<n>``, the n-th of that task (subgraph nodes under their parents' names).

    LangGraph runs a super-step's nodes concurrently, so the order their generations start
    in is latency's; an id of their task's own lets a replay match them in any order. None
    outside a graph, and in a run whose generations of this model were all recorded by
    position (by a version before this one): it replays as it was recorded.
    """
    metadata = ensure_config().get("metadata") or {}
    node, superstep = metadata.get("langgraph_node"), metadata.get("langgraph_step")
    if node is None or superstep is None:
        return None
    run = context.active()
    by_position = [s for s in run.steps if s.startswith(step + "#")]
    if by_position and not any(s.startswith(step + "@") for s in run.steps):
        return None
    # ('__pregel_pull', 'agent') or ('__pregel_push', 2, False): the task within its node.
    path = metadata.get("langgraph_path") or ()
    task = ".".join(str(p) for p in path[1:] if not isinstance(p, bool))
    parents = str(metadata.get("langgraph_checkpoint_ns") or "").split("|")[:-1]
    where = "/".join([*(p.split(":")[0] for p in parents), str(superstep), str(node), task])
    prefix = f"{step}@{where}#".replace("|", "_")
    # Calls one task makes are numbered in the order it makes them, like positional ones.
    return f"{prefix}{1 + sum(s.startswith(prefix) for s in run.reached)}"


def _refuse_checkpointer(what: str) -> None:
    """Refuse a LangGraph checkpointer on the graph this call runs in."""
    configurable = ensure_config().get("configurable") or {}
    if configurable.get(_CHECKPOINTER_KEY) is not None:
        raise ConfigurationError(
            f"{what}: the graph runs with a LangGraph checkpointer inside a durably workflow. "
            "Its checkpoints live outside the run's journal, so a recovery would resume the "
            "graph from state the journal does not hold (and thread ids outlive the run). "
            "Compile the graph without checkpointer=; durably's journal replays it"
        )


# -- models -------------------------------------------------------------------------------


class DurableChatModel(BaseChatModel):
    """A chat model whose every generation is one recorded model call of the durably run
    (:meth:`durably.App.call_model`).

    The step is named ``model:<name>`` (``name``, else the model's ``model_name`` or
    ``model`` attribute, else its ``_llm_type``) and hashed by :func:`canonical_request`.
    Its result is the ``AIMessage`` as JSON (LangChain's ``message_to_dict``); the first
    execution and every replay rebuild the same message from it. The message's
    ``usage_metadata["total_tokens"]`` is charged to the run's budget. ``bind_tools`` binds
    what the wrapped model's own ``bind_tools`` would. Async only (``ainvoke``,
    ``graph.ainvoke``): a durably call is awaited.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    model: BaseChatModel
    model_name: str
    step: str
    retry: RetryPolicy | None = None
    _app: durably.App = PrivateAttr()

    def __init__(
        self,
        app: durably.App,
        model: BaseChatModel,
        *,
        name: str | None = None,
        retry: RetryPolicy | None = None,
        **kwargs: Any,
    ) -> None:
        inner = model.model if isinstance(model, DurableChatModel) else model
        model_name = name or _model_name(inner)
        # BaseChatModel's typed __init__ does not know this subclass's own fields.
        fields: dict[str, Any] = {
            "model": inner,
            "model_name": model_name,
            "step": model_step_name(model_name),
            "retry": retry,
        }
        super().__init__(**fields, **kwargs)
        self._app = app

    @property
    def _llm_type(self) -> str:
        return f"durably:{self.model._llm_type}"

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool],
        *,
        tool_choice: str | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        if tool_choice is not None:
            kwargs["tool_choice"] = tool_choice
        bound = self.model.bind_tools(tools, **kwargs)
        if not isinstance(bound, RunnableBinding) or bound.bound is not self.model:
            raise ConfigurationError(
                f"{self.step}: {type(self.model).__name__}.bind_tools returned "
                f"{type(bound).__name__}, not the model with bound arguments, so calls through "
                "it would not be recorded; wrap a chat model whose bind_tools binds arguments"
            )
        return self.bind(**bound.kwargs)

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        raise ConfigurationError(
            f"{self.step}: a recorded model call is awaited inside the durably workflow; use "
            "ainvoke (graph.ainvoke, graph.astream), not invoke"
        )

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        _refuse_checkpointer(self.step)
        recorded = await self._app.call_model(
            self.model_name,
            self._respond,
            messages,
            stop=stop,
            canonical=canonical_request,
            retry=self.retry,
            usage=_usage,
            step_id=_task_step_id(self.step),
            **kwargs,
        )
        message = messages_from_dict([recorded["message"]])[0]
        return ChatResult(
            generations=[ChatGeneration(message=message)], llm_output=recorded.get("llm_output")
        )

    async def _respond(
        self, messages: list[BaseMessage], stop: list[str] | None = None, **kwargs: Any
    ) -> dict[str, Any]:
        result = await self.model.agenerate([messages], stop=stop, **kwargs)
        generation = result.generations[0][0]
        if not isinstance(generation, ChatGeneration):
            raise TypeError(f"{self.step}: the model gave {type(generation).__name__}")
        recorded: dict[str, Any] = {"message": jsonable(message_to_dict(generation.message))}
        if result.llm_output:
            recorded["llm_output"] = jsonable(result.llm_output)
        return recorded


def canonical_request(
    messages: list[BaseMessage], stop: list[str] | None = None, **kwargs: Any
) -> dict[str, Any]:
    """What a model call's input hash covers: what the model is given to read.

    The messages (content, tool calls and their ids, tool call ids of tool results, names),
    ``stop`` and the bound options (the tools' schemas, ``tool_choice``, ...). Left out,
    because they change from one execution to the next while the request means the same:
    message ids, response metadata, token usage, and fields that are None.
    """
    return {
        "messages": [_message(m) for m in messages],
        "stop": stop,
        "options": without_none(jsonable(kwargs)),
    }


def _message(message: BaseMessage) -> Any:
    plain = jsonable(message_to_dict(message))
    data = plain.get("data") if isinstance(plain, dict) else None
    if isinstance(data, dict):
        for volatile in _VOLATILE:
            data.pop(volatile, None)
    return without_none(plain)


def _usage(recorded: dict[str, Any]) -> Any:
    """A recorded generation's token usage: its message's ``usage_metadata``."""
    return recorded["message"]["data"].get("usage_metadata")


def _model_name(model: BaseChatModel) -> str:
    for attribute in ("model_name", "model"):
        name = getattr(model, attribute, None)
        if isinstance(name, str) and name:
            return name
    return model._llm_type
